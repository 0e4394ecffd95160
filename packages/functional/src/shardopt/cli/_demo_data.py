"""The demo's corpus: this Python's own standard library sources, as characters, in batches."""

from __future__ import annotations

import os
import sysconfig

import torch

__all__ = ["VOCAB", "decode", "encode", "read_corpus", "sample_batch", "stdlib_dir"]

# [Note: demo corpus]
# Every Python installation carries a few MB of Python source in its standard library, so the
# demo trains on the first top-level ``*.py`` files of it, in sorted order, up to the size asked
# for: no download, no text copied into the repository. Characters outside the fixed vocabulary
# (tab, newline and printable ASCII) become ``?``. Rank 0 reads the corpus and broadcasts it, so
# every rank (and every node of a torchrun world) trains on the same bytes.
VOCAB = "\t\n" + "".join(chr(c) for c in range(32, 127))
_INDEX = {c: i for i, c in enumerate(VOCAB)}
_UNKNOWN = _INDEX["?"]


def stdlib_dir() -> str:
    """The directory of this Python's standard library sources."""
    return sysconfig.get_paths()["stdlib"]


def read_corpus(num_bytes: int) -> str:
    """About ``num_bytes`` characters of standard library source (see [Note: demo corpus]).

    Example:
        >>> text = read_corpus(2000)
        >>> 2000 <= len(text) < 2000 + 10**6
        True
    """
    if num_bytes < 1:
        raise ValueError(f"read_corpus: expected num_bytes >= 1, got {num_bytes}")
    root = stdlib_dir()
    parts: list[str] = []
    size = 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as file:
            text = file.read()
        parts.append(text)
        size += len(text)
        if size >= num_bytes:
            return "".join(parts)
    raise ValueError(f"read_corpus: {root} holds only {size} bytes of sources, {num_bytes} asked")


def encode(text: str) -> torch.Tensor:
    """Characters to vocabulary indices (uint8).

    Example:
        >>> decode(encode("def f():\\n\\té"))
        'def f():\\n\\t?'
    """
    return torch.tensor([_INDEX.get(c, _UNKNOWN) for c in text], dtype=torch.uint8)


def decode(ids: torch.Tensor) -> str:
    """Vocabulary indices to characters."""
    return "".join(VOCAB[i] for i in ids.tolist())


def sample_batch(
    data: torch.Tensor, step: int, batch: int, length: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``batch`` random windows, as (inputs, next characters).

    The same on every rank and in the single-process reference; rank ``r`` of ``W`` trains on
    rows ``[r * batch // W, (r + 1) * batch // W)``.

    Example:
        >>> x, y = sample_batch(encode("abcdefgh"), 0, 2, 3)
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        (torch.Size([2, 3]), True)
    """
    if data.numel() <= length:
        raise ValueError(
            f"sample_batch: expected more than {length} characters, got {data.numel()}"
        )
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - length, (batch,), generator=gen)
    windows = torch.stack([data[s : s + length + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
