"""shardopt.testing: multi-process worlds and equivalence checks against torch.optim."""

from shardopt.testing._candidates import (
    Candidate,
    CandidateFactory,
    average_gradients,
    torch_optimizer_candidate,
    with_gradient_averaging,
    zero_redundancy_candidate,
)
from shardopt.testing._collectives_count import CollectiveCall, CollectiveLog, count_collectives
from shardopt.testing._compare import DEFAULT_RTOL
from shardopt.testing._equivalence import EquivalenceReport, ReferenceGrads, assert_matches_torch
from shardopt.testing._errors import (
    Outcome,
    RankError,
    RankExitError,
    RankFailure,
    WorldError,
    WorldTimeoutError,
)
from shardopt.testing._models import (
    build_conv_net,
    build_frozen_mlp,
    build_gated_mlp,
    build_gpt,
    build_mixed_dtype_mlp,
    build_mlp,
)
from shardopt.testing._pool import close_pools, reusing_worlds
from shardopt.testing._problems import (
    PROBLEM_NAMES,
    Batch,
    Problem,
    cross_entropy,
    gated_batch,
    image_batch,
    mean_squared_error,
    reference_problem,
    regression_batch,
    token_batch,
)
from shardopt.testing._spawn import spawn
from shardopt.testing._versions import requires_torch, torch_version
from shardopt.testing._world import Backend, World, cuda_device_count, current_world

__all__ = [
    # worlds of processes
    "spawn",
    "reusing_worlds",
    "close_pools",
    "World",
    "Backend",
    "current_world",
    "cuda_device_count",
    "WorldError",
    "RankError",
    "RankExitError",
    "WorldTimeoutError",
    "RankFailure",
    "Outcome",
    # torch versions
    "requires_torch",
    "torch_version",
    # counting collectives
    "count_collectives",
    "CollectiveLog",
    "CollectiveCall",
    # equivalence with torch.optim
    "assert_matches_torch",
    "EquivalenceReport",
    "ReferenceGrads",
    "DEFAULT_RTOL",
    "Candidate",
    "CandidateFactory",
    "average_gradients",
    "with_gradient_averaging",
    "torch_optimizer_candidate",
    "zero_redundancy_candidate",
    # reference problems
    "Problem",
    "Batch",
    "PROBLEM_NAMES",
    "reference_problem",
    "build_mlp",
    "build_frozen_mlp",
    "build_conv_net",
    "build_gpt",
    "build_mixed_dtype_mlp",
    "build_gated_mlp",
    "regression_batch",
    "image_batch",
    "token_batch",
    "gated_batch",
    "mean_squared_error",
    "cross_entropy",
]
