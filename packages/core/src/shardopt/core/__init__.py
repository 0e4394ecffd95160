"""shardopt.core: pure, JAX-style optimizers that match torch.optim, and partition planners.

What a training loop calls is here; the building blocks for writing new transformations (tree
helpers, ``leafwise``, piece rules, the validated hyperparameters of the optimizers) are in
:mod:`shardopt.core.blocks`.
"""

from shardopt.core._accumulate import MultiStepsState, multi_steps
from shardopt.core._adadelta import ScaleByAdadeltaState, adadelta
from shardopt.core._adafactor import ScaleByAdafactorState, adafactor
from shardopt.core._adagrad import ScaleByAdagradState, adagrad, scale_by_adagrad
from shardopt.core._adam import (
    ScaleByAdamState,
    adam,
    adamw,
    add_decoupled_weight_decay,
    scale_by_adam,
)
from shardopt.core._adamax import ScaleByAdamaxState, adamax
from shardopt.core._asgd import ScaleByAsgdState, asgd
from shardopt.core._base import (
    EmptyState,
    Transformation,
    apply_updates,
    chain,
    identity,
)
from shardopt.core._clipping import clip, clip_by_global_norm, global_norm
from shardopt.core._combinators import MaskedState, PartitionState, masked, partition
from shardopt.core._inject import InjectHyperparamsState, inject_hyperparams, set_hyperparams
from shardopt.core._muon import ScaleByMuonState, muon, newton_schulz_flops
from shardopt.core._nadam import ScaleByNadamState, nadam
from shardopt.core._optax_adaptive import (
    ScaleByAdanState,
    ScaleByAdemamixState,
    ScaleByMomentsState,
    adabelief,
    adan,
    ademamix,
    adopt,
    yogi,
)
from shardopt.core._optax_sign import EmaState, ScaleByLionState, ema, lion, sign_sgd, signum
from shardopt.core._optax_transforms import (
    AddNoiseState,
    ZeroNansState,
    adaptive_grad_clip,
    add_noise,
    centralize,
    zero_nans,
)
from shardopt.core._optax_trust import (
    ScaleByNovogradState,
    clip_by_block_rms,
    lamb,
    lars,
    novograd,
    scale_by_trust_ratio,
)
from shardopt.core._optax_wrappers import (
    ApplyIfFiniteState,
    LookaheadState,
    ScheduleFreeState,
    apply_if_finite,
    lookahead,
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
)
from shardopt.core._pieces import update_pieces_
from shardopt.core._plan import (
    DEFAULT_BUCKET_NUMEL,
    Bucket,
    BufferGroup,
    Piece,
    Plan,
    Strategy,
    TensorSpec,
    plan_partition,
)
from shardopt.core._precision import with_state_dtype
from shardopt.core._radam import ScaleByRadamState, radam
from shardopt.core._renamed import renamed_getattr
from shardopt.core._rmsprop import ScaleByRmsState, rmsprop
from shardopt.core._rprop import ScaleByRpropState, rprop, scale_by_rprop
from shardopt.core._schedules import (
    ScalarOrSchedule,
    Schedule,
    constant,
    cosine_decay,
    join_schedules,
    linear_warmup,
    warmup_cosine_decay,
)
from shardopt.core._sgd import TraceState, sgd, step_by_learning_rate, trace
from shardopt.core._transforms import (
    ScaleByScheduleState,
    add_decayed_weights,
    scale,
    scale_by_learning_rate,
)

__all__ = [
    "AddNoiseState",
    "ApplyIfFiniteState",
    "EmaState",
    "LookaheadState",
    "ScaleByAdanState",
    "ScaleByAdemamixState",
    "ScaleByLionState",
    "ScaleByMomentsState",
    "ScaleByNovogradState",
    "ScheduleFreeState",
    "ZeroNansState",
    "adabelief",
    "adan",
    "adaptive_grad_clip",
    "add_noise",
    "ademamix",
    "adopt",
    "apply_if_finite",
    "centralize",
    "clip_by_block_rms",
    "ema",
    "lamb",
    "lars",
    "lion",
    "lookahead",
    "novograd",
    "scale_by_trust_ratio",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "sign_sgd",
    "signum",
    "yogi",
    "zero_nans",
    "Bucket",
    "BufferGroup",
    "DEFAULT_BUCKET_NUMEL",
    "EmptyState",
    "InjectHyperparamsState",
    "MaskedState",
    "MultiStepsState",
    "PartitionState",
    "Piece",
    "Plan",
    "ScalarOrSchedule",
    "ScaleByAdadeltaState",
    "ScaleByAdafactorState",
    "ScaleByAdagradState",
    "ScaleByAdamState",
    "ScaleByAdamaxState",
    "ScaleByAsgdState",
    "ScaleByMuonState",
    "ScaleByNadamState",
    "ScaleByRadamState",
    "ScaleByRmsState",
    "ScaleByRpropState",
    "ScaleByScheduleState",
    "Schedule",
    "Strategy",
    "TensorSpec",
    "TraceState",
    "Transformation",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "add_decayed_weights",
    "add_decoupled_weight_decay",
    "apply_updates",
    "asgd",
    "chain",
    "clip",
    "clip_by_global_norm",
    "constant",
    "cosine_decay",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "join_schedules",
    "linear_warmup",
    "masked",
    "multi_steps",
    "muon",
    "nadam",
    "newton_schulz_flops",
    "partition",
    "plan_partition",
    "radam",
    "rmsprop",
    "rprop",
    "scale",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_rprop",
    "set_hyperparams",
    "sgd",
    "step_by_learning_rate",
    "trace",
    "update_pieces_",
    "warmup_cosine_decay",
    "with_state_dtype",
]

# Old names (see [Note: renamed core names] in _renamed.py):
__getattr__ = renamed_getattr(
    __name__, {"FlatGroup": "BufferGroup", "update_flat_": "update_pieces_"}, globals()
)
