"""Publishing a checkpoint directory atomically: a link at ``path`` swapped in by one replace."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid

import torch

from shardopt.functional.engine._collectives import ProcessGroup, comm_device
from shardopt.functional.engine._rooted import broadcast_from

__all__ = ["agree_on_rank0", "publish", "published", "shared_token"]

# [Note: atomic checkpoints]
# DCP writes a directory file by file, its ``.metadata`` last (on the coordinator, once every
# rank's writes are done): a crash mid-way would leave a directory that looks like a checkpoint.
# So ``path`` is a pointer: a symbolic link to a versioned directory beside it,
# ``<path>.v-<token>`` (``token``: 16 hex digits drawn on rank 0 and broadcast), which is where
# every rank writes. After ``dcp.save`` returned everywhere and a barrier, rank 0 alone
# publishes, with no collective until it is done, cleanup included (a peer dying meanwhile
# cannot stop it):
#   1. make a link ``<path>.link-<token>`` to the new version and ``os.replace`` ``path`` with
#      it: the commit point (a rename over a link is atomic);
#   2. remove every leftover: each ``<path>.v-*`` but the one ``path`` now points to, each
#      ``<path>.link-*``, and what older saves left (``<path>.tmp-*``, ``<path>.old-*``).
# Leftovers are those names with 16 hex digits (``_leftovers``), never ``path`` nor any other
# name. Invariant: ``path`` is always a complete checkpoint once one was published: before the
# commit it points to the old version, which nothing removes before the commit; after it, to
# the new one, complete before the commit. So at every crash point ``path`` itself is the old or
# the new checkpoint, and ``torch.distributed.checkpoint.load`` (any tool) reads it directly
# (the link resolves to a plain DCP directory). A checkpoint that an older shardopt published as
# a plain directory at ``path`` is first renamed to ``<path>.old-<token>`` (the one moment
# ``path`` is absent; ``published`` then finds it there). The next save removes what a crash
# left. A failure in any rank's writes makes ``dcp.save`` raise on every rank (DCP gathers the
# results); rank 0 then removes the new version, so ``path`` is untouched. Rank 0 broadcasts
# whether the publish succeeded, so every rank returns or raises alike.


def shared_token(group: ProcessGroup) -> int:
    """A random 62-bit number drawn on rank 0 of ``group`` and broadcast (the same everywhere)."""
    token = torch.tensor([uuid.uuid4().int >> 66], dtype=torch.int64, device=comm_device(group))
    broadcast_from(token, 0, group=group)
    return int(token.item())


def agree_on_rank0(api: str, error: BaseException | None, group: ProcessGroup) -> None:
    """Rank 0 says whether ``error`` happened; every rank raises if so."""
    flag = torch.tensor([0 if error is None else 1], device=comm_device(group))
    broadcast_from(flag, 0, group=group)
    if error is not None:
        raise error
    if flag.item():
        raise RuntimeError(f"{api}: rank 0 failed to move the checkpoint into place")


def publish(version: str, target: str, token: int) -> None:
    """Steps 1-2 of [Note: atomic checkpoints], on rank 0."""
    if os.path.isdir(target) and not os.path.islink(target):  # published by an older shardopt
        for old in _leftovers(target, "old"):
            shutil.rmtree(old)  # must succeed: one .old-* at most while nothing is at target
        os.rename(target, f"{target}.old-{token:016x}")
    link = f"{target}.link-{token:016x}"
    os.symlink(os.path.basename(version), link)
    os.replace(link, target)
    current = os.path.realpath(target)
    for leftover in _leftovers(target):
        if os.path.islink(leftover):  # a crashed save's link: never the pointer itself
            with contextlib.suppress(OSError):
                os.unlink(leftover)
        elif os.path.realpath(leftover) != current:
            shutil.rmtree(leftover, ignore_errors=True)


def _leftovers(target: str, kind: str = "v|link|tmp|old") -> list[str]:
    """The ``<target>.<kind>-<16 hex>`` names beside ``target`` (see [Note: atomic checkpoints]),
    sorted."""
    parent, base = os.path.split(target)
    pattern = re.compile(re.escape(base) + rf"\.({kind})-[0-9a-f]{{16}}")
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return sorted(os.path.join(parent, n) for n in names if pattern.fullmatch(n))


def published(target: str) -> str | None:
    """Where the checkpoint published at ``target`` is: ``target``, or the one ``.old-*`` a crash
    while replacing an older shardopt's directory left; None if there is none."""
    if os.path.exists(target):
        return target
    olds = _leftovers(target, "old")
    return olds[0] if len(olds) == 1 else None
