"""Item c: shard (stages 1 and 2, flat and greedy plans, both overlaps) and the drop-in (both
partitions) training a small GPT beside torch.optim.AdamW(fused=True); checkpoints from its
state."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from shardopt.devtools.gpu_check._report import Item, Status, failed_item
from shardopt.devtools.gpu_check._variants import (
    Trainer,
    device_batch,
    drop_in,
    max_rel_error,
    rel_error,
    shard_trainer,
    torch_adamw,
)

__all__ = ["STEPS", "TOLERANCE", "check_checkpoints", "check_training", "gpt_problem", "train"]

STEPS = 5
# float32 GPT, 5 AdamW steps at lr 1e-3 against torch's own fused AdamW: the same kernel on the
# same gradients up to the order of cuBLAS/atomic reductions in backward (a few float32 roundings
# of a gradient change an Adam update by about as much relative), so 1e-5 of each tensor's largest
# value is a 10x margin; a stale parameter or a missed gradient is off by ~lr = 1e-3.
TOLERANCE = 1e-5


def gpt_problem() -> Any:
    """shardopt.testing's reference GPT problem, in float32."""
    from shardopt.testing import reference_problem

    return reference_problem("gpt", dtype=torch.float32)


def train(trainers: list[Trainer], problem: Any, device: torch.device, steps: int) -> None:
    """``steps`` iterations of every trainer on the same batches, then waits for their
    parameters."""
    for step in range(steps):
        batch = device_batch(problem.data(step), device)
        for t in trainers:
            t.backward(batch)
            t.step()
    for t in trainers:
        t.settle()


def _variants() -> list[tuple[str, Callable[..., Trainer]]]:
    out: list[tuple[str, Callable[..., Trainer]]] = []
    for stage in (1, 2):
        for strategy in ("flat", "greedy"):
            name = f"c/shard stage {stage} {strategy} + both overlaps"
            out.append((name, _shard_maker(stage, strategy)))
    for partition in ("greedy", "flat"):
        out.append((f"c/drop-in partition={partition}", _drop_in_maker(partition)))
    return out


def _shard_maker(stage: int, strategy: str) -> Callable[..., Trainer]:
    def make(model: Any, device: torch.device, loss: Any) -> Trainer:
        # small buckets, so that the GPT's parameters span several and the hooks interleave
        return shard_trainer(model, device, loss, stage=stage, strategy=strategy, bucket_numel=8192)

    return make


def _drop_in_maker(partition: str) -> Callable[..., Trainer]:
    def make(model: Any, device: torch.device, loss: Any) -> Trainer:
        return drop_in(model, device, loss, partition)

    return make


def _compare(name: str, ours: Trainer, ref: Trainer, initial: list[torch.Tensor]) -> Item:
    err = max_rel_error(ours.params, ref.params)
    moved = max_rel_error([p.to(initial[0].device) for p in ref.params], initial)
    figures = {"steps": STEPS, "param_rel_error": err, "tolerance": TOLERANCE, "moved": moved}
    if moved == 0:  # nothing trained: a zero error would say nothing
        return Item(name, Status.FAIL, "torch's parameters did not move", figures)
    if err <= TOLERANCE:
        return Item(name, Status.PASS, f"parameters within {TOLERANCE:g} of torch's", figures)
    return Item(name, Status.FAIL, f"param_rel_error {err:.3g} > {TOLERANCE:g}", figures)


def check_training(device: torch.device) -> list[Item]:
    """Every variant trains the GPT for STEPS steps beside torch.optim.AdamW(fused=True)."""
    problem = gpt_problem()
    model = problem.model()
    initial = [p.detach().clone() for p in model.parameters()]
    items = []
    for name, make in _variants():
        ours = None
        try:
            ref = torch_adamw(model, device, problem.loss)
            ours = make(model, device, problem.loss)
            train([ref, ours], problem, device, STEPS)
            items.append(_compare(name, ours, ref, initial))
        except Exception as exc:
            items.append(failed_item(name, exc))
        finally:
            if ours is not None:
                ours.close()
    return items


def _state_error(ours: dict[str, Any], ref: dict[str, Any]) -> float:
    """Worst relative error over the tensors both torch.optim state dicts hold."""
    errors = [
        rel_error(value, ref["state"][index][key])
        for index, entry in ours["state"].items()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor) and key in ref["state"].get(index, {})
    ]
    return max(errors, default=float("nan"))


def _bitwise(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(v, b["state"][i][k])
        for i, entry in a["state"].items()
        for k, v in entry.items()
    )


def check_checkpoints(device: torch.device) -> list[Item]:
    """consolidate_state_dict of a trained stage 2 state against torch's state dict, then
    save_checkpoint / load_checkpoint into a fresh state: the consolidated states bitwise equal."""
    from shardopt.functional import consolidate_state_dict

    problem = gpt_problem()
    ref = torch_adamw(problem.model(), device, problem.loss)
    ours = shard_trainer(problem.model(), device, problem.loss, stage=2, strategy="flat")
    items = []
    try:
        train([ref, ours], problem, device, STEPS)
        full = consolidate_state_dict(ours.state)
        assert full is not None  # rank 0 of a world of 1
        err = _state_error(full, ref.opt.state_dict())
        figures = {"state_rel_error": err, "tolerance": TOLERANCE, "entries": len(full["state"])}
        ok = err <= TOLERANCE
        reason = f"state within {TOLERANCE:g} of torch's" if ok else f"state_rel_error {err:.3g}"
        status = Status.PASS if ok else Status.FAIL
        items.append(Item("c/consolidate_state_dict", status, reason, figures))
    except Exception as exc:
        items.append(failed_item("c/consolidate_state_dict", exc))
    items.append(_round_trip(ours, problem, device))
    ours.close()
    return items


def _round_trip(ours: Trainer, problem: Any, device: torch.device) -> Item:
    from shardopt.functional import consolidate_state_dict, load_checkpoint, save_checkpoint

    name = "c/save_checkpoint + load_checkpoint"
    fresh = shard_trainer(problem.model(), device, problem.loss, stage=2, strategy="flat")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "checkpoint")
            save_checkpoint(ours.state, path)
            load_checkpoint(fresh.state, path)
        before, after = consolidate_state_dict(ours.state), consolidate_state_dict(fresh.state)
        assert before is not None
        assert after is not None
        same = _bitwise(before, after)
        figures = {"entries": len(after["state"]), "bitwise_equal": same}
        if same:
            return Item(name, Status.PASS, "the loaded state equals the saved one bitwise", figures)
        return Item(name, Status.FAIL, "the loaded state differs from the saved one", figures)
    except Exception as exc:
        return failed_item(name, exc)
    finally:
        fresh.close()
