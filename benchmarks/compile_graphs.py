"""How many graphs ``torch.compile`` makes of a forward with the parameter gathers in flight
(issue 24, item 2; see [Note: compiled forward] in shardopt.functional.engine._hooks).

Each case trains the same model on W=2 gloo ranks (127.0.0.1, a port the system picks) with
shardopt AdamW, stage 2, ``register_grad_hooks`` and ``register_param_hooks`` (as the demo wires
them): once eager, once through ``torch.compile(model, backend=<counting backend>)``, and once
compiled with the gradient hooks only (the reference: nothing to wait for in the forward). The
backend counts the graphs dynamo hands it and returns their ``forward`` (no C++ compiler
needed; backward stays eager); ``torch._dynamo.utils.counters["graph_break"]`` gives the
reasons of the breaks. Every forward after the first runs right after a ``step``, with the
gathers in flight: the case the forward pre-hooks wait in (``torch._dynamo.explain`` on an idle
forward would not show it).

Columns: the plan's buckets; the modules holding parameters; the graphs compiled in all and
after the first step; the graph breaks (reasons below the row); in the last forward, the graph
calls and the operations those graphs ran (fewer than the reference's: part of the forward ran
eagerly; more: the waits' own ops); the reference's graphs and operations; whether the
parameters after the last step are bitwise those of the eager run.

    PYTHONPATH=packages/core/src:packages/functional/src:packages/testing/src \\
        /tmp/integ/bin/python benchmarks/compile_graphs.py [--steps 4] [--models demo-gpt]

Cases: the demo GPT (``shardopt.testing.build_gpt``, the head tied to the embedding, blocks
called in a loop) and a tiny random-init HF GPT-2 (skipped without transformers), each with one
bucket and with smaller buckets.
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardopt.core import adamw, plan_partition
from shardopt.functional import register_grad_hooks, register_param_hooks, shard, wait_params
from shardopt.testing import build_gpt, spawn

VOCAB, LENGTH, BATCH = 256, 16, 4


def build(name: str) -> nn.Module:
    """The case's model, the same on every rank and in every run."""
    if name == "demo-gpt":
        return build_gpt(vocab=VOCAB, width=32, depth=2, length=LENGTH)
    import transformers

    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)


def logits_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


class CountingBackend:
    """A dynamo backend that counts the graphs it gets and runs them as traced; while
    ``measuring``, it also counts the graph calls and the operations they run."""

    def __init__(self) -> None:
        self.graphs = 0
        self.measuring = False
        self.calls = 0
        self.ops = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        del example_inputs
        self.graphs += 1
        ops = sum(n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes)

        def run(*args: Any) -> Any:
            if self.measuring:
                self.calls += 1
                self.ops += ops
            return gm.forward(*args)

        return run


def batch(gen: torch.Generator, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the next global batch: tokens and their next tokens."""
    tokens = torch.randint(VOCAB, (BATCH * world, LENGTH + 1), generator=gen)
    rows = tokens[rank * BATCH : (rank + 1) * BATCH]
    return rows[:, :-1], rows[:, 1:]


def train(
    rank: int, world: int, name: str, bucket: int | None, steps: int, mode: str
) -> dict[str, Any]:
    """``steps`` training steps, ``mode`` eager, compiled or compiled with the gradient hooks
    only; returns the final parameters, losses and the graph counts."""
    model = build(name)
    params = list(model.parameters())
    plan = plan_partition(params, world, bucket_numel=bucket)
    sharded = shard(adamw(3e-3, weight_decay=0.01), plan, stage=2)
    state = sharded.init(params)
    grad_hooks = register_grad_hooks(params, state)
    param_hooks = register_param_hooks(model, state) if mode != "grad hooks only" else None
    backend = CountingBackend()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    net = model if mode == "eager" else torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(1)
    losses, first = [], 0
    for step in range(steps):
        x, y = batch(gen, rank, world)
        backend.measuring = step == steps - 1  # a forward with the gathers in flight
        loss = F.cross_entropy(logits_of(net(x)).flatten(0, 1), y.reshape(-1))
        backend.measuring = False
        loss.backward()
        state = sharded.step(params, None, state)  # leaves the gathers in flight
        losses.append(loss.item())
        if step == 0:
            first = backend.graphs
    wait_params(state)
    if param_hooks is not None:
        param_hooks.remove()
    grad_hooks.remove()
    modules = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    return {
        "params": [p.detach().clone() for p in params],
        "losses": losses,
        "graphs": backend.graphs,
        "graphs_after_step": backend.graphs - first,
        "calls": backend.calls,
        "ops": backend.ops,
        "breaks": breaks,
        "buckets": len(state.param_buffers.keys),
        "modules": modules,
    }


def case(rank: int, world: int, name: str, bucket: int | None, steps: int) -> dict[str, Any]:
    eager = train(rank, world, name, bucket, steps, "eager")
    comp = train(rank, world, name, bucket, steps, "compiled")
    ref = train(rank, world, name, bucket, steps, "grad hooks only")
    same = all(torch.equal(a, b) for a, b in zip(eager["params"], comp["params"]))
    return {
        "ref_graphs": ref["graphs"],
        "ref_ops": ref["ops"],
        "calls": comp["calls"],
        "ops": comp["ops"],
        "buckets": comp["buckets"],
        "modules": comp["modules"],
        "graphs": comp["graphs"],
        "graphs_after_step": comp["graphs_after_step"],
        "breaks": comp["breaks"],
        "bitwise": same,
        "loss_eager": eager["losses"][-1],
        "loss_compiled": comp["losses"][-1],
    }


def _short(reason: str) -> str:
    return " ".join(reason.split())[:110]


CASES: dict[str, list[int | None]] = {
    "demo-gpt": [None, 8192, 2048],
    "hf-gpt2": [None, 32768, 8192],
}
COLUMNS = (
    ("model", 8, "name"),
    ("bucket", 7, "bucket"),
    ("buckets", 7, "buckets"),
    ("modules", 7, "modules"),
    ("graphs", 6, "graphs"),
    ("after 1st", 9, "graphs_after_step"),
    ("breaks", 6, "n_breaks"),
    ("calls/fwd", 9, "calls"),
    ("ops/fwd", 7, "ops"),
    ("ref graphs", 10, "ref_graphs"),
    ("ref ops", 7, "ref_ops"),
    ("bitwise", 7, "bitwise"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    models = list(args.models)
    if "hf-gpt2" in models:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers not installed: the HF GPT-2 cases are skipped")
            models.remove("hf-gpt2")
    print(f"torch {torch.__version__}, W=2 gloo, stage 2, both hooks, {args.steps} steps")
    print(" ".join(f"{title:>{width}}" for title, width, _ in COLUMNS))
    for name in models:
        for bucket in CASES[name]:
            row = spawn(
                case, 2, name, bucket, args.steps, backend="gloo", init_store="tcp", timeout=300.0
            )[0]
            row |= {"name": name, "bucket": bucket or "default"}
            row["n_breaks"] = sum(row["breaks"].values())
            print(" ".join(f"{row[key]!s:>{width}}" for _, width, key in COLUMNS))
            reasons = collections.Counter({_short(k): v for k, v in row["breaks"].items()})
            for reason, count in reasons.most_common():
                print(f"    {count:>3} x {reason}")


if __name__ == "__main__":
    main()
