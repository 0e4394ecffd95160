"""Reading a DCP checkpoint without running code from it, into the state only once all is read."""

from __future__ import annotations

import importlib
import io
import math
import os
import pickle
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

__all__ = ["SafeReader", "StagedPlanner", "UnsafeCheckpointError", "safe_metadata"]

# [Note: safe loads]
# A checkpoint is data, and loading one must not run code from it, nor leave the state half
# loaded. DCP's own reader unpickles ``.metadata`` with ``pickle`` and, before torch 2.6, each
# tensor with ``torch.load(weights_only=False)``; its planner loads every non-tensor value so
# (a pickle runs whatever it names). So loads go through a reader and a planner of our own:
# - ``.metadata`` is unpickled by ``safe_metadata``: a pickle may name only DCP's metadata
#   classes and the few torch and library types they hold (``torch.Size``, dtypes, layouts,
#   paths); any other global is refused, naming it, before anything is built from it. The
#   result must be a ``Metadata``, and each data location a plain file name in the directory;
# - every tensor and every other value is read with ``torch.load(weights_only=True)`` (tensors,
#   numbers, strings and containers only), from exactly the bytes the metadata gives (a
#   truncated file is an error naming the entry);
# - before any data is read, each entry of the state dict is checked against the metadata: a
#   tensor must be saved as a tensor (not as a pickled value), of the same dtype (optimizer
#   state: exactly; ``extra``: of the same kind, floating, complex, integer or bool), and its
#   chunks must cover every element exactly once (DCP itself loads what the chunks cover and
#   leaves the rest as it was);
# - what is read is staged: the tensors as read, the other values aside; only once every rank
#   has read everything (DCP gathers every rank's result) does ``StagedPlanner.commit`` copy them
#   into the state. A failure anywhere leaves every rank's state as it was.
# The staging holds what a rank reads until the commit, as the read tensors themselves: no copy
# more than DCP's own reader makes (it copies each into its destination at once).

_METADATA_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that shardopt refuses to read (it would run code, or is malformed)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _METADATA_TYPES.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise UnsafeCheckpointError(
                f"DCP's metadata classes and the types they hold, got the global {module}.{name}"
            )
        return getattr(importlib.import_module(module), name)


def safe_metadata(data: bytes, where: str) -> Metadata:
    """The DCP ``Metadata`` pickled in ``data`` (the file ``where``), unpickled without running
    code (see [Note: safe loads]); raises UnsafeCheckpointError naming what it refuses.

    Example:
        >>> import os, pickle
        >>> safe_metadata(pickle.dumps(Metadata({})), ".metadata").state_dict_metadata
        {}
        >>> try:
        ...     safe_metadata(pickle.dumps(os.getcwd), ".metadata")
        ... except UnsafeCheckpointError as exc:
        ...     print(exc.args[0].split(", ")[-1])
        got the global posix.getcwd
    """
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{where}: expected {exc}") from None
    except Exception as exc:  # (a malformed pickle: any error of the unpickler)
        got = type(exc).__name__
        raise UnsafeCheckpointError(f"{where}: expected a pickle, got {got}") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"{where}: expected DCP's Metadata, got {type(md).__name__}")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str) or not _well_formed(entry):
            raise UnsafeCheckpointError(
                f"{where}: expected each entry to be a key with DCP's tensor or bytes metadata, "
                f"got {key!r}: {type(entry).__name__}"
            )
    if md.storage_data is not None and not isinstance(md.storage_data, dict):
        raise UnsafeCheckpointError(f"{where}: expected the data locations as a dict")
    return md


def _well_formed(entry: Any) -> bool:
    if isinstance(entry, BytesStorageMetadata):
        return True
    return (
        isinstance(entry, TensorStorageMetadata)
        and isinstance(entry.size, torch.Size)
        and isinstance(entry.chunks, list)
        and all(
            isinstance(c, ChunkStorageMetadata)
            and isinstance(c.offsets, torch.Size)
            and isinstance(c.sizes, torch.Size)
            for c in entry.chunks
        )
    )


def _location(api: str, md: Metadata, index: Any) -> tuple[str, int, int]:
    """(file name, offset, length) of a saved item, checked to be a plain file of the directory."""
    info = (md.storage_data or {}).get(index)
    name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or os.sep in name
        or not all(isinstance(v, int) and v >= 0 for v in (offset, length))
    ):
        raise UnsafeCheckpointError(
            f"{api}: expected the data of {index.fqn} at a file of the checkpoint directory, "
            f"got {name!r} (offset {offset!r}, length {length!r})"
        )
    return name, int(offset), int(length)  # type: ignore[arg-type]


def _narrowed(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (start, n) in enumerate(zip(offsets, lengths)):
        if start != 0 or n != t.size(dim):
            t = t.narrow(dim, start, n)
    return t


class _Slice(io.IOBase):
    """Bytes ``[offset, offset + length)`` of the open file ``f``, as a file (read in place by
    ``torch.load``: no copy of the whole slice first); the only reader of ``f`` meanwhile."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._end, self._at = f, offset, offset + length, offset
        f.seek(offset)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at - self._start

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: self._start, io.SEEK_CUR: self._at, io.SEEK_END: self._end}
        self._at = min(max(base[whence] + pos, self._start), self._end)
        self._f.seek(self._at)
        return self._at - self._start

    def read(self, size: int = -1) -> bytes:
        left = self._end - self._at
        data = self._f.read(left if size is None or size < 0 else min(size, left))
        self._at += len(data)
        return bytes(data)

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        left = self._end - self._at
        n = int(self._f.readinto(view[:left] if len(view) > left else view))
        self._at += n
        return n


# Items up to this size are read whole and loaded from memory (fewer calls into Python for
# torch.load's small reads); larger ones through a _Slice (no copy of their bytes first).
WHOLE_BYTES = 1 << 20


class SafeReader(FileSystemReader):
    """DCP's file system reader, reading as [Note: safe loads] says; ``.metadata`` is read once
    (the same object for shardopt's checks and DCP's plan)."""

    def __init__(self, path: str, api: str) -> None:
        super().__init__(path)
        self._root, self._api = os.fspath(path), api
        self._md: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._md is None:
            name = ".metadata" if kwargs.get("rank") is None else f"__{kwargs['rank']}.metadata"
            with open(os.path.join(self._root, name), "rb") as f:
                data = f.read()
            self._md = safe_metadata(data, f"{self._api}: {os.path.join(self._root, name)}")
        md = self._md
        storage_meta = getattr(md, "storage_meta", None)
        if storage_meta is not None and hasattr(self, "load_id"):
            storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        md = self.read_metadata()
        by_file: dict[str, list[tuple[ReadItem, int, int]]] = {}
        for item in plan.items:
            name, offset, length = _location(self._api, md, item.storage_index)
            by_file.setdefault(name, []).append((item, offset, length))
        for name, items in by_file.items():
            with open(os.path.join(self._root, name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                for item, offset, length in items:
                    if offset + length > size:
                        raise UnsafeCheckpointError(
                            f"{self._api}: expected {length} bytes of {item.storage_index.fqn} at "
                            f"offset {offset} of {name}, got {max(0, size - offset)} (a "
                            "truncated file)"
                        )
                    if length <= WHOLE_BYTES:
                        f.seek(offset)
                        planner.stage(item, io.BytesIO(f.read(length)))
                    else:
                        planner.stage(item, _Slice(f, offset, length))
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "floating" if dtype.is_floating_point else "complex" if dtype.is_complex else "integer"


def _tiled(chunks: Sequence[ChunkStorageMetadata], size: Sequence[int]) -> str | None:
    """Why ``chunks`` do not cover a tensor of ``size`` exactly once, or None."""
    boxes = []
    for c in chunks:
        lo, n = tuple(c.offsets), tuple(c.sizes)
        if len(lo) != len(size) or len(n) != len(size):
            return f"a chunk of {len(lo)} dimensions, not {len(size)}"
        if any(a < 0 or b < 0 or a + b > s for a, b, s in zip(lo, n, size)):
            return f"a chunk at {list(lo)} of sizes {list(n)} outside the shape {list(size)}"
        if math.prod(n):
            boxes.append((lo, tuple(a + b for a, b in zip(lo, n))))
    boxes.sort()
    for i, (lo, hi) in enumerate(boxes):  # a sweep along dimension 0 (cheap for row runs)
        for lo2, hi2 in boxes[i + 1 :]:
            if size and lo2[0] >= hi[0]:
                break
            if all(a < d and c < b for a, b, c, d in zip(lo, hi, lo2, hi2)):
                return f"chunks at {list(lo)} and {list(lo2)} that overlap"
    covered = sum(math.prod(b - a for a, b in zip(lo, hi)) for lo, hi in boxes)
    if covered != math.prod(size):
        return f"chunks covering {covered} of its {math.prod(size)} elements"
    return None


class StagedPlanner(DefaultLoadPlanner):
    """DCP's default load planner, checking and staging as [Note: safe loads] says; ``exact``:
    the key prefix whose tensors must keep their dtype exactly (others: their kind)."""

    def __init__(self, api: str, exact: str) -> None:
        super().__init__()
        self._api, self._exact = api, exact
        self._tensors: list[tuple[ReadItem, torch.Tensor]] = []
        self._values: list[tuple[ReadItem, Any]] = []

    def create_local_plan(self) -> LoadPlan:
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn) if self.metadata else None
            problem = None if md is None else self._problem(fqn, obj, md)
            if problem is not None:
                raise UnsafeCheckpointError(f"{self._api}: expected {fqn} {problem}")
        return super().create_local_plan()

    def _problem(self, fqn: str, obj: Any, md: Any) -> str | None:
        if not isinstance(obj, torch.Tensor):
            if isinstance(md, BytesStorageMetadata):
                return None
            return f"to hold a value (as {type(obj).__name__}), got a tensor"
        if not isinstance(md, TensorStorageMetadata):
            return f"to be a tensor, got {type(md).__name__} (a pickled value)"
        saved = getattr(md.properties, "dtype", None)
        if not isinstance(saved, torch.dtype) or not isinstance(md.size, torch.Size):
            return f"to be a tensor of a dtype and shape, got {saved!r} and {md.size!r}"
        exact = fqn.startswith(self._exact)
        if saved != obj.dtype and (exact or _kind(saved) != _kind(obj.dtype)):
            return f"of dtype {obj.dtype}, got {saved}"
        gap = _tiled(md.chunks, md.size)
        return None if gap is None else f"to be saved whole, got {gap}"

    def stage(self, item: ReadItem, data: Any) -> None:
        """Reads ``data`` (a file of the bytes of ``item``) into the staging, checked."""
        fqn = item.storage_index.fqn
        try:
            value = torch.load(data, map_location="cpu", weights_only=True)
        except Exception as exc:  # (any refusal or malformed data)
            raise UnsafeCheckpointError(
                f"{self._api}: expected {fqn} to hold tensors or plain values only, got data "
                f"that torch.load(weights_only=True) refuses ({type(exc).__name__}: "
                f"{str(exc)[:300]})"
            ) from None
        if item.type == LoadItemType.BYTE_IO:
            self._values.append((item, value))
            return
        md: Any = self.metadata.state_dict_metadata[fqn]  # type: ignore[union-attr]
        if not isinstance(value, torch.Tensor) or value.dtype != md.properties.dtype:
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise UnsafeCheckpointError(
                f"{self._api}: expected {fqn} to hold a tensor of {md.properties.dtype} as its "
                f"metadata says, got {got}"
            )
        part = _narrowed(value, item.storage_offsets, item.lengths)
        if tuple(part.shape) != tuple(item.lengths):
            raise UnsafeCheckpointError(
                f"{self._api}: expected a chunk of {fqn} of sizes {list(item.lengths)}, got "
                f"{list(part.shape)}"
            )
        self._tensors.append((item, part))

    def staged(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors read so far, not yet written: (key, chunk) pairs."""
        return [(item.storage_index.fqn, part) for item, part in self._tensors]

    def commit(self, sd: dict[str, Any]) -> None:
        """Writes everything staged into ``sd`` (the state dict given to ``dcp.load``), once
        every rank has read all: the tensors in place, the other values by their key path."""
        for item, part in self._tensors:
            target = self.resolve_tensor(item).detach()
            target.copy_(part)
            self.commit_tensor(item, target)
        for item, value in self._values:
            fqn = item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(sd, self.mappings[fqn], value)
            else:
                sd[fqn] = value
        self._tensors, self._values = [], []
