"""``shardopt plan``: per-rank memory and traffic of DDP and shardopt stages, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Sequence
from typing import Any

import torch

from shardopt.cli._plan_cli_predict import DDP, ParamSpec, Prediction, predict
from shardopt.cli._plan_cli_source import load_params
from shardopt.core import DEFAULT_BUCKET_NUMEL

__all__ = ["add_plan_parser", "format_bytes", "plan_report", "render_table", "run_plan"]

MAX_WORLD_SIZE = 4096
_DTYPES = ("float32", "bfloat16", "float16", "float64")
_ASSUMPTIONS = (
    "optimizer: Adam/AdamW, 2 moments + a float32 step per tensor; frozen params: replicated",
    "bytes: tensors each rank holds between steps, max over ranks (activations not counted); "
    "B/param: the total per parameter of the model",
    "DDP: torch.optim.AdamW, gradient_as_bucket_view=True (no second gradient copy)",
    "stage 1: local gradients kept, reduce-scatter into 1/W shards + all-gather of the buckets",
    "stage 2: as stage 1, full gradients freed as they are packed (1/W gradient memory)",
    "from shardopt.functional.shard_cost, the engine's own rules (buckets, shards, staging)",
    "shardopt's calls: {calls}",
    "sent = received per rank per step, ring algorithms: all-reduce 2(W-1)/W of the buffer, "
    "reduce-scatter and all-gather (W-1)/W",
)
_CALLS = {
    "collective": "one all-gather / reduce-scatter per bucket of --bucket-numel elements (all "
    "ranks together); one broadcast / reduce per owner where shards are unequal (greedy) "
    "(--algorithm collective)",
    "exchange": "one broadcast per owner and one all-to-all per bucket; one reduce per owner where "
    "shards are unequal (--algorithm exchange: shard()'s choice for CPU tensors on gloo)",
}
_WIRE = (
    "--comm-dtype {comm}: shardopt's gradients staged and sent in {comm}, one all-to-all per "
    "bucket, summed in float32 (or their dtype, if wider) by their owner, into a scratch of W x "
    "the bucket's largest shard; across replicas an all-to-all of {comm} shards, summed in "
    "float32, and an all-gather in the shard's dtype (DDP: unchanged)"
)
_COLUMNS = ("params", "grads", "optimizer", "master", "buffers", "total")


def format_bytes(n: float) -> str:
    """Bytes with a binary unit, 3 significant digits or so.

    Example:
        >>> format_bytes(0), format_bytes(1536), format_bytes(6 * 2**30)
        ('0', '1.50 KiB', '6.00 GiB')
    """
    if n == 0:
        return "0"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _rows(stages: Sequence[int], strategies: Sequence[str]) -> list[tuple[int, str]]:
    out = []
    for stage in stages:
        if stage == DDP:
            out.append((DDP, "flat"))
        else:
            out.extend((stage, s) for s in strategies)
    return out


def plan_report(
    params: Sequence[ParamSpec],
    world_sizes: Sequence[int],
    *,
    stages: Sequence[int] = (0, 1, 2),
    strategies: Sequence[str] = ("flat", "greedy"),
    master_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype | None = None,
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
    algorithm: str = "collective",
    meshes: Sequence[tuple[int, int]] = (),
    comm_dtype: torch.dtype | None = None,
    master_remainders: bool = False,
) -> list[Prediction]:
    """Every requested stage and strategy at every world size, then on every (replicas,
    shards) mesh (hybrid sharding; DDP over all its ranks), in that order. ``comm_dtype`` and
    ``master_remainders`` are shard()'s, for the shardopt rows only.

    Example:
        >>> from shardopt.core import TensorSpec
        >>> params = [ParamSpec("w", TensorSpec((64,), "float32", "cpu"))]
        >>> [p.label for p in plan_report(params, [2], stages=(0, 2), strategies=("flat",))]
        ['DDP', 'stage 2 flat']
    """
    for w in [*world_sizes, *(r * s for r, s in meshes)]:
        if type(w) is not int or not 1 <= w <= MAX_WORLD_SIZE:
            raise ValueError(f"plan: expected world sizes in [1, {MAX_WORLD_SIZE}], got {w!r}")
    worlds = [(1, w) for w in world_sizes] + list(meshes)
    return [
        predict(
            params,
            s * r if stage == DDP else s,
            stage,
            strategy=strategy,
            master_dtype=master_dtype,
            state_dtype=state_dtype,
            bucket_numel=bucket_numel,
            algorithm=algorithm,
            replicas=r,
            comm_dtype=comm_dtype,
            master_remainders=master_remainders,
        )
        for r, s in worlds
        for stage, strategy in _rows(stages, strategies)
    ]


def _row(p: Prediction, parameters: int, mesh: bool = False) -> list[str]:
    top = p.max_rank()
    totals = max(r.total for r in p.ranks)
    cells = [getattr(top, c) for c in _COLUMNS[:-1]] + [totals]
    sent = p.traffic.sent(p.world_size)
    per = f"{totals / parameters:.3f}"
    row = [p.label, *map(format_bytes, cells), per, f"{p.imbalance:.3f}", format_bytes(sent)]
    if mesh:
        row.append("-" if p.stage == DDP else format_bytes(p.replica_sent))
    return row


def assumptions(algorithm: str, comm_dtype: str | None = None) -> list[str]:
    """The assumptions of the predictions, one line each."""
    calls = _CALLS[algorithm]
    lines = [a.format(calls=calls) for a in _ASSUMPTIONS]
    if comm_dtype is not None:
        lines.append(_WIRE.format(comm=comm_dtype))
    return lines


def render_table(
    title: str,
    predictions: Sequence[Prediction],
    algorithm: str,
    comm_dtype: str | None = None,
    *,
    parameters: int,
) -> str:
    """The predictions as text: one section per world size, one row per stage and strategy
    (``B/param``: the total over the model's ``parameters``)."""
    lines = [title]
    for a in assumptions(algorithm, comm_dtype):
        lines.extend(textwrap.wrap(a, 98, initial_indent="  ", subsequent_indent="    "))
    for replicas, ranks in dict.fromkeys(p.section for p in predictions):
        header = ["stage", *_COLUMNS, "B/param", "imbalance", "sent/step"]
        lines.append(f"\nworld size {ranks}")
        if replicas > 1:
            header[-1] = "sent/step in a shard group"
            header.append("sent/step to replicas")
            lines[-1] = (
                f"\nmesh {replicas}x{ranks}: {replicas} replicas of {ranks}-rank shard groups "
                f"({replicas * ranks} ranks; DDP: a ring over all of them)"
            )
        section = [p for p in predictions if p.section == (replicas, ranks)]
        rows = [header] + [_row(p, parameters, replicas > 1) for p in section]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for r in rows:
            cells = [r[0].ljust(widths[0])] + [c.rjust(n) for c, n in zip(r[1:], widths[1:])]
            lines.append("  ".join(cells))
    return "\n".join(lines)


def _as_json(
    source: str,
    params: Sequence[ParamSpec],
    predictions: Sequence[Prediction],
    algorithm: str,
    comm_dtype: str | None,
) -> Any:
    def entry(p: Prediction) -> dict[str, Any]:
        top = p.max_rank()
        return {
            "world_size": p.world_size,
            "replicas": p.replicas,
            "label": p.label,
            "stage": p.stage,
            "strategy": p.strategy,
            "max_rank_bytes": {c: getattr(top, c) for c in _COLUMNS[:-1]},
            "max_rank_total": max(r.total for r in p.ranks),
            "min_rank_total": min(r.total for r in p.ranks),
            "imbalance": p.imbalance,
            "traffic": {
                "all_reduce_bytes": p.traffic.all_reduce,
                "reduce_scatter_bytes": p.traffic.reduce_scatter,
                "all_gather_bytes": p.traffic.all_gather,
                "shardopt_collectives": p.traffic.collectives,
                "sent_per_rank": p.traffic.sent(p.world_size),
                "received_per_rank": p.traffic.sent(p.world_size),
                "sent_per_rank_to_replicas": p.replica_sent,
            },
        }

    return {
        "source": source,
        "parameters": sum(p.spec.numel for p in params),
        "trainable": sum(p.spec.numel for p in params if p.trainable),
        "tensors": len(params),
        "assumptions": assumptions(algorithm, comm_dtype),
        "results": [entry(p) for p in predictions],
    }


def run_plan(args: argparse.Namespace) -> int:
    """Runs ``shardopt plan`` with parsed ``args``; prints the table or the JSON."""
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    master = None if args.master_dtype is None else getattr(torch, args.master_dtype)
    state = None if args.state_dtype is None else getattr(torch, args.state_dtype)
    if args.bucket_numel < 0:
        raise ValueError(
            f"plan: expected --bucket-numel >= 0 (0: one bucket per group), got {args.bucket_numel}"
        )
    bucket = None if args.bucket_numel == 0 else args.bucket_numel
    comm = None if args.comm_dtype is None else getattr(torch, args.comm_dtype)
    params = load_params(args.source, dtype)
    if args.master_remainders:
        _check_remainders(args.master_dtype, params)
    predictions = plan_report(
        params,
        args.world_size,
        stages=args.stage,
        strategies=args.strategy,
        master_dtype=master,
        state_dtype=state,
        bucket_numel=bucket,
        algorithm=args.algorithm,
        meshes=args.mesh,
        comm_dtype=comm,
        master_remainders=args.master_remainders,
    )
    if args.json:
        data = _as_json(args.source, params, predictions, args.algorithm, args.comm_dtype)
        print(json.dumps(data, indent=2))
        return 0
    total = sum(p.spec.numel for p in params)
    print(
        render_table(
            _title(args, params), predictions, args.algorithm, args.comm_dtype, parameters=total
        )
    )
    return 0


def _check_remainders(master_dtype: str | None, params: Sequence[ParamSpec]) -> None:
    """--master-remainders needs float32 masters of bfloat16 parameters (as shard() does)."""
    if master_dtype != "float32":
        raise ValueError(
            "plan: expected --master-remainders with --master-dtype float32 (a remainder completes "
            f"a bfloat16 parameter to its float32 master), got --master-dtype {master_dtype}"
        )
    if not any(p.trainable and p.spec.dtype == "bfloat16" for p in params):
        found = ", ".join(sorted({p.spec.dtype for p in params if p.trainable}))
        raise ValueError(
            "plan: expected --master-remainders with bfloat16 parameters (e.g. --dtype bfloat16), "
            f"got {found}"
        )


def _title(args: argparse.Namespace, params: Sequence[ParamSpec]) -> str:
    """The table's title: the model, its dtypes and the options in force."""
    total = sum(p.spec.numel for p in params)
    trainable = sum(p.spec.numel for p in params if p.trainable)
    dtypes = ", ".join(sorted({p.spec.dtype for p in params}))
    return (
        f"{args.source}: {len(params)} tensors, {total:,} parameters ({trainable:,} trainable), "
        f"{dtypes}"
        + (f", {args.master_dtype} master weights" if args.master_dtype else "")
        + (" (bfloat16 ones as 16-bit remainders)" if args.master_remainders else "")
        + (f", {args.state_dtype} optimizer state (shardopt rows)" if args.state_dtype else "")
        + (f", {args.comm_dtype} gradients on the wire (shardopt rows)" if args.comm_dtype else "")
    )


def add_plan_parser(commands: Any) -> None:
    """Adds the ``plan`` subcommand to ``commands`` (an argparse subparsers object)."""
    p = commands.add_parser(
        "plan",
        help="per-rank memory and traffic of DDP and shardopt stages 1 and 2",
        description="Predicts, exactly and from shapes alone (the meta device), the bytes each "
        "rank holds and sends per step under DDP + AdamW and shardopt stages 1 and 2.",
    )
    p.add_argument(
        "source",
        help="a preset (gpt2-small, gpt2-xl, llama-7b, ...), a "
        "module:function factory, or a JSON file of shapes",
    )
    p.add_argument(
        "-w",
        "--world-size",
        type=int,
        nargs="+",
        default=[2, 8, 64],
        help=f"world sizes, up to {MAX_WORLD_SIZE} (default: 2 8 64)",
    )
    p.add_argument(
        "--mesh",
        type=_mesh,
        nargs="+",
        default=[],
        metavar="RxS",
        help="also hybrid sharding on an R x S mesh: R replicas of S-rank shard groups "
        "(shard(..., group=mesh) with dims ('replicate', 'shard'))",
    )
    p.add_argument(
        "--stage",
        type=int,
        nargs="+",
        choices=(0, 1, 2),
        default=[0, 1, 2],
        help="0 is DDP + torch.optim.AdamW (default: 0 1 2)",
    )
    p.add_argument(
        "--strategy",
        nargs="+",
        choices=("flat", "greedy"),
        default=["flat", "greedy"],
        help="plan strategies (default: both)",
    )
    _add_dtype_options(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run_plan)


def _mesh(text: str) -> tuple[int, int]:
    """``"8x16"`` -> (8, 16): replicas x shards."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected a mesh RxS of positive sizes, got {text!r}")
    return int(parts[0]), int(parts[1])


def _add_dtype_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=_DTYPES, help="cast floating parameters to this dtype")
    p.add_argument(
        "--master-dtype",
        choices=_DTYPES,
        help="master weights and optimizer state dtype for lower-precision params",
    )
    p.add_argument(
        "--state-dtype",
        choices=_DTYPES,
        help="optimizer state dtype of the shardopt rows (core's with_state_dtype), e.g. "
        "bfloat16 moments beside float32 parameters or masters",
    )
    p.add_argument(
        "--comm-dtype",
        choices=("float32", "bfloat16"),
        help="shard()'s comm_dtype for the shardopt rows: gradients staged and sent in this "
        "dtype, summed in float32 by their owner (default: none, their own or reduce dtype)",
    )
    p.add_argument(
        "--master-remainders",
        action="store_true",
        help="shard()'s master_remainders for the shardopt rows: with --dtype bfloat16 and "
        "--master-dtype float32, each owned master is its bfloat16 parameter plus a 16-bit "
        "remainder (2 bytes instead of 4)",
    )
    p.add_argument(
        "--bucket-numel",
        type=int,
        default=DEFAULT_BUCKET_NUMEL,
        help="elements of one bucket, all ranks together (bounds the staging buffers), as "
        f"plan_partition's; 0: one per group (default: {DEFAULT_BUCKET_NUMEL})",
    )
    p.add_argument(
        "--algorithm",
        choices=("collective", "exchange"),
        default="collective",
        help="shard()'s collectives: all-gathers and reduce-scatters, or broadcasts and "
        "reduces (its default for CPU tensors on gloo) (default: collective)",
    )
