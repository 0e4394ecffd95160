"""Input checks: local ones, and the cross-rank agreement that turns a would-be hang into errors."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardopt.core import Plan
from shardopt.core.blocks import needs_whole_tensors
from shardopt.functional.engine._collectives import ProcessGroup, all_gather_rows, comm_device
from shardopt.functional.engine._failure import error_text, raised_on_every_rank

__all__ = [
    "agree_across_ranks",
    "check_grads",
    "check_params",
    "describe",
    "fingerprint",
    "first_difference",
    "named_fields",
    "plan_fields",
    "probe_updates",
]

# [Note: cross-rank validation]
# A collective that some ranks enter and others do not (or enter with other sizes) hangs until
# the process group times out. So every check whose outcome may differ between ranks is settled
# before the first data collective: ``init`` runs the local checks, then all-gathers one small
# int64 row per rank ``[error flag, fingerprint]``. The fingerprint hashes everything that must be
# equal on all ranks: the plan (``Plan.fingerprint``, which drops device indices: rank r
# legitimately uses cuda:r), the sharding options and the structure of the optimizer state.
# Then every rank raises if any rank failed a local check (that rank its own error, the others a
# ValueError naming it) or any fingerprint differs; none proceeds.
# Hyperparameters are part of the fingerprint: ``describe`` spells a value the same on every rank
# (tensors by dtype, shape and values, not device; classes and functions by qualified name;
# memory addresses dropped), and ``probe_updates`` condenses what a transformation computes,
# since its hyperparameters hide in closures: two updates of a fixed probe, whose values change
# with every setting that changes the arithmetic (learning rate, betas, eps, decay, the
# algorithm itself).
# Gradients are only seen in ``step``; their checks are local (see [Note: gradient checks]).


def check_params(plan: Plan, params: Sequence[Any], world_size: int) -> str | None:
    """The first problem of ``params`` against ``plan`` as a message, or None."""
    if plan.world_size != world_size:
        return f"a plan for world_size={world_size}, got a plan for {plan.world_size}"
    if len(params) != len(plan.tensors):
        return f"{len(plan.tensors)} parameters (as in the plan), got {len(params)}"
    seen: set[int] = set()
    for i, (p, spec) in enumerate(zip(params, plan.tensors)):
        if not isinstance(p, torch.Tensor):
            return f"params[{i}] to be a tensor, got {type(p).__name__}"
        if not p.is_leaf:
            return f"params[{i}] to be a leaf tensor (as torch.optim), got one with a grad_fn"
        if p.layout != torch.strided:
            return f"params[{i}] to be a dense (strided) tensor, got layout {p.layout}"
        if id(p) in seen:
            return f"distinct parameters, got params[{i}] twice"
        seen.add(id(p))
        if tuple(p.shape) != spec.shape or p.dtype != spec.torch_dtype:
            return (
                f"params[{i}] of shape {spec.shape} and dtype {spec.dtype} (as in the plan), got "
                f"{tuple(p.shape)} and {str(p.dtype).removeprefix('torch.')}"
            )
        planned = spec.device.split(":")[0]
        if planned != "meta" and planned != p.device.type:
            return f"params[{i}] on a {planned} device (as in the plan), got {p.device}"
    for g, group in enumerate(plan.groups):
        devices = {str(params[t].device) for t in group.tensors}
        if len(devices) > 1:
            return f"the parameters of plan group {g} on one device, got {sorted(devices)}"
    return None


def check_grads(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    *,
    attributes: bool = False,
) -> str | None:
    """The first problem of ``grads`` (one per parameter, or None) as a message, or None.

    ``attributes``: the gradients are the parameters' ``.grad``, whose shape, dtype and device
    torch itself keeps equal to the parameter's (its setter refuses others), so only their layout
    and contiguity are looked at on the fast path.

    [Note: gradient checks]
    Gradients must be dense, contiguous, and of their parameter's shape, dtype and device: the
    sharded step reads them as flat views. These checks run on each rank on its own gradients. A
    defect produced by code that every rank runs shows on every rank, which then all raise; a
    defect on one rank only is reported on every rank when the step has its small all-reduce
    (``max_norm`` or ``skip_nonfinite``), and otherwise raises on that rank alone while the
    others wait in the next collective until the process group's timeout.
    """
    if len(grads) != len(params):
        return f"{len(params)} gradients (one per parameter), got {len(grads)}"
    if _all_fit(params, grads, attributes):
        return None
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            continue
        if not isinstance(g, torch.Tensor):
            return f"grads[{i}] to be a tensor or None, got {type(g).__name__}"
        if g.layout != torch.strided:
            return f"grads[{i}] to be dense, got a {g.layout} gradient"
        if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
            return (
                f"grads[{i}] of shape {tuple(p.shape)}, dtype {p.dtype} on {p.device}, got "
                f"{tuple(g.shape)}, {g.dtype} on {g.device}"
            )
        if not g.is_contiguous():
            return f"grads[{i}] to be contiguous, got strides {g.stride()}"
    return None


_DENSE_OR_NONE = frozenset((torch.Tensor, torch.nn.Parameter, type(None)))


def _all_fit(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], attributes: bool
) -> bool:
    """The fast path of check_grads: every gradient None, or a plain tensor of its parameter's
    shape, dtype and device, strided and contiguous; compared at C speed (the comprehensions
    call no Python per tensor). False sends the caller to the loop that names the first problem.
    """
    types = set(map(type, grads))
    if not _DENSE_OR_NONE.issuperset(types):
        return False  # a DTensor, or not a tensor: the loop decides
    if type(None) in types:
        params = [p for p, g in zip(params, grads) if g is not None]
        grads = [g for g in grads if g is not None]
    same = attributes or (
        [g.shape for g in grads] == [p.shape for p in params]  # type: ignore[union-attr]
        and [g.dtype for g in grads] == [p.dtype for p in params]  # type: ignore[union-attr]
        and [g.device for g in grads] == [p.device for p in params]  # type: ignore[union-attr]
    )
    return (
        same
        and {g.layout for g in grads} <= {torch.strided}  # type: ignore[union-attr]
        and all([g.is_contiguous() for g in grads])  # type: ignore[union-attr]
    )


def plan_fields(plan: Plan) -> dict[str, Any]:
    """``plan.to_dict()`` with devices by type, as :meth:`Plan.fingerprint` hashes it."""
    data = plan.to_dict()
    for record in (*data["tensors"], *data["groups"]):
        record["device"] = record["device"].split(":")[0]
    return data


def fingerprint(plan: Plan | None, extra: Any) -> int:
    """A 63-bit hash of ``plan.fingerprint()`` (device indices dropped; none without a plan) and
    of ``repr(extra)``.

    Example:
        >>> from shardopt.core import plan_partition
        >>> a = plan_partition([((2, 3), "float32", "cuda:0")], 2)
        >>> b = plan_partition([((2, 3), "float32", "cuda:1")], 2)
        >>> fingerprint(a, "x") == fingerprint(b, "x") != fingerprint(a, "y")
        True
    """
    text = f"{'' if plan is None else plan.fingerprint()}:{extra!r}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_PROBE = (0.75, -1.5, 3e-5, -2e-7)  # magnitudes where eps and decay show


def describe(value: Any) -> str:
    """``value`` spelled alike on every rank that holds an equal one (for fingerprints).

    Example:
        >>> describe({"lr": torch.tensor(0.1), "betas": (0.9, 0.99), "cls": torch.optim.Adam})
        '{betas:(0.9,0.99),cls:torch.optim.adam.Adam,lr:tensor(float32,(),[0.10000000149011612])}'
    """
    if isinstance(value, torch.Tensor):
        values = value.detach().cpu().reshape(-1).tolist() if value.numel() <= 64 else "..."
        return f"tensor({str(value.dtype).removeprefix('torch.')},{tuple(value.shape)},{values})"
    if isinstance(value, Mapping):
        items = sorted((str(k), describe(v)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        inner = ",".join(describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    if isinstance(value, (bool, int, float, str)) or value is None:
        return repr(value)
    return _ADDRESS.sub("", f"{type(value).__qualname__}:{value!r}")


def probe_updates(tx: Any, dtypes: Sequence[torch.dtype]) -> str:
    """What ``tx`` computes, condensed: its first two updates of a fixed CPU probe per dtype
    (see [Note: cross-rank validation]); equal on ranks whose ``tx`` are equal."""
    shape = (2, 2) if needs_whole_tensors(tx) else (4,)  # Muon steps matrices only
    params = [torch.tensor(_PROBE, dtype=d).view(shape) for d in dtypes]
    grads = [torch.tensor(_PROBE[::-1], dtype=d).view(shape) for d in dtypes]
    state = tx.init(params)
    out = []
    for _ in range(2):
        updates, state = tx.update(grads, state, params)
        out.append(describe(list(updates)))
    return ";".join(out)


def agree_across_ranks(
    api: str,
    error: str | BaseException | None,
    print_: int,
    group: ProcessGroup,
    fields: Callable[[], Any] | None = None,
) -> None:
    """Raises on every rank if any rank has an ``error`` or another fingerprint.

    A rank's own ``error`` is raised there (an exception as it is, prefixed with ``api`` where
    its message does not name it; a message as a ValueError ``"{api}: expected {error}"``); the
    other ranks raise a ValueError naming the failed ranks and carrying the first one's error
    (escaped and capped as [Note: publishing an error]; one more exchange, on this path only).
    One all-gather of two int64 per rank (see [Note: cross-rank validation]). Where the
    fingerprints differ, ``fields()`` (what was fingerprinted, as nested mappings and lists) is
    exchanged once more and the error names the first field that differs, with each rank's
    value (see [Note: naming what differs]).
    """
    row = torch.tensor([0 if error is None else 1, print_], dtype=torch.int64)
    rows = all_gather_rows(row.to(comm_device(group)), group=group).cpu()
    failed = [r for r in range(rows.shape[0]) if rows[r, 0].item()]
    if failed:
        mine = None
        if isinstance(error, BaseException):
            mine = _naming(api, error)
        elif error is not None:
            mine = ValueError(f"{api}: expected {error}")
        reasons = _reasons(mine, group) if len(failed) < rows.shape[0] else []
        if mine is not None:
            raise raised_on_every_rank(mine)
        first = failed[0]
        raise raised_on_every_rank(
            ValueError(
                f"{api}: expected valid input on every rank, got an error on rank(s) {failed}; "
                f"rank {first}: {reasons[first]}"
            )
        )
    prints = rows[:, 1].tolist()
    if len(set(prints)) > 1:
        got = f"fingerprints {prints} (one per rank)"
        if fields is not None:
            got = first_difference(fields(), group) or got
        raise raised_on_every_rank(
            ValueError(
                f"{api}: expected the same parameters, plan, options and optimizer state "
                f"structure on every rank, got {got}"
            )
        )


# [Note: naming what differs]
# The agreement exchanges one hash per rank; when the hashes differ it costs nothing to spend a
# second exchange on saying why (every rank is on the failure path together, by the first one):
# each rank flattens what it fingerprinted into named fields (``param_groups[0].lr``,
# ``plan.tensors[3].shape``, ``to``), spelled by ``describe``, all ranks gather them
# (``all_gather_object``, on this path only), and the first field in order whose value is not
# the same everywhere is named with each rank's value: ``param_groups[0].lr: rank 0 0.1, rank 1
# 0.2``. A field some ranks lack shows as ``(none)`` there.


def named_fields(value: Any, prefix: str = "") -> dict[str, str]:
    """``value`` (mappings and lists, nested) as {dotted path: ``describe`` of the leaf}; a list
    of ints (a shape) is a leaf.

    Example:
        >>> named_fields({"to": 0, "param_groups": [{"lr": 0.1, "params": ["(2, 3) float32"]}]})
        {'to': '0', 'param_groups[0].lr': '0.1', 'param_groups[0].params[0]': "'(2, 3) float32'"}
    """
    if isinstance(value, Mapping):
        out: dict[str, str] = {}
        for k, v in value.items():
            out.update(named_fields(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and not all(type(v) is int for v in value):  # (a shape: a leaf)
        out = {}
        for i, v in enumerate(value):
            out.update(named_fields(v, f"{prefix}[{i}]"))
        return out
    return {prefix: describe(value)}


def first_difference(value: Any, group: ProcessGroup) -> str | None:
    """The first named field of ``value`` that differs across the ranks of ``group``, with each
    rank's value; None if none does. Collective (one ``all_gather_object``)."""
    mine = named_fields(value)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    names = list(dict.fromkeys(n for fields in every for n in fields))
    for name in names:
        values = [fields.get(name, "(none)") for fields in every]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r} {_short(v)}" for r, v in enumerate(values))
            return f"{name}: {shown}"
    return None


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def ranks_with(flag: bool, group: ProcessGroup = None) -> list[int]:
    """The group ranks whose ``flag`` is true, on every rank: one all-gather of one int64 each.

    Example:
        >>> import os, tempfile, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> ranks_with(True), ranks_with(False)
        ([0], [])
        >>> dist.destroy_process_group()
    """
    row = torch.tensor([int(bool(flag))], dtype=torch.int64, device=comm_device(group))
    rows = all_gather_rows(row, group=group).cpu()
    return [r for r in range(rows.shape[0]) if rows[r, 0].item()]


def _reasons(mine: BaseException | None, group: ProcessGroup) -> list[str | None]:
    """Every rank's error as published text (escaped and capped, as [Note: publishing an
    error]), None where none; collective, on the failure path only (one all_gather_object)."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, None if mine is None else error_text(mine), group=group)
    return every


def _naming(api: str, error: BaseException) -> BaseException:
    """``error``, or one of its type whose message starts with ``api`` (torch's own errors, e.g.
    an optimizer's "Invalid learning rate", keep their type and words behind the prefix)."""
    name = api.split(".")[0]
    if name in str(error) or type(error) not in (ValueError, TypeError, RuntimeError):
        return error
    renamed = type(error)(f"{api}: {error}")
    renamed.__cause__ = error
    return renamed
