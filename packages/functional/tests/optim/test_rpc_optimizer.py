"""DistributedOptimizer over RPC: torch's promises, checked on 3 TensorPipe workers on CPU."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from shardopt.optim._rpc_optimizer import DistributedOptimizer, plan_local_optimizer
from shardopt.testing import requires_torch, spawn

WORLD = 3
RPC_TIMEOUT_S = 30


class SignSGD(torch.optim.Optimizer):
    """A user-defined optimizer (no shardopt.core counterpart): ``p -= lr * sign(grad)``."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class FailingOnWorker2(torch.optim.SGD):
    """SGD whose step raises on the worker named ``worker2`` only."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        name = rpc.get_worker_info().name
        if name == "worker2":
            raise ValueError(f"step failed on purpose on {name}")
        super().step()


class ExclusiveSGD(torch.optim.SGD):
    """SGD that raises if two steps run at the same time on one worker."""

    active = 0
    guard = threading.Lock()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        with ExclusiveSGD.guard:
            ExclusiveSGD.active += 1
            overlap = ExclusiveSGD.active > 1
        try:
            if overlap:
                raise RuntimeError("two steps ran at the same time on one worker")
            time.sleep(0.005)  # widens the window in which an unserialised step would overlap
            super().step()
        finally:
            with ExclusiveSGD.guard:
                ExclusiveSGD.active -= 1


# --- functions run on the parameter owners ------------------------------------------------


def _make_param(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).requires_grad_()


def _times(param: rpc.RRef, x: torch.Tensor) -> torch.Tensor:
    return param.local_value() * x


def _value(param: rpc.RRef) -> torch.Tensor:
    return param.local_value().detach().clone()


# --- checks, run on worker0 ---------------------------------------------------------------

SHAPES = {"worker0": (2, 2), "worker1": (3, 4), "worker2": (5,)}


def _new_params() -> list[rpc.RRef]:
    """One parameter per worker, plus one on worker2 that gets no gradient."""
    params = [
        rpc.remote(owner, _make_param, args=(i, shape))
        for i, (owner, shape) in enumerate(SHAPES.items())
    ]
    return [*params, rpc.remote("worker2", _make_param, args=(9, (2,)))]


def _inputs(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=gen) for shape in SHAPES.values()]


def _distributed_run(
    cls: type, kwargs: dict[str, Any], steps: int
) -> tuple[list[torch.Tensor], bool]:
    params = _new_params()
    opt = DistributedOptimizer(cls, params, **kwargs)
    for step in range(steps):
        with dist_autograd.context() as ctx:
            outs = [
                rpc.rpc_sync(p.owner(), _times, args=(p, x)) for p, x in zip(params, _inputs(step))
            ]
            loss = torch.stack([(o.tanh() ** 2).sum() for o in outs]).sum()
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
    return [rpc.rpc_sync(p.owner(), _value, args=(p,)) for p in params], opt.uses_core


def _local_run(cls: type, kwargs: dict[str, Any], steps: int) -> list[torch.Tensor]:
    shapes = [*SHAPES.values(), (2,)]
    params = [_make_param(seed, shape) for seed, shape in zip([0, 1, 2, 9], shapes)]
    opt = cls(params, **kwargs)
    for step in range(steps):
        opt.zero_grad()
        loss = torch.stack(
            [((p * x).tanh() ** 2).sum() for p, x in zip(params, _inputs(step))]
        ).sum()
        loss.backward()
        opt.step()
    return [p.detach() for p in params]


CASES: list[tuple[str, type | None, dict[str, Any], bool]] = [
    ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, True),
    ("adam", torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.99)}, True),
    ("adafactor (whole tensors)", getattr(torch.optim, "Adafactor", None), {"lr": 0.05}, True),
    ("user-defined", SignSGD, {"lr": 0.05}, False),
]


def _check_matches_local_optimizer() -> dict[str, Any]:
    out = {}
    for name, cls, kwargs, _ in CASES:
        if cls is None:  # not in this torch
            continue
        ours, uses_core = _distributed_run(cls, kwargs, steps=4)
        local = _local_run(cls, kwargs, steps=4)
        errors = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, local)]
        untouched = torch.equal(ours[-1], _make_param(9, (2,)).detach())
        out[name] = (errors, uses_core, untouched)
    return out


def _check_errors() -> dict[str, str]:
    out = {}
    params = _new_params()
    opt = DistributedOptimizer(FailingOnWorker2, params, lr=0.1)
    before = rpc.rpc_sync("worker1", _value, args=(params[1],))
    with dist_autograd.context() as ctx:
        outs = [rpc.rpc_sync(p.owner(), _times, args=(p, x)) for p, x in zip(params, _inputs(0))]
        dist_autograd.backward(ctx, [torch.stack([o.sum() for o in outs]).sum()])
        try:
            opt.step(ctx)
        except ValueError as exc:
            out["step"] = str(exc)
    after = rpc.rpc_sync("worker1", _value, args=(params[1],))
    out["other workers stepped"] = str(not torch.equal(before, after))
    try:
        DistributedOptimizer(torch.optim.SGD, params, lr=-1.0)
    except ValueError as exc:
        out["constructor"] = str(exc)
    return out


def _train(cls: type, params: list[rpc.RRef], seed: int) -> None:
    """A trainer: its own DistributedOptimizer, 4 steps of a loss linear in the parameters."""
    opt = DistributedOptimizer(cls, params, lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        with dist_autograd.context() as ctx:
            xs = [torch.randn(p_shape, generator=gen) for p_shape in [(3, 4), (5,)]]
            outs = [rpc.rpc_sync(p.owner(), _times, args=(p, x)) for p, x in zip(params, xs)]
            dist_autograd.backward(ctx, [torch.stack([o.sum() for o in outs]).sum()])
            opt.step(ctx)


def _expected_after_training(seeds: list[int], lr: float) -> list[torch.Tensor]:
    """Linear loss: each step subtracts lr * x, whatever the order of the steps."""
    values = [_make_param(21, (3, 4)).detach(), _make_param(22, (5,)).detach()]
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(4):
            xs = [torch.randn(p_shape, generator=gen) for p_shape in [(3, 4), (5,)]]
            values = [v - lr * x for v, x in zip(values, xs)]
    return values


def _check_concurrent_steps(cls: type) -> list[float]:
    """Three trainers step the same parameters at once: two threads here, one on worker1."""
    params = [
        rpc.remote("worker1", _make_param, args=(21, (3, 4))),
        rpc.remote("worker2", _make_param, args=(22, (5,))),
    ]
    failures: list[BaseException] = []

    def train_here(seed: int) -> None:
        try:
            _train(cls, params, seed)
        except BaseException as exc:
            failures.append(exc)

    remote = rpc.rpc_async("worker1", _train, args=(cls, params, 3))
    threads = [threading.Thread(target=train_here, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    remote.wait()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    got = [rpc.rpc_sync(p.owner(), _value, args=(p,)) for p in params]
    want = _expected_after_training([1, 2, 3], 0.1)
    return [(a - b).abs().max().item() for a, b in zip(got, want)]


def _rpc_world(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=RPC_TIMEOUT_S)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD, rpc_backend_options=options)
    out: dict[str, Any] = {}
    try:
        if rank == 0:
            out["matches"] = _check_matches_local_optimizer()
            out["errors"] = _check_errors()
            out["concurrent core"] = _check_concurrent_steps(torch.optim.SGD)
            out["concurrent fallback"] = _check_concurrent_steps(ExclusiveSGD)
    finally:
        rpc.shutdown()
    return out


@pytest.fixture(scope="module")
def rpc_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """worker0's results of one 3-worker RPC world (spawned once per module)."""
    init = f"file://{tmp_path_factory.mktemp('rpc') / 'init'}"
    return spawn(_rpc_world, WORLD, init, backend="gloo", timeout=150)[0]


@pytest.mark.parametrize(
    ("name", "uses_core"),
    [
        pytest.param(c[0], c[3], marks=requires_torch("2.5", "torch.optim.Adafactor"))
        if c[1] is None
        else (c[0], c[3])
        for c in CASES
    ],
)
def test_distributed_optimizer_matches_a_local_optimizer_on_the_same_gradients(
    rpc_results: dict[str, Any], name: str, uses_core: bool
) -> None:
    errors, used_core, untouched = rpc_results["matches"][name]
    assert used_core == uses_core
    tolerance = 1e-6 if uses_core else 0.0
    assert all(e <= tolerance for e in errors), errors
    assert untouched, "a parameter without a gradient in the context was changed"


def test_distributed_optimizer_step_raises_the_remote_error_naming_the_worker(
    rpc_results: dict[str, Any],
) -> None:
    errors = rpc_results["errors"]
    assert "DistributedOptimizer.step" in errors["step"]
    assert "'worker2'" in errors["step"]
    assert "failed on purpose" in errors["step"]
    assert errors["other workers stepped"] == "True"
    assert "DistributedOptimizer.__init__" in errors["constructor"]
    assert "'worker0', 'worker1', 'worker2'" in errors["constructor"]


@pytest.mark.parametrize("path", ["core", "fallback"])
def test_concurrent_steps_from_two_callers_complete_serialised(
    rpc_results: dict[str, Any], path: str
) -> None:
    assert max(rpc_results[f"concurrent {path}"]) <= 1e-6


@pytest.mark.parametrize(
    ("cls", "kwargs", "factory"),
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "sgd"),
        (torch.optim.Adam, {"lr": 0.1, "foreach": False, "fused": None}, "adam"),
        (torch.optim.AdamW, {"lr": 0.1, "amsgrad": True}, "adamw"),
        (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01}, "adagrad"),
        (torch.optim.RMSprop, {"lr": 0.1, "centered": True}, "rmsprop"),
        (torch.optim.Adamax, {}, "adamax"),
        (torch.optim.NAdam, {"momentum_decay": 0.005}, "nadam"),
        (torch.optim.RAdam, {"decoupled_weight_decay": True}, "radam"),
        (torch.optim.Adadelta, {"rho": 0.8}, "adadelta"),
        (torch.optim.Rprop, {"etas": (0.4, 1.3)}, "rprop"),
        (torch.optim.SGD, {"lr": 0.1, "differentiable": True}, None),
        (SignSGD, {"lr": 0.1}, None),
        (ExclusiveSGD, {"lr": 0.1}, None),
        (torch.optim.ASGD, {"lr": 0.1, "t0": 10.0}, "asgd"),
        pytest.param(
            getattr(torch.optim, "Muon", None),
            {"lr": 0.02, "adjust_lr_fn": "match_rms_adamw"},
            "muon",
            marks=requires_torch("2.9", "torch.optim.Muon"),
        ),
        pytest.param(
            getattr(torch.optim, "Adafactor", None),
            {"lr": 0.01, "beta2_decay": -0.5, "foreach": True},
            "adafactor",
            marks=requires_torch("2.5", "torch.optim.Adafactor"),
        ),
        (torch.optim.LBFGS, {"lr": 0.1}, None),
    ],
)
def test_plan_maps_torch_classes_to_core_factories_with_their_hyperparameters(
    cls: type, kwargs: dict[str, Any], factory: str | None
) -> None:
    spec = plan_local_optimizer(cls, (), kwargs)
    if factory is None:
        assert spec.factory is None
        return
    assert spec.factory is not None
    assert spec.factory.__name__ == factory
    for key, value in kwargs.items():
        if key not in ("foreach", "fused"):
            assert spec.factory_kwargs[key] == value
    assert "foreach" not in spec.factory_kwargs
    assert "fused" not in spec.factory_kwargs
    spec.factory(**spec.factory_kwargs)  # the factory accepts what the plan passes


def test_plan_passes_positional_arguments_by_their_torch_names() -> None:
    spec = plan_local_optimizer(torch.optim.SGD, (0.2, 0.5), {})
    assert spec.factory_kwargs["lr"] == 0.2
    assert spec.factory_kwargs["momentum"] == 0.5


def test_distributed_optimizer_without_parameters_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"DistributedOptimizer: expected at least one"):
        DistributedOptimizer(torch.optim.SGD, [], lr=0.1)
