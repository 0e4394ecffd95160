"""Publishing a checkpoint directory atomically: a link at ``path`` swapped in by one replace."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid

import torch

from shardopt.functional.checkpoint._errors import CheckpointError
from shardopt.functional.engine._collectives import ProcessGroup, comm_device
from shardopt.functional.engine._failure import MAX_TEXT, error_text, raised_on_every_rank
from shardopt.functional.engine._rooted import broadcast_from

__all__ = [
    "MARKER",
    "agree_on_rank0",
    "from_rank0",
    "mark",
    "publish",
    "published",
    "refusal",
    "shared_token",
]

# [Note: atomic checkpoints]
# DCP writes a directory file by file, its ``.metadata`` last (on the coordinator, once every
# rank's writes are done): a crash mid-way would leave a directory that looks like a checkpoint.
# So ``path`` is a pointer: a symbolic link to a versioned directory beside it,
# ``<path>.v-<token>`` (``token``: 16 hex digits drawn on rank 0 and broadcast), which is where
# every rank writes. Rank 0 first puts the marker file ``.shardopt_checkpoint`` (the token, as
# JSON) into it, before DCP writes anything: whatever a crash leaves of that version is known to
# be shardopt's own. After ``dcp.save`` returned everywhere and a barrier, rank 0 alone
# publishes, under the lock of [Note: checkpoint lock] and with no collective until it is done,
# cleanup included (a peer dying meanwhile cannot stop it):
#   1. make a link ``<path>.link-<token>`` to the new version and ``os.replace`` ``path`` with
#      it: the commit point (a rename over a link is atomic);
#   2. remove what it supersedes or what crashed saves left: each symbolic link
#      ``<path>.link-*``, each directory ``<path>.v-*`` holding the marker of its own token but
#      the one ``path`` now points to, and the version ``path`` pointed to before the commit
#      (one of the format before the marker has no marker, but ``path`` named it);
#   3. remove the lock file.
# Nothing else is ever removed, whatever its name: not ``path`` when it is anything but such a
# link (a directory, a file, another link: ``save_checkpoint`` refuses it, whatever
# ``overwrite`` says), not a ``<path>.v-*`` without the marker, not the ``.old-*`` and
# ``.tmp-*`` names of older shardopts. Invariant: ``path`` is always a complete checkpoint once
# one was published: before the commit it points to the old version, which nothing removes
# before the commit; after it, to the new one, complete before the commit. So at every crash
# point ``path`` itself is the old or the new checkpoint, and ``torch.distributed.checkpoint.load``
# (any tool) reads it directly (the link resolves to a plain DCP directory). The lock makes this
# hold for saves of independent jobs too: no save removes a version that another is writing. A
# failure in any rank's writes makes ``dcp.save`` raise on every rank (DCP gathers the results);
# rank 0 then removes the new version, so ``path`` is untouched. Rank 0 broadcasts whether the
# publish succeeded, so every rank returns or raises alike.

MARKER = ".shardopt_checkpoint"
_VERSION = re.compile(r"\.v-([0-9a-f]{16})")


def shared_token(group: ProcessGroup) -> int:
    """A random 62-bit number drawn on rank 0 of ``group`` and broadcast (the same everywhere)."""
    token = torch.tensor([uuid.uuid4().int >> 66], dtype=torch.int64, device=comm_device(group))
    broadcast_from(token, 0, group=group)
    return int(token.item())


def agree_on_rank0(api: str, error: BaseException | None, group: ProcessGroup) -> None:
    """Rank 0 says whether ``error`` happened; every rank raises a CheckpointError if so."""
    text = from_rank0(None if error is None else error_text(error), group)
    if text is not None:
        failure = CheckpointError(f"{api}: rank 0 failed to move the checkpoint into place: {text}")
        raise raised_on_every_rank(failure) from error


def from_rank0(text: str | None, group: ProcessGroup) -> str | None:
    """Rank 0's ``text`` (at most MAX_TEXT characters), on every rank of ``group``."""
    device = comm_device(group)
    data = b"" if text is None else text[:MAX_TEXT].encode("utf-8", "replace")
    size = torch.tensor([-1 if text is None else len(data)], dtype=torch.int64, device=device)
    broadcast_from(size, 0, group=group)
    n = int(size.item())
    if n <= 0:
        return None if n < 0 else ""
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    if data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    broadcast_from(buf, 0, group=group)
    return bytes(buf.cpu().tolist()).decode("utf-8", "replace")


def mark(version: str, token: int) -> None:
    """Creates the version directory with its marker (step 0 of [Note: atomic checkpoints])."""
    os.makedirs(version, exist_ok=True)
    with open(os.path.join(version, MARKER), "x", encoding="utf-8") as f:
        json.dump({"checkpoint": "shardopt", "version": f"{token:016x}"}, f)


def _marked(version: str) -> bool:
    """Whether ``version`` (a ``<path>.v-<token>``) is a directory holding its own marker."""
    match = _VERSION.search(os.path.basename(version))
    if match is None or os.path.islink(version):
        return False
    try:
        with open(os.path.join(version, MARKER), encoding="utf-8") as f:
            record = json.loads(f.read(4096))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("version") == match.group(1)


def _pointed(target: str) -> str | None:
    """The version ``target`` links to, if it is a link to a ``<target>.v-<16 hex>`` beside it."""
    if not os.path.islink(target):
        return None
    name = os.readlink(target)
    base = os.path.basename(target)
    if not re.fullmatch(re.escape(base) + _VERSION.pattern, name):
        return None
    return os.path.join(os.path.dirname(target), name)


def _describe(target: str) -> str:
    """What is at ``target``, in words."""
    if os.path.islink(target):
        return f"a symbolic link to {os.readlink(target)!r}"
    if os.path.isdir(target):
        try:
            names = sorted(os.listdir(target))
        except OSError:
            return "a directory that cannot be listed"
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        return f"a directory of {len(names)} entries" + (f" ({shown})" if names else "")
    if os.path.isfile(target):
        return f"a regular file of {os.path.getsize(target)} bytes"
    return "a special file (not a directory, regular file or link)"


def refusal(target: str, overwrite: bool) -> str | None:
    """Why ``save_checkpoint`` must not save at ``target`` (to follow ``expected``), or None.

    Example:
        >>> import tempfile
        >>> user = tempfile.mkdtemp()
        >>> open(os.path.join(user, "notes.txt"), "w").close()
        >>> print(refusal(user, True).split(", got ")[1].split(";")[0])
        a directory of 1 entries ('notes.txt')
        >>> refusal(os.path.join(user, "new"), False) is None
        True
    """
    if not os.path.lexists(target):
        return None
    version = _pointed(target)
    ours = version is not None and (
        _marked(version)
        or not os.path.lexists(version)  # (a link to nothing: replacing it loses nothing)
        or os.path.isfile(os.path.join(version, ".metadata"))  # the format before the marker
    )
    if not ours:
        base = os.path.basename(target)
        return (
            f"{target!r} to be absent or a checkpoint that shardopt wrote (a link to a "
            f"{base}.v-<16 hex digits> directory holding {MARKER}), got {_describe(target)}; "
            f"shardopt deletes only what it wrote, whatever overwrite says (overwrite="
            f"{overwrite}): move it, or save elsewhere"
        )
    if not overwrite:
        return f"a path that does not exist (or overwrite=True), got {target!r}"
    return None


def publish(version: str, target: str) -> None:
    """Steps 1-2 of [Note: atomic checkpoints], on rank 0, under the lock."""
    before = _pointed(target)
    token = os.path.basename(version).rsplit("-", 1)[1]
    link = f"{target}.link-{token}"
    os.symlink(os.path.basename(version), link)
    os.replace(link, target)
    for leftover in _leftovers(target):
        if os.path.islink(leftover):  # a crashed save's link: never the pointer itself
            if leftover.rsplit(".", 1)[1].startswith("link-"):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
        elif leftover != version and (_marked(leftover) or leftover == before):
            shutil.rmtree(leftover, ignore_errors=True)


def _leftovers(target: str, kind: str = "v|link") -> list[str]:
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
    """Where the checkpoint published at ``target`` is: the directory it links to (resolved once,
    so that one load reads one version), ``target`` itself (any DCP directory), or the one
    ``.old-*`` a crash of an older shardopt left while replacing its plain directory; None if
    there is none."""
    if os.path.exists(target):
        return os.path.realpath(target)
    olds = _leftovers(target, "old")
    return olds[0] if len(olds) == 1 else None
