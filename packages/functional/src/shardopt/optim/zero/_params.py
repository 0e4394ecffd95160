"""ZeroRedundancyOptimizer's input checks: local ones, and the one agreement across ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, TypeVar, cast

import torch

from shardopt.core import Strategy
from shardopt.functional.engine import agree_across_ranks, describe, fingerprint

__all__ = [
    "agreed",
    "check_grads",
    "check_options",
    "check_param_types",
    "check_rank",
    "group_fields",
    "on_device",
    "read_params",
]

API = "ZeroRedundancyOptimizer"
T = TypeVar("T")

# [Note: checks before collectives]
# The constructor, add_param_group and consolidate_state_dict each settle their input in one
# small collective before any data moves (``agreed``, on [Note: cross-rank validation] of
# shardopt.functional): every local check and everything the local optimizer's constructor does
# runs first, inside it; a failure is kept, not raised; then one all-gather of (failed?,
# fingerprint) per rank; then every rank raises if any rank failed (that rank its own error, as
# torch would raise it, the others a ValueError naming it) or any fingerprint differs. The
# fingerprint covers the optimizer class, every hyperparameter of every param group, every
# parameter's shape, dtype and device type, the partition and the flags (and consolidation's
# ``to``). The error types are torch's: TypeError for a ``params`` that is not an iterable of
# tensors or of param-group dicts, ValueError for an empty parameter list, a sparse parameter or
# mixed dtypes (without ``allow_mixed_dtypes=True``), and for options we add (``partition``).
# step() adds no collective: its gradient checks (``check_grads``) look at every parameter's
# gradient, not only this rank's, so a defect that every rank has raises on every rank before
# the parameter sync.


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Makes ``device`` the current CUDA device (torch's object collectives use that one)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def agreed(
    api: str,
    check: Callable[[], tuple[T, Any]],
    group: Any,
    device: Callable[[], torch.device | None] = lambda: None,
) -> T:
    """``check()``'s result once every rank of ``group`` passed its checks with equal inputs.

    ``check`` returns ``(result, what must agree)``, the latter a mapping of named values (nested
    mappings and lists), so that a difference is named ([Note: naming what differs]); any
    exception it raises is held until the agreement, then raised on this rank while the others
    raise a ValueError naming it. The agreement runs on ``device()`` (asked after ``check``;
    None: the current device).
    """
    result: Any = None
    failure: BaseException | None = None
    print_, summary = 0, cast(Any, {})
    try:
        result, summary = check()
        print_ = fingerprint(None, describe(summary))
    except Exception as exc:  # raised below, on this rank, after the agreement
        failure = exc
    where = device()
    with on_device(where) if where is not None else contextlib.nullcontext():
        agree_across_ranks(api, failure, print_, group, lambda: summary)
    return result


def group_fields(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group as it must agree: every hyperparameter, and per parameter its shape, dtype
    and device type (not the index: rank r may use cuda:r).

    Example:
        >>> group_fields({"params": [torch.zeros(2, 3)], "lr": 0.1})
        {'lr': 0.1, 'params': ['(2, 3) float32 cpu']}
    """
    params = [f"{tuple(p.shape)} {_name(p.dtype)} {p.device.type}" for p in group["params"]]
    return {**{k: v for k, v in group.items() if k != "params"}, "params": params}


def _kind(value: object) -> str:
    return torch.typename(value) if isinstance(value, torch.Tensor) else type(value).__name__


def read_params(params: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """``(params as a list for Optimizer.__init__, every parameter in order)``.

    Example:
        >>> w, b = torch.ones(2), torch.ones(1)
        >>> groups, flat = read_params([{"params": [w]}, {"params": b}])
        >>> len(groups), len(flat)
        (2, 2)

    Raises:
        TypeError: ``params`` is a tensor, not iterable, or mixes tensors and dicts.
        ValueError: ``params`` is empty, or a dict lacks ``"params"``.
    """
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        raise TypeError(
            f"{API}: expected params to be an iterable of tensors or param-group dicts, got "
            f"{_kind(params)}"
        )
    items = list(params)
    if not items:
        raise ValueError(f"{API}: expected at least one parameter, got an empty parameter list")
    if all(isinstance(x, torch.Tensor) for x in items):
        return items, list(items)
    if not all(isinstance(x, Mapping) for x in items):
        bad = next(x for x in items if not isinstance(x, (torch.Tensor, Mapping)))
        bad_kind = _kind(bad) if bad is not None else "a mix of tensors and dicts"
        raise TypeError(
            f"{API}: expected params to be an iterable of tensors or of param-group dicts, got "
            f"an element of type {bad_kind}"
        )
    flat: list[torch.Tensor] = []
    for i, group in enumerate(items):
        if "params" not in group:
            raise ValueError(f"{API}: expected param group {i} to have a 'params' key, got none")
        flat.extend(group_params(group, i))
    return items, flat


def group_params(group: Mapping[str, Any], index: int) -> list[torch.Tensor]:
    """The tensors of one param group (``params`` a tensor or an iterable of tensors); a
    one-shot iterable (a generator) is stored back into ``group`` as the list it gave."""
    params = group["params"]
    if isinstance(params, torch.Tensor):
        return [params]
    if not isinstance(params, Iterable) or isinstance(params, (set, frozenset)):
        raise TypeError(
            f"{API}: expected param group {index} 'params' to be an ordered iterable of tensors, "
            f"got {_kind(params)}"
        )
    out = list(params)
    if iter(params) is params and isinstance(group, MutableMapping):
        group["params"] = out  # consumed: torch's add_param_group would find it empty
    for p in out:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"{API}: expected param group {index} 'params' to hold tensors, got {_kind(p)}"
            )
    return out


def check_param_types(params: list[torch.Tensor], *, allow_mixed_dtypes: bool) -> None:
    """Raises ValueError for a non-dense parameter, or several dtypes unless allowed.

    Example:
        >>> params = [torch.ones(1), torch.ones(1, dtype=torch.float64)]
        >>> check_param_types(params, allow_mixed_dtypes=False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: ZeroRedundancyOptimizer: expected parameters of one dtype ...
    """
    for i, p in enumerate(params):
        if p.layout != torch.strided:
            raise ValueError(
                f"{API}: expected dense (strided) parameters, got parameter {i} with layout "
                f"{p.layout}"
            )
    if allow_mixed_dtypes:
        return
    first = params[0].dtype
    for p in params[1:]:
        if p.dtype != first:
            raise ValueError(
                f"{API}: expected parameters of one dtype (pass allow_mixed_dtypes=True for one "
                f"flat group per dtype), got {_name(first)} and {_name(p.dtype)}"
            )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_rank(method: str, name: str, value: Any, world_size: int) -> None:
    """Raises ValueError unless ``value`` is a rank of a group of ``world_size``.

    Example:
        >>> check_rank("consolidate_state_dict", "to", 2, 2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: ZeroRedundancyOptimizer.consolidate_state_dict: expected 0 <= to < ...
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < world_size:
        raise ValueError(
            f"{API}.{method}: expected 0 <= {name} < world_size={world_size}, got {value!r}"
        )


def check_options(
    optimizer_class: Any,
    partition: Any,
    *,
    overlap_with_ddp: Any,
    parameters_as_bucket_view: Any,
    allow_mixed_dtypes: Any,
    comm_dtype: Any = None,
    allow_coupled: Any = False,
) -> Strategy:
    """The validated partition; raises for a ``comm_dtype`` without a flat partition, and for
    flags that are not bools.

    Example:
        >>> check_options(torch.optim.Adam, "flat", overlap_with_ddp=False,
        ...               parameters_as_bucket_view=False, allow_mixed_dtypes=False)
        <Strategy.FLAT: 'flat'>
    """
    if not callable(optimizer_class):
        raise TypeError(
            f"{API}: expected a torch.optim.Optimizer class as optimizer_class, got "
            f"{_kind(optimizer_class)}"
        )
    names = (Strategy.GREEDY.value, Strategy.FLAT.value)  # flat plans Muon's groups whole itself
    if not isinstance(partition, str) or partition not in names:
        raise ValueError(f"{API}: expected partition in {names}, got {partition!r}")
    flags = {
        "overlap_with_ddp": overlap_with_ddp,
        "parameters_as_bucket_view": parameters_as_bucket_view,
        "allow_mixed_dtypes": allow_mixed_dtypes,
        "allow_coupled": allow_coupled,
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{API}: expected {name} to be a bool, got {_kind(value)}")
    chosen = Strategy(partition)  # core's word: the plan's strategy
    _check_comm_dtype(comm_dtype, chosen)
    # which classes the flat partition runs: ``flat_backend`` of zero/_classes.py
    if chosen is Strategy.FLAT and overlap_with_ddp:
        raise ValueError(
            f"{API}: overlap_with_ddp=True needs partition='greedy' (whole parameters per "
            "rank, as DDP's buckets hold them), got partition='flat'"
        )
    return chosen


_SPARSE_GRADS = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


def check_grads(params: Iterable[torch.Tensor], optimizer_class: Any) -> None:
    """Raises ValueError for a sparse gradient where the owner's optimizer (one of torch.optim's
    classes without sparse support) would refuse it.

    Every rank checks every parameter's gradient, not only those it owns, so the owner is not
    the only rank to raise (see [Note: checks before collectives]). A gradient of another shape,
    dtype or device cannot reach here: torch refuses it when ``.grad`` is assigned.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> p.grad = torch.zeros(3).to_sparse()
        >>> check_grads([p], torch.optim.Adam)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: ZeroRedundancyOptimizer.step: expected dense gradients for Adam ...
    """
    module = getattr(optimizer_class, "__module__", "")
    known = isinstance(optimizer_class, type) and module.startswith("torch.optim")
    if not known or issubclass(optimizer_class, _SPARSE_GRADS):
        return
    strided = torch.strided
    for i, p in enumerate(params):  # the per-step cost: one attribute per parameter
        g = p.grad
        if g is not None and g.layout is not strided:
            raise ValueError(
                f"{API}.step: expected dense gradients for {optimizer_class.__name__} (it has "
                f"no sparse support), got a {g.layout} gradient for parameter {i}"
            )


def _check_comm_dtype(comm_dtype: Any, partition: Strategy) -> None:
    """Raises unless ``comm_dtype`` is None, or a float dtype with the flat partition (the one
    that reduces gradients itself: see [Note: the flat local optimizer])."""
    if comm_dtype is None:
        return
    if not isinstance(comm_dtype, torch.dtype) or not comm_dtype.is_floating_point:
        raise ValueError(f"{API}: expected comm_dtype None or a float dtype, got {comm_dtype!r}")
    if partition is not Strategy.FLAT:
        raise ValueError(
            f"{API}: comm_dtype={comm_dtype} needs partition='flat' (its owners reduce the local "
            f"gradients themselves; greedy steps DDP's averaged ones), got partition="
            f"'{partition.value}'"
        )
