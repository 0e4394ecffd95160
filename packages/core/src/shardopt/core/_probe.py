"""The probe of a transformation that declares no kind: what its update of one element reads.

[Note: the kind probe]
``shard`` cannot run a user's transformation on slices unless each element's update depends on
that element alone. Where no kind was declared (see [Note: kinds]), ``probe_kind`` runs the
transformation in this process on two small tensors (a 3 x 4 matrix and a 5-vector, drawn from
a fixed seed: no collective, the same on every rank) for two steps, at three gradient scales
(1e-3, 1 and 1e3, so that thresholds such as a clipping norm are crossed), and compares:
- one gradient element and one parameter element of the matrix changed: if another element of
  the matrix moves, its update reads the tensor (PER_TENSOR); if the vector's update moves, it
  reads other tensors (WHOLE_TREE);
- the matrix given as a 12-vector: if its update differs, or the transformation fails, it reads
  the shape (SHAPED).
Comparisons are bitwise: an elementwise update computes each element by the same operations
whatever its neighbours. What the probe cannot see: a dependence that none of these inputs
triggers (a branch on a value the probe never reaches, such as a non-finite gradient, or on a
step count beyond two), randomness drawn from a global generator, and dependence on dtypes or
devices other than float32 on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from shardopt.core._kinds import Kind

__all__ = ["probe_kind"]

_SCALES = (1e-3, 1.0, 1e3)


def _inputs(scale: float) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(1234)
    params = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    grads = [[scale * torch.randn(p.shape, generator=gen) for p in params] for _ in range(2)]
    return params, grads


def _run(
    tx: Any, params: list[torch.Tensor], grads: list[list[torch.Tensor]]
) -> list[torch.Tensor]:
    """The updates of two steps, flattened per tensor and joined: [matrix, vector]."""
    params = [p.clone() for p in params]
    state = tx.init(params)
    out: list[list[torch.Tensor]] = [[], []]
    for g in grads:
        updates, state = tx.update(list(g), state, params)
        for i, u in enumerate(updates):
            out[i].append(u.reshape(-1).clone())
            params[i] = params[i] + u.reshape(params[i].shape).to(params[i].dtype)
    return [torch.cat(parts) for parts in out]


def _poked(params: list[torch.Tensor], grads: list[list[torch.Tensor]], what: str) -> Any:
    params = [p.clone() for p in params]
    grads = [[g.clone() for g in step] for step in grads]
    if what == "grad":
        for step in grads:
            step[0][0, 0] = step[0][0, 0] * 1.5 + 0.25
    else:
        params[0][0, 0] = params[0][0, 0] * 1.5 + 0.25
    return params, grads


def _differs(a: torch.Tensor, b: torch.Tensor, skip_first_of_each_step: bool) -> bool:
    if not skip_first_of_each_step:
        return not torch.equal(a, b)
    keep = torch.ones(a.numel(), dtype=torch.bool)
    keep[:: a.numel() // 2] = False  # element (0, 0) of each step's update
    return not torch.equal(a[keep], b[keep])


def _reads(tx: Any, scale: float) -> tuple[Kind, str]:
    params, grads = _inputs(scale)
    base = _run(tx, params, grads)
    kind, what = Kind.ELEMENTWISE, []
    for poke in ("grad", "param"):
        moved = _run(tx, *_poked(params, grads, poke))
        if _differs(base[0], moved[0], True):
            kind |= Kind.PER_TENSOR
            what.append(f"other elements of the tensor (a {poke} element changed)")
        if _differs(base[1], moved[1], False):
            kind |= Kind.WHOLE_TREE
            what.append(f"other tensors (a {poke} element of another tensor changed)")
    flat = [params[0].reshape(-1), params[1]]
    flat_grads = [[step[0].reshape(-1), step[1]] for step in grads]
    try:
        reshaped = _run(tx, flat, flat_grads)
        shaped = not (torch.equal(reshaped[0], base[0]) and torch.equal(reshaped[1], base[1]))
    except Exception:
        shaped = True
    if shaped:
        kind |= Kind.SHAPED
        what.append("the tensor's shape (a 3 x 4 matrix given as a 12-vector)")
    return kind, "; ".join(what)


def probe_kind(tx: Any) -> tuple[Kind, str]:
    """What ``tx``'s update of one element reads, found by running it (see [Note: the kind
    probe]): the kind, and in words what it depends on ("" when elementwise).

    Example:
        >>> import torch
        >>> from shardopt.core import Transformation, clip_by_global_norm, scale
        >>> probe_kind(scale(2.0))
        (<Kind.ELEMENTWISE: 0>, '')
        >>> Kind.WHOLE_TREE in probe_kind(clip_by_global_norm(1.0))[0]
        True
    """
    kind, found = Kind.ELEMENTWISE, []
    with torch.no_grad():
        for scale in _SCALES:
            k, what = _reads(tx, scale)
            if k & ~kind:
                found.append(what)
            kind |= k
    return kind, "; ".join(found)
