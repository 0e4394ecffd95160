"""DistributedOptimizer: one local optimizer per parameter owner, stepped over RPC."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from shardopt.core import Transformation, update_pieces_
from shardopt.core.blocks import needs_whole_tensors, update_whole_
from shardopt.optim._core_mapping import LocalOptimizerSpec, plan_local_optimizer

__all__ = ["DistributedOptimizer", "LocalOptimizerSpec", "plan_local_optimizer"]

logger = logging.getLogger(__name__)

# [Note: local optimizers without TorchScript]
# torch's DistributedOptimizer compiles a functional optimizer with TorchScript on each worker,
# so that steps arriving on RPC threads do not contend for the GIL in Python optimizer code. Here
# the caller maps the torch.optim class and its arguments to a shardopt.core factory with the same
# hyperparameters (``plan_local_optimizer``); each worker builds the transformation once, keeps its
# state, and steps its parameters in place with ``update_pieces_`` (torch's foreach/fused kernels
# where the factory registered a piece rule; ``update_whole_`` for Muon and Adafactor, which need
# each parameter whole, as a worker holds them). A class without a core counterpart, a subclass (it
# may override ``step``) or a hyperparameter the factory lacks falls back to instantiating the
# torch.optim class on the worker, with the gradients of the context assigned to ``.grad``.

# [Note: one lock per worker]
# Steps of different callers arrive concurrently on a worker's RPC threads. As in torch, all
# local optimizers of a worker share one lock: several DistributedOptimizers built over the same
# parameters (one per trainer) then never update a parameter at the same time. Steps are
# serialised per worker, in no particular order across workers.
_WORKER_LOCK = threading.Lock()


class _LocalOptimizer:
    """The optimizer of one worker's parameters, living on that worker."""

    def __init__(self, spec: LocalOptimizerSpec, param_rrefs: Sequence[rpc.RRef]) -> None:
        self.params = [rref.local_value() for rref in param_rrefs]
        self.tx: Transformation | None = None
        self.optim: torch.optim.Optimizer | None = None
        if spec.factory is None:
            self.optim = spec.optimizer_class(self.params, *spec.args, **spec.kwargs)
        else:
            self.tx = spec.factory(**spec.factory_kwargs)
            self.state = self.tx.init(list(self.params))

    def step(self, context_id: int) -> None:
        found = dist_autograd.get_gradients(context_id)
        grads = [found.get(p) for p in self.params]
        with _WORKER_LOCK:
            if self.tx is not None:
                if needs_whole_tensors(self.tx):
                    with torch.no_grad():
                        update_whole_(self.tx, self.params, grads, self.state)
                else:
                    update_pieces_(self.tx, self.params, grads, self.state)
                return
            assert self.optim is not None
            for p, g in zip(self.params, grads):
                p.grad = g
            self.optim.step()


def _new_local_optimizer(spec: LocalOptimizerSpec, param_rrefs: list[rpc.RRef]) -> rpc.RRef:
    return rpc.RRef(_LocalOptimizer(spec, param_rrefs))


def _step_local_optimizer(optimizer_rref: rpc.RRef, context_id: int) -> None:
    optimizer_rref.local_value().step(context_id)


def _wait_all(futures: list[Any], workers: list[str], what: str) -> list[Any]:
    """Waits for every future; then raises the first failure, naming every failed worker."""
    results: list[Any] = []
    failures: list[tuple[str, BaseException]] = []
    for worker, fut in zip(workers, futures):
        try:
            results.append(fut.wait())
        except Exception as exc:
            failures.append((worker, exc))
    if not failures:
        return results
    worker, first = failures[0]
    names = ", ".join(repr(w) for w, _ in failures)
    message = (
        f"DistributedOptimizer.{what}: the local optimizer failed on {names}; "
        f"on {worker!r}: {type(first).__name__}: {first}"
    )
    try:
        error = type(first)(message)
    except Exception:
        error = RuntimeError(message)
    raise error from first


class DistributedOptimizer:
    """Applies an optimizer to parameters spread over RPC workers, on the workers that own them.

    The API and behaviour of ``torch.distributed.optim.DistributedOptimizer``, without
    TorchScript. The parameters are given as RRefs; the constructor builds, on each worker owning
    some of them, one local optimizer ``optimizer_class(local_params, *args, **kwargs)`` -- a
    shardopt.core transformation with the same hyperparameters where the class has one, else the
    class itself (see [Note: local optimizers without TorchScript]). :meth:`step` applies the
    gradients that the distributed autograd context ``context_id`` holds on each owner and blocks
    until every worker is done. Concurrent steps, from one caller or several, are serialised per
    worker (see [Note: one lock per worker]). An error raised on a worker is raised here, of the
    same type where possible, naming the worker.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` class (or any callable taking the list of a
            worker's parameters first).
        params_rref: RRefs to the parameters to optimize, local or remote.
        *args: further arguments of ``optimizer_class``.
        **kwargs: keyword arguments of ``optimizer_class``.

    Example:
        >>> import os, tempfile, warnings, torch
        >>> import torch.distributed.autograd as dist_autograd
        >>> import torch.distributed.rpc as rpc
        >>> init = "file://" + os.path.join(tempfile.mkdtemp(), "rpc")
        >>> options = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=30)
        >>> with warnings.catch_warnings():  # init_rpc warns about torch's own internals
        ...     warnings.simplefilter("ignore", UserWarning)
        ...     rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=options)
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(w)], lr=0.5)
        >>> with dist_autograd.context() as context_id:
        ...     dist_autograd.backward(context_id, [(w * 2).sum()])
        ...     opt.step(context_id)
        >>> w
        tensor([0., 0.], requires_grad=True)
        >>> rpc.shutdown()

    Raises:
        ValueError: if ``params_rref`` is empty.
    """

    def __init__(
        self, optimizer_class: Any, params_rref: Sequence[rpc.RRef], *args: Any, **kwargs: Any
    ) -> None:
        params_rref = list(params_rref)
        if not params_rref:
            raise ValueError("DistributedOptimizer: expected at least one parameter RRef, got []")
        spec = plan_local_optimizer(optimizer_class, args, kwargs)
        self.uses_core = spec.factory is not None
        per_worker: dict[Any, list[rpc.RRef]] = {}
        for rref in params_rref:
            per_worker.setdefault(rref.owner(), []).append(rref)
        workers = [info.name for info in per_worker]
        futures = [
            rpc.rpc_async(info, _new_local_optimizer, args=(spec, rrefs))
            for info, rrefs in per_worker.items()
        ]
        self.remote_optimizers: list[rpc.RRef] = _wait_all(futures, workers, "__init__")
        self._workers = workers

    @property
    def is_functional_optim(self) -> bool:
        """Whether the workers run a shardopt.core transformation (torch's attribute name)."""
        return self.uses_core

    def step(self, context_id: int) -> None:
        """Applies the gradients of the autograd context ``context_id`` on every owner; blocks.

        Raises:
            RuntimeError: if ``context_id`` is not a valid context here; the error of a worker
                whose local step failed, naming that worker.
        """
        dist_autograd._is_valid_context(context_id)
        futures = [
            rpc.rpc_async(optim.owner(), _step_local_optimizer, args=(optim, context_id))
            for optim in self.remote_optimizers
        ]
        _wait_all(futures, self._workers, "step")
