"""ZeroRedundancyOptimizer's API as torch's own test suite exercises it, on one and two ranks."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable

from shardopt.optim import ZeroRedundancyOptimizer
from shardopt.testing import World
from shardopt.testing._candidates import zero_redundancy_optimizer_class

LR = 0.01


def three_linears() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(5, 10), torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)
    )


@pytest.mark.world(1, backend="gloo", timeout=60)
def test_constructor_accepts_what_torch_accepts_and_rejects_the_rest(world: World) -> None:
    torch.manual_seed(0)
    m = three_linears()
    table: list[tuple[Any, type[Exception] | None]] = [
        ([], ValueError),
        (torch.randn(1), TypeError),
        (1.2, TypeError),
        (
            [{"params": [layer.weight for layer in m]}, {"params": [layer.bias for layer in m]}],
            None,
        ),
        ([*m.parameters(), 42], TypeError),
        (m.parameters(), None),
        (list(m.parameters()), None),
    ]
    for params, error in table:
        expect = pytest.raises(error) if error else contextlib.nullcontext()
        with expect:
            ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=LR)
    groups = [
        {"params": [layer.weight for layer in m], "weight_decay": 0.0},
        {"params": [layer.bias for layer in m], "weight_decay": 0.01},
    ]
    o = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    assert len(o.param_groups) == 2
    assert len(o.optim.param_groups) == 2
    assert isinstance(o, torch.optim.Optimizer)
    assert isinstance(o, Joinable)
    assert isinstance(o.optim, torch.optim.AdamW)


def sparse() -> torch.Tensor:
    return torch.sparse_coo_tensor(
        torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0), size=(2, 3), check_invariants=True
    )


@pytest.mark.world(1, backend="gloo", timeout=60)
def test_sparse_or_mixed_dtype_parameters_are_value_errors(world: World) -> None:
    for params, match in (
        ([sparse()], "dense"),
        ([torch.zeros(1), torch.zeros(1, dtype=torch.float64)], "one dtype"),
        ([torch.zeros(1), torch.zeros(1), sparse()], "dense"),
    ):
        with pytest.raises(ValueError, match=rf"ZeroRedundancyOptimizer: expected .*{match}"):
            ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)


@pytest.mark.world(1, backend="gloo", timeout=60)
def test_state_dict_has_torch_keys_and_reloads_with_its_hyperparameters(world: World) -> None:
    x = torch.tensor([1.0], requires_grad=True)
    o = ZeroRedundancyOptimizer([x], optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    x.backward()
    o.step()
    assert torch.equal(x.detach(), torch.tensor([0.9]))
    assert torch.equal(o.optim.state[x]["momentum_buffer"], torch.tensor([1.0]))
    o.zero_grad()
    o.consolidate_state_dict(to=0)
    sd = o.state_dict()
    assert set(sd) == {"state", "param_groups"}
    group = sd["param_groups"][0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.1, 0.9, False)
    assert (group["weight_decay"], group["dampening"]) == (0.0, 0.0)
    assert all(group[k] == o.param_groups[0][k] for k in group if k != "params")
    o = ZeroRedundancyOptimizer([x], optimizer_class=torch.optim.SGD, lr=0.01)
    o.load_state_dict(sd)
    assert torch.equal(o.optim.state[x]["momentum_buffer"], torch.tensor([1.0]))
    assert o.param_groups[0]["lr"] == 0.1
    x.backward()
    o.step()
    torch.testing.assert_close(x.detach(), torch.tensor([0.71]))
    torch.testing.assert_close(o.optim.state[x]["momentum_buffer"], torch.tensor([1.9]))
    assert o.param_groups[0]["params"][0].device == x.device


@pytest.mark.world(1, backend="gloo", timeout=60)
def test_an_lr_scheduler_drives_zero_as_it_drives_torch_optim(world: World) -> None:
    x = torch.tensor([1.0], requires_grad=True)
    x2 = torch.tensor([1.0], requires_grad=True)
    o = ZeroRedundancyOptimizer([x], optimizer_class=torch.optim.SGD, lr=LR)
    o2 = torch.optim.SGD([x2], lr=LR)
    s = torch.optim.lr_scheduler.StepLR(o, 1)
    s2 = torch.optim.lr_scheduler.StepLR(o2, 1)
    for _ in range(5):
        for t, opt, sched in ((x, o, s), (x2, o2, s2)):
            t.backward()
            opt.zero_grad()
            opt.step()
            sched.step()
        assert torch.equal(x, x2)
    assert o.param_groups[0]["lr"] == o2.param_groups[0]["lr"]


class SGDWithStepKwarg(torch.optim.SGD):
    def step(self, closure: Any = None, kwarg: list[int] | None = None) -> None:  # type: ignore[override]
        super().step()
        assert kwarg is not None
        kwarg.append(5)


class SGDWithNewKey(torch.optim.SGD):
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        super().step()
        self.param_groups[0]["new_key"] = 0.1


class SGDWithoutClosure(torch.optim.SGD):
    def step(self) -> None:  # type: ignore[override]
        super().step()


@pytest.mark.world(1, backend="gloo", timeout=60)
def test_user_defined_local_optimizers_get_torch_s_step_calls(world: World) -> None:
    """Extra step kwargs pass through, the closure argument as given (even 0), new group keys
    come back to zero.param_groups, and a step without a closure parameter is called without."""
    x = torch.tensor([1.0], requires_grad=True)
    o = ZeroRedundancyOptimizer([x], optimizer_class=SGDWithStepKwarg, lr=0.1)
    x.backward()
    kwarg: list[int] = []
    o.step(0, kwarg=kwarg)
    assert kwarg == [5]
    torch.testing.assert_close(x.detach(), torch.tensor([0.9]))
    for cls in (SGDWithNewKey, SGDWithoutClosure):
        x = torch.tensor([1.0], requires_grad=True)
        o = ZeroRedundancyOptimizer([x], optimizer_class=cls, lr=0.1)
        x.backward()
        o.step()
        torch.testing.assert_close(x.detach(), torch.tensor([0.9]))
    assert o.param_groups[0].get("new_key") is None
    x = torch.tensor([1.0], requires_grad=True)
    o = ZeroRedundancyOptimizer([x], optimizer_class=SGDWithNewKey, lr=0.1)
    x.backward()
    o.step()
    assert o.param_groups[0]["new_key"] == 0.1


@pytest.mark.world(1, backend="gloo", timeout=60)
def test_zero_grad_sets_every_gradient_to_none(world: World) -> None:
    m = torch.nn.Linear(1, 1)
    o = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.SGD, lr=LR)
    m(torch.rand(1)).backward()
    assert m.weight.grad is not None
    assert m.bias.grad is not None
    o.zero_grad()
    assert m.weight.grad is None
    assert m.bias.grad is None


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_step_matches_sgd_on_averaged_gradients_and_closures_return_the_loss(world: World) -> None:
    x = torch.tensor([float(world.rank + 1)])
    m = torch.nn.Linear(1, 1)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.0]]))
        m.bias.copy_(torch.tensor([2.0]))
    m_zero = copy.deepcopy(m)
    o = torch.optim.SGD(m.parameters(), lr=LR)
    o_zero = ZeroRedundancyOptimizer(m_zero.parameters(), optimizer_class=torch.optim.SGD, lr=LR)
    for model, opt in ((m, o), (m_zero, o_zero)):
        model(x).backward(x)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world.world_size
        opt.step()
    assert torch.equal(m.weight, m_zero.weight)
    assert torch.equal(m.bias, m_zero.bias)
    # torch's closure test: one step of SGD(lr=0.1) on |y - target| from known values
    target = torch.tensor([[5.0]])
    m_zero = torch.nn.Linear(1, 1)
    with torch.no_grad():
        m_zero.weight.copy_(torch.tensor([[1.1]])).sub_(0.1)
        m_zero.bias.copy_(torch.tensor([2.0]))
    o_zero = ZeroRedundancyOptimizer(m_zero.parameters(), torch.optim.SGD, lr=0.1)

    def closure() -> torch.Tensor:
        o_zero.zero_grad()
        loss = torch.nn.functional.l1_loss(m_zero(torch.tensor([[1.0]])), target)
        loss.backward()
        return loss

    loss = o_zero.step(closure=closure)
    assert loss == torch.tensor(2.0)
    torch.testing.assert_close(m_zero.weight.detach(), torch.tensor([[1.1]]))
    torch.testing.assert_close(m_zero.bias.detach(), torch.tensor([2.1]))


@pytest.mark.parametrize("partition", ["greedy", "flat"])
@pytest.mark.world(2, backend="gloo", timeout=60)
def test_sharding_gives_each_rank_its_share_at_construction(world: World, partition: str) -> None:
    sizes = [9, 7, 5, 3]
    params = [torch.rand(size, 1) for size in sizes * world.world_size]
    o = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=LR, partition=partition)
    mine = sum(p.numel() for p in o.optim.param_groups[0]["params"])
    if partition == "greedy":
        assert mine == sum(sizes)
    else:  # equal slices of 16-element aligned size: 32 + 16 for the 48 elements here
        assert mine == (32 if world.rank == 0 else 16)


@pytest.mark.parametrize("partition", ["greedy", "flat"])
@pytest.mark.world(2, backend="gloo", timeout=60)
def test_a_generator_inside_a_param_group_keeps_every_parameter(
    world: World, partition: str
) -> None:
    """torch's own class loses the first group's parameters here (it reads the generator twice);
    every parameter must be in a group, owned by a rank, and stepped."""
    torch.manual_seed(0)
    m = three_linears()
    groups = [{"params": m[0].parameters()}, {"params": list(m[1].parameters())}]
    o = ZeroRedundancyOptimizer(groups, torch.optim.SGD, lr=LR, partition=partition)
    assert [len(g["params"]) for g in o.param_groups] == [2, 2]
    before = [p.detach().clone() for p in m[0].parameters()]
    m(torch.ones(2, 5)).sum().backward()
    o.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, m[0].parameters()))
    assert set(o._param_to_rank) == set(m[0].parameters()) | set(m[1].parameters())


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_add_param_group_repartitions_over_every_rank(world: World) -> None:
    sizes = [9, 7, 5, 3]
    params = [torch.rand(size, 1, requires_grad=True) for size in (sizes * 2)[:-1]]
    o = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=LR)
    o.add_param_group({"params": [torch.rand(3, 1)]})
    assert len(o.param_groups) == 2
    assert len(o.optim.param_groups) == 2
    mine = sum(x.numel() for g in o.optim.param_groups for x in g["params"])
    assert mine == sum(sizes)
    assert len(o._all_params) == len(params) + 1
    # a first big frozen parameter, then trainable ones
    params = [torch.rand(size, 1) for size in (100, 3, 5, 2, 6, 4)]
    for p in params[1:]:
        p.requires_grad = True
    o = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=LR)
    o.add_param_group({"params": [torch.rand(3, 1)]})
    assert len(o.param_groups) == 2
    assert len(o.optim.param_groups) == 2


@pytest.mark.parametrize("partition", ["greedy", "flat"])
@pytest.mark.world(2, backend="gloo", timeout=60)
def test_attributes_are_torch_s(world: World, partition: str) -> None:
    torch.manual_seed(0)
    model = three_linears()
    theirs = zero_redundancy_optimizer_class()(list(model.parameters()), torch.optim.Adam, lr=LR)
    ours = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=LR, partition=partition)
    assert (ours.world_size, ours.rank, ours.global_rank) == (2, world.rank, world.rank)
    assert ours.process_group is dist.group.WORLD
    assert ours.parameters_as_bucket_view is False
    assert ours._all_params == theirs._all_params
    assert ours._index_to_param == theirs._index_to_param
    assert ours._param_to_index == theirs._param_to_index
    assert ours.join_device == torch.device("cpu")
    assert ours.join_process_group is dist.group.WORLD
    assert ours.param_groups[0].keys() == theirs.param_groups[0].keys()
    if partition == "greedy":
        assert ours._param_to_rank == theirs._param_to_rank
        assert [[g["params"] for g in r] for r in ours._partition_parameters()] == [
            [g["params"] for g in r] for r in theirs._partition_parameters()
        ]
        assert ours.optim.param_groups[0]["params"] == theirs.optim.param_groups[0]["params"]
    else:
        elements = sum(p.numel() for p in ours.optim.param_groups[0]["params"])
        total = sum(p.numel() for p in model.parameters())
        assert abs(elements - total / 2) <= 16  # the flat slices are aligned to 16 elements


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_state_dict_answers_alone_while_empty_and_raises_where_not_consolidated(
    world: World,
) -> None:
    model = three_linears()
    o = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
    assert o.state_dict()["state"] == {}  # never stepped: nothing to gather, on any rank alone
    o.load_state_dict(o.state_dict())  # what accelerate does when it wraps the optimizer
    assert o.state_dict()["state"] == {}
    made = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adagrad, lr=LR)
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to=\d\)"):
        made.state_dict()  # Adagrad makes its state at construction: it must be gathered
    model(torch.ones(2, 5)).sum().backward()
    o.step()
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to=\d\)"):
        o.state_dict()
    o.consolidate_state_dict(to=1)
    if world.rank == 1:
        assert len(o.state_dict()["state"]) == 6
    else:
        with pytest.raises(RuntimeError, match=r"state consolidated on this rank"):
            o.state_dict()
    with pytest.raises(ValueError, match=r"expected 0 <= to < world_size=2, got 2"):
        o.consolidate_state_dict(to=2)


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_consolidate_for_saving_gathers_on_the_saving_rank_and_refuses_use_elsewhere(
    world: World,
) -> None:
    model = three_linears()
    o = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=LR, partition="flat")
    model(torch.ones(2, 5)).sum().backward()
    o.step()
    o.consolidate_for_saving(saving=world.rank == 0)
    out = o.state_dict()  # every rank answers, as accelerate's save_state asks
    if world.rank == 0:
        assert sorted(out["state"]) == list(range(6))
    else:
        with pytest.raises(RuntimeError, match=r"on group rank\(s\) \[0\] only"):
            torch.save(out, io.BytesIO())  # the placeholder refuses to be saved or read
        with pytest.raises(RuntimeError, match=r"got rank 1"):
            len(out["state"])
    o.step()
    if world.rank == 1:
        with pytest.raises(RuntimeError, match=r"state consolidated on this rank"):
            o.state_dict()


def check_sync(model: torch.nn.Module, group: Any, ranks: list[int]) -> None:
    for p in model.parameters():
        gathered = [torch.empty_like(p) for _ in ranks]
        dist.all_gather(gathered, p.detach(), group=group)
        assert all(torch.equal(gathered[0], q) for q in gathered[1:])


@pytest.mark.world(3, backend="gloo", timeout=90)
def test_a_subgroup_of_even_ranks_trains_and_keeps_its_replicas_equal(world: World) -> None:
    ranks = [r for r in range(world.world_size) if r % 2 == 0]
    group = dist.new_group(ranks=ranks)
    if world.rank not in ranks:
        return
    torch.manual_seed(world.rank)  # different initial weights: the sync makes them equal
    for view in (False, True):
        model = torch.nn.Sequential(torch.nn.Linear(20, 10), torch.nn.Linear(10, 5))
        o = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.SGD,
            lr=1e-3,
            process_group=group,
            parameters_as_bucket_view=view,
        )
        assert o.rank == ranks.index(world.rank)
        assert o.world_size == len(ranks)
        for _ in range(3):
            inputs, target = torch.rand(3, 20), torch.rand(3, 5)

            def closure(
                o: Any = o, model: Any = model, inputs: Any = inputs, t: Any = target
            ) -> Any:
                o.zero_grad()
                loss = torch.nn.functional.l1_loss(model(inputs), t)
                loss.backward()
                return loss

            o.step(closure=closure)
            check_sync(model, group, ranks)


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_overlap_with_ddp_step_only_warns_once_and_hooks_get_the_contract(world: World) -> None:
    torch.manual_seed(0)
    model = three_linears()
    before = [p.detach().clone() for p in model.parameters()]
    o = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.5, overlap_with_ddp=True)
    model(torch.ones(2, 5)).sum().backward()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("shardopt.optim.zero._optimizer").addHandler(handler)
    assert o.step() is None
    assert o.step() is None
    assert len([r for r in records if "overlap_with_ddp" in r.getMessage()]) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    params = list(model.parameters())
    o._step_params(params[:2])  # only the owned ones among these two change
    for i, (p, b) in enumerate(zip(params, before)):
        owned_and_stepped = i < 2 and o._param_to_rank[p] == world.rank
        assert torch.equal(p, b) != owned_and_stepped
    for handle in o._sync_params_of(params[:2], async_op=True):
        handle.wait()
    check_sync(model, None, [0, 1])
    with pytest.raises(RuntimeError, match=r"add_param_group: expected a single parameter group"):
        o.add_param_group({"params": [torch.zeros(2)]})


@pytest.mark.parametrize(("partition", "view"), [("greedy", True), ("flat", False), ("flat", True)])
@pytest.mark.world(2, backend="gloo", timeout=120)
def test_param_hooks_defer_the_sync_to_the_next_forward_and_train_like_torch(
    world: World, partition: str, view: bool
) -> None:
    """Behind DDP, with the parameter sync left in flight after each step and waited for by the
    forward pre-hooks (small buckets: several per step), training matches torch.optim.Adam on
    the full batch; the parameters read after wait_params are the updated ones."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.Adam,
        lr=LR,
        parameters_as_bucket_view=view,
        partition=partition,
    )
    for buffers in zero._view_buffers():  # several buckets would need a smaller plan; one suffices
        assert buffers.deferred == 0
    hooks = zero.register_param_hooks(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        zero.zero_grad()
        ddp(x[world.rank * 4 : (world.rank + 1) * 4]).pow(2).mean().backward()
        zero.step()
        assert any(b.params_pending for b in zero._view_buffers())  # left in flight
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    zero.wait_params()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for h in hooks:
        h.remove()
    assert not any(b.deferred for b in zero._view_buffers())


@pytest.mark.world(1, backend="gloo", timeout=60)
def test_param_hooks_need_the_parameters_in_the_flat_buffers(world: World) -> None:
    model = three_linears()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=LR)
    with pytest.raises(ValueError, match=r"register_param_hooks: expected parameters_as_bucket"):
        zero.register_param_hooks(model)


def three_steps(model: torch.nn.Module, opt: ZeroRedundancyOptimizer) -> list[torch.Tensor]:
    for step in range(3):
        model(torch.full((2, 5), float(step + 1))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("options", [{"partition": "flat"}, {"parameters_as_bucket_view": True}])
@pytest.mark.world(2, backend="gloo", timeout=60)
def test_a_same_device_move_of_the_model_keeps_the_parameters_in_the_buffers(
    world: World, options: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    model, moved = three_linears(), three_linears()
    moved.load_state_dict(model.state_dict())
    expected = three_steps(
        model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=LR, **options)
    )
    opt = ZeroRedundancyOptimizer(moved.parameters(), torch.optim.Adam, lr=LR, **options)
    moved.to(torch.device("cpu", 0))  # HF Trainer's device on CPU: it copies every parameter
    assert all(torch.equal(a, b) for a, b in zip(three_steps(moved, opt), expected))


@pytest.mark.world(1, backend="gloo", timeout=60)
def test_load_state_dict_refuses_state_keys_that_are_not_param_ids(world: World) -> None:
    model = three_linears()
    o = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
    model(torch.ones(2, 5)).sum().backward()
    o.step()
    o.consolidate_state_dict(to=0)
    saved = o.state_dict()
    saved["state"] = {str(k): v for k, v in saved["state"].items()}  # as after a DCP round trip
    with pytest.raises(ValueError, match=r"expected the keys of state to be the ids"):
        o.load_state_dict(saved)
