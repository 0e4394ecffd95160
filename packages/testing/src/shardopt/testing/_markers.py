"""The ``world`` and ``gpu`` pytest markers: reading them and deciding when a test is skipped."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from shardopt.testing._world import cuda_device_count

__all__ = ["GPU_MARKER", "WORLD_MARKER", "WorldRequest", "skip_reason", "world_request"]

WORLD_MARKER = (
    "world(n, *, backend='auto', timeout=120.0, init_store='file', fresh=False): run the test "
    "body on every rank of an n-process world (shardopt.testing); n is an int or the name of a "
    "parameter; fresh=True: new processes, not warm ones"
)
GPU_MARKER = "gpu(n): needs at least n CUDA devices; skipped otherwise (shardopt.testing)"
_WORLD_OPTIONS = ("backend", "timeout", "init_store", "fresh")


@dataclass(frozen=True, slots=True)
class WorldRequest:
    """A validated ``@pytest.mark.world(...)``: the world a test body runs in."""

    size: int
    backend: str = "auto"
    timeout: float = 120.0
    init_store: str = "file"
    fresh: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"world marker: expected a world size int >= 1, got {self.size!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(
                f"world marker: expected backend in ('auto', 'gloo', 'nccl'), got {self.backend!r}"
            )
        if not (isinstance(self.timeout, (int, float)) and 0 < self.timeout < math.inf):
            raise ValueError(f"world marker: expected a timeout > 0 seconds, got {self.timeout!r}")
        if not isinstance(self.fresh, bool):
            raise ValueError(f"world marker: expected fresh a bool, got {self.fresh!r}")
        if self.init_store not in ("file", "tcp"):
            raise ValueError(
                f"world marker: expected init_store in ('file', 'tcp'), got {self.init_store!r}"
            )


def world_request(item: Any) -> WorldRequest | None:
    """The world requested by ``item``'s ``world`` marker, or None without one.

    ``@pytest.mark.world("n")`` takes the size from the test's parameter ``n``.

    Raises:
        ValueError: a malformed marker, or a size parameter the test does not have.
    """
    marker = item.get_closest_marker("world")
    if marker is None:
        return None
    unknown = sorted(set(marker.kwargs) - set(_WORLD_OPTIONS))
    if len(marker.args) != 1 or unknown:
        raise ValueError(
            "world marker: expected world(n, *, backend=..., timeout=..., init_store=..., "
            "fresh=...), got "
            f"args {marker.args!r} and kwargs {marker.kwargs!r} on {item.nodeid}"
        )
    size = marker.args[0]
    if isinstance(size, str):
        params = getattr(getattr(item, "callspec", None), "params", {})
        if size not in params:
            raise ValueError(
                f"world marker: {item.nodeid} has no parameter {size!r} to take the world size "
                f"from; add @pytest.mark.parametrize({size!r}, [...])"
            )
        size = params[size]
    return WorldRequest(size, **marker.kwargs)


def skip_reason(item: Any) -> str | None:
    """Why ``item`` cannot run on this machine (too few CUDA devices), or None.

    Raises:
        ValueError: a malformed ``gpu`` or ``world`` marker.
    """
    gpu = item.get_closest_marker("gpu")
    found = cuda_device_count()
    if gpu is not None:
        needed = gpu.args[0] if len(gpu.args) == 1 and not gpu.kwargs else None
        if isinstance(needed, bool) or not isinstance(needed, int) or needed < 0:
            raise ValueError(f"gpu marker: expected gpu(n) with an int n >= 0 on {item.nodeid}")
        if found < needed:
            return f"needs {needed} CUDA device(s), found {found}"
    request = world_request(item)
    if request is not None and request.backend == "nccl":
        usable = found if dist.is_nccl_available() else 0
        if usable < request.size:
            return (
                f"world({request.size}, backend='nccl') needs {request.size} CUDA device(s) "
                f"with NCCL, found {usable}"
            )
    return None
