"""What sharding may do with an optimizer class: probes of it on small local tensors."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PER_PARAMETER",
    "Elementwise",
    "coupling",
    "elementwise",
    "known_base",
]

# [Note: optimizer probes]
# Sharding gives each rank's local optimizer only some parameters (greedy) or only some elements
# of them (flat), and lets DDP's buckets step it piece by piece (overlap). Which of these leave
# one process's result unchanged depends on the class, so ZeroRedundancyOptimizer decides once,
# at construction, from what it knows or what it sees. Known: torch's per-parameter classes
# (PER_PARAMETER, which are also the shardopt.core forms) and their subclasses that override
# nothing (``known_base``). Seen: the class stepped STEPS (5) times, locally and
# deterministically (the random generators seeded, then restored), with the constructor's
# hyperparameters, on two small tensors and the gradients of DESIGNS; the checks of one
# parameter against another, and of one element against the others, run in float64 (a
# dependence that float32 rounds away at the probe's sizes, as Ranger21's weight decay scaled by
# the mean second moment, still shows), the cut one in the parameters' dtype (the slices must
# reproduce its bits):
# - coupled (``coupling``): the pair stepped together ends elsewhere than each stepped alone,
#   or ends elsewhere under another seed (each rank draws its own numbers). Then a rank that
#   steps only its parameters cannot reproduce one process: the greedy partition refuses the
#   class unless told ``allow_coupled=True``.
# - elementwise (``elementwise``): not coupled; one element's initial value and gradients changed
#   change no other element's result; and the result, and every state tensor, is the same for
#   the tensor whole, flattened, or cut into two pieces stepped as two parameters. Then the flat
#   partition can step the class on its slices of the flat buffers: the state of a parameter is
#   its pieces' states end to end (``Elementwise.keys``), or one value its pieces share.
# Results are compared bitwise (NaN equal to NaN). What the probe does not exercise (a code path
# taken only after many steps, or only for some shapes) it cannot see; the table test of the
# third-party classes holds the verdicts to one process's result.
#
# The verdicts on popular classes are listed in [Note: coupled optimizers] (zero/_classes.py) and
# pinned by tests/integration/test_third_party_optimizers.py.

_PER_PARAMETER_NAMES = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "RMSprop",
    "Adamax",
    "NAdam",
    "RAdam",
    "Adadelta",
    "Rprop",
    "ASGD",
    "SparseAdam",
    "Muon",
    "Adafactor",
)
# torch.optim's classes whose step updates each parameter from its own gradient and state alone,
# with counts kept per parameter: safe to step per DDP bucket and with any subset of parameters.
PER_PARAMETER: tuple[type, ...] = tuple(
    cls
    for name in _PER_PARAMETER_NAMES
    if isinstance(cls := getattr(torch.optim, name, None), type)
)

# Entries of a class's namespace that do not change what its instances do.
_INERT = frozenset(
    {
        "__module__",
        "__qualname__",
        "__doc__",
        "__dict__",
        "__weakref__",
        "__firstlineno__",
        "__static_attributes__",
        "__annotations__",
        "__orig_bases__",
        "__parameters__",
        "__type_params__",
    }
)

STEPS = 5
# The gradients' designs: 0, a fixed direction plus a little noise (step-size estimates such as
# Prodigy's grow), the first tensor's 10^4 times smaller than the second's (statistics over all
# the parameters differ from those over one); 1, plain noise; 2, noise orthogonal to each
# tensor (AdamP's projection for scale-invariant weights).
DESIGNS = (0, 1, 2)


def known_base(optimizer_class: Any) -> type | None:
    """The torch.optim class of PER_PARAMETER that ``optimizer_class`` is, or that it subclasses
    without overriding anything (None otherwise).

    Example:
        >>> class Mine(torch.optim.AdamW):
        ...     '''AdamW under another name.'''
        >>> known_base(Mine) is torch.optim.AdamW, known_base(torch.optim.LBFGS)
        (True, None)
    """
    if not isinstance(optimizer_class, type):
        return None
    for cls in optimizer_class.__mro__:
        if cls in PER_PARAMETER:
            return cls
        if set(vars(cls)) - _INERT:
            return None
    return None


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seeds torch's and Python's generators for the block, restoring them after."""
    devices = [device] if device.type == "cuda" else []
    python = random.getstate()
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            random.seed(seed)
            yield
    finally:
        random.setstate(python)


@dataclass(frozen=True)
class _Probe:
    """The class, its hyperparameters, and the dtype and device to probe on."""

    optimizer_class: Any
    defaults: dict[str, Any]
    dtype: torch.dtype
    device: torch.device

    def tensors(self, design: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Two starting tensors, (3, 4) and (5,), and their gradients at each step, in one of
        three designs (see DESIGNS)."""
        gen = torch.Generator().manual_seed(1234 + design)
        shapes = [(3, 4), (5,)]
        start = [torch.randn(s, generator=gen) for s in shapes]
        direction = [torch.randn(s, generator=gen) for s in shapes]
        grads = []
        for _ in range(STEPS):
            noise = [torch.randn(s, generator=gen) for s in shapes]
            if design == 0:
                step = [(d + 0.1 * n) * c for d, n, c in zip(direction, noise, (1e-2, 1e2))]
            elif design == 1:
                step = noise
            else:
                step = [n - (n * x).sum() / (x * x).sum() * x for n, x in zip(noise, start)]
            grads.append(step)
        cast = self.cast
        return [cast(x) for x in start], [[cast(g) for g in step] for step in grads]

    def in_float64(self) -> _Probe:
        """The same probe in float64, where a dependence too small for float32 still shows."""
        return dataclasses.replace(self, dtype=torch.float64)

    def cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype=self.dtype, device=self.device)

    def run(
        self, start: Sequence[torch.Tensor], grads: Sequence[Sequence[torch.Tensor]], seed: int = 0
    ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """The tensors and their states after stepping ``start`` with ``grads`` (one list per
        step, one gradient per tensor)."""
        with _seeded(seed, self.device):
            params = [x.clone().requires_grad_(True) for x in start]
            optim = self.optimizer_class(params, **self.defaults)
            if callable(getattr(optim, "train", None)):
                optim.train()  # schedule-free classes step only in train mode
            for step in grads:
                for p, g in zip(params, step):
                    p.grad = g.clone()
                optim.step()
            states = [dict(optim.state.get(p, {})) for p in params]
            return [p.detach().clone() for p in params], states


_VERDICTS: dict[tuple[Any, ...], Any] = {}  # probe verdicts of this process (deterministic)


def _cached(kind: str, probe: _Probe, compute: Any) -> Any:
    """``compute()``, once per class, hyperparameters, dtype and device in this process."""
    try:
        defaults = repr(sorted(probe.defaults.items()))
        key = (kind, probe.optimizer_class, defaults, probe.dtype, str(probe.device))
        hash(key)
    except Exception:  # unhashable or unprintable: probe again
        return compute()
    if key not in _VERDICTS:
        _VERDICTS[key] = compute()
    return _VERDICTS[key]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _failed(exc: Exception) -> str:
    return f"the probe could not step it on two small tensors ({type(exc).__name__}: {exc})"


def coupling(optimizer_class: Any, defaults: dict[str, Any], like: torch.Tensor) -> str | None:
    """Why sharding whole parameters changes what ``optimizer_class`` computes, or None where
    the probe finds it per-parameter (see [Note: optimizer probes]).

    Example:
        >>> print(coupling(torch.optim.LBFGS, {}, torch.zeros(1)))  # doctest: +ELLIPSIS
        the probe could not step it on two small tensors (TypeError: ...closure...)
    """
    if known_base(optimizer_class) is not None:
        return None
    probe = _Probe(optimizer_class, dict(defaults), like.dtype, like.device)
    return _cached("coupling", probe, lambda: _guarded(_coupling, probe))


def _guarded(check: Any, probe: _Probe) -> str | None:
    try:
        return check(probe)
    except Exception as exc:  # a class that cannot be stepped so: refused, with the reason
        return _failed(exc)


def _coupling(probe: _Probe) -> str | None:
    start, grads = probe.tensors()
    together, _ = probe.run(start, grads)
    if not all(_same(x, y) for x, y in zip(together, probe.run(start, grads, seed=1)[0])):
        return (
            "its update draws random numbers (each rank draws its own, so the sharded result "
            "is not one process's)"
        )
    wide = probe.in_float64()
    for design in DESIGNS[:2]:
        start, grads = wide.tensors(design)
        together, _ = wide.run(start, grads)
        for i in range(len(start)):
            alone, _ = wide.run([start[i]], [[step[i]] for step in grads])
            if not _same(alone[0], together[i]):
                return (
                    "its update of a parameter depends on the other parameters it steps (a "
                    "tensor stepped alone ends elsewhere than stepped with another), and each "
                    "rank steps only its own share"
                )
    return None


@dataclass(frozen=True)
class Elementwise:
    """The elementwise probe's verdict: ``reason`` None if the flat partition may step the class
    on slices, and then the state keys that hold one value per element (``keys``)."""

    reason: str | None
    keys: frozenset[str] = frozenset()


def elementwise(optimizer_class: Any, defaults: dict[str, Any], like: torch.Tensor) -> Elementwise:
    """Whether ``optimizer_class`` updates each element from that element's own history alone,
    whatever the tensor's shape or cut (see [Note: optimizer probes]).

    Example:
        >>> sorted(elementwise(torch.optim.Adam, {"lr": 0.1}, torch.zeros(1)).keys)
        ['exp_avg', 'exp_avg_sq']
    """
    probe = _Probe(optimizer_class, dict(defaults), like.dtype, like.device)
    return _cached("elementwise", probe, lambda: _elementwise(probe))


def _elementwise(probe: _Probe) -> Elementwise:
    reason = _cached("coupling", probe, lambda: _guarded(_coupling, probe))
    if reason is None:
        reason = _guarded(_perturbed, probe)
    if reason is not None:
        return Elementwise(reason)
    try:
        return _cut(probe)
    except Exception as exc:
        return Elementwise(_failed(exc))


def _perturbed(probe: _Probe) -> str | None:
    """Changes one element of each tensor in turn: no other element may move."""
    for design in DESIGNS:
        reason = _perturbed_in(probe.in_float64(), design)
        if reason:
            return reason
    return None


def _perturbed_in(probe: _Probe, design: int) -> str | None:
    start, grads = probe.tensors(design)
    base, _ = probe.run(start, grads)
    for i, element in ((0, 5), (1, 2)):
        moved = [x.clone() for x in start]
        moved[i].view(-1)[element] += 0.25
        steps = [[g.clone() for g in step] for step in grads]
        for step in steps:
            step[i].view(-1)[element] += 0.5
        got, _ = probe.run(moved, steps)
        for j, (x, y) in enumerate(zip(got, base)):
            keep = torch.ones(x.numel(), dtype=torch.bool, device=x.device)
            if j == i:
                keep[element] = False
            if not _same(x.reshape(-1)[keep], y.reshape(-1)[keep]):
                return (
                    "its update of an element depends on other elements (changing one element "
                    "of a tensor moved others, as a norm or a matrix preconditioner does)"
                )
    return None


def _cut(probe: _Probe) -> Elementwise:
    """The (3, 4) tensor whole, flattened, and cut into 5 + 7 elements must end (values and
    states) the same; returns the state keys with one value per element."""
    start, grads = probe.tensors()
    whole, whole_states = probe.run(start, grads)
    flat, _ = probe.run([start[0].reshape(-1), start[1]], [[s[0].reshape(-1), s[1]] for s in grads])
    cut = [start[0].reshape(-1)[:5], start[0].reshape(-1)[5:], start[1]]
    pieces, piece_states = probe.run(
        cut, [[s[0].reshape(-1)[:5], s[0].reshape(-1)[5:], s[1]] for s in grads]
    )
    joined = torch.cat([pieces[0], pieces[1]])
    if not (_same(flat[0], whole[0].reshape(-1)) and _same(joined, whole[0].reshape(-1))):
        return Elementwise(
            "its update depends on the parameter's shape or on where the flat partition cuts it "
            "(the tensor whole, flattened and in two pieces ended differently)"
        )
    keys = set()
    entry, first, second = whole_states[0], piece_states[0], piece_states[1]
    if set(entry) != set(first) or set(entry) != set(second):
        return Elementwise(_state_reason(f"keys {sorted(entry)} and {sorted(first)}"))
    for key, value in entry.items():
        a, b = first[key], second[key]
        if isinstance(value, torch.Tensor) and value.shape == whole[0].shape:
            if not _same(torch.cat([a.reshape(-1), b.reshape(-1)]), value.reshape(-1)):
                return Elementwise(_state_reason(f"'{key}'"))
            keys.add(key)
        elif not (_equal_values(value, a) and _equal_values(value, b)):
            return Elementwise(_state_reason(f"'{key}'"))
    return Elementwise(None, frozenset(keys))


def _state_reason(what: str) -> str:
    return (
        f"its state does not split by element ({what} of a tensor differ from those of its pieces)"
    )


def _equal_values(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _same(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False
