"""adaptive_amp.distributed in one process (the two-process behaviour: test_multi_gpu_integrations_script.py)."""

from __future__ import annotations

import pytest
import torch

from adaptive_amp.distributed import CollectiveAdaptiveMixedPrecision, agree_on_layers, world_group

dist = torch.distributed
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_agree_on_layers_keeps_candidate_order(one_rank_group):
    candidates = ["a", "b.c", "d"]
    assert agree_on_layers(["d", "a"], candidates, one_rank_group) == ["a", "d"]
    assert agree_on_layers([], candidates, one_rank_group) == []


def test_agree_on_layers_refuses_an_unknown_layer(one_rank_group):
    with pytest.raises(ValueError, match=r"\['x'\] are not among the model's candidate layers"):
        agree_on_layers(["x"], ["a"], one_rank_group)


def test_one_rank_is_not_distributed(one_rank_group):
    assert world_group() is None  # a single rank needs no collective controller


def test_collective_controller_needs_a_group():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        CollectiveAdaptiveMixedPrecision(model, opt, "params=float32,compute=float32")


def test_collective_controller_gives_its_scalers_the_group(one_rank_group):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = CollectiveAdaptiveMixedPrecision(model, opt, "params=float32,compute=float16,loss_scale=dynamic",
                                           process_group=one_rank_group, progress=False)
    assert amp.process_group is one_rank_group
    assert amp._scaler_kwargs["process_group"] is one_rank_group  # kept for the scalers made after a switch


def _nan_loss_on_one_rank(rank, store, out, steps):
    """FSDP2 over two gloo ranks. Rank 1's loss (and so every gradient) is NaN at steps 2-4; no layer's
    output overflows. After the switch torch clips (no scaler): its total norm is a DTensor."""
    import datetime
    import json

    from torch.distributed.fsdp import fully_shard

    from adaptive_amp.bench._dist_exit import finish

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        amp = CollectiveAdaptiveMixedPrecision(model, opt, "params=float32,compute=float16,loss_scale=dynamic",
                                               read_every=50, progress=False)
        gen = torch.Generator().manual_seed(rank)
        norms, stepped = {}, []
        for i in range(steps):
            with amp.autocast():
                loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).mean()
            if rank == 1 and 2 <= i <= 4:
                loss = loss * float("nan")
            if rank == 1 and i == steps - 1:  # without the scaler, a NaN the gradients do not see
                loss = loss + float("nan")
            amp.backward(loss)
            if not amp.scaler.is_enabled():  # the global norm, gathered by hand
                norms[i] = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor().item()
            stepped.append(bool(amp.step(max_grad_norm=100.0)))
            amp.zero_grad()
        amp.monitor.read()
        history = amp.monitor.history()
        recorded = dict(zip(history["step"], history["grad_norm"]))
        policies = [(s, str(p)) for s, p in amp.policy_history]
        decisions = [(e.step, e.kind) for e in amp.events if e.kind in ("promote", "switch_compute")]
        with open(out / f"rank{rank}.json", "w") as f:
            json.dump({"history": policies, "decisions": decisions, "norms": norms, "stepped": stepped,
                       "recorded": {str(s): recorded[s] for s in norms}}, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    # Both ranks leave together, and not through the interpreter's shutdown: a gloo worker still releasing
    # a collective's tensors then aborts the process (SIGABRT; adaptive_amp/bench/_dist_exit.py says why).
    finish(0)


def test_a_nan_loss_on_one_rank_is_decided_on_by_every_rank(tmp_path):
    """The per-step diagnosis asks whether the loss was finite when no layer is to blame: a per-rank value.
    Collectively, every rank must switch at the same step (alone, rank 1 switched and rank 0 then hung in
    the scaler's all-reduce). Then, under FSDP2 without a scaler, the monitor records torch's clip norm (a
    DTensor) as the global norm on every rank (it raised mixing DTensors with tensors)."""
    import json

    torch.multiprocessing.spawn(_nan_loss_on_one_rank, args=(tmp_path / "store", tmp_path, 8), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert [kind for _, kind in ranks[0]["decisions"]] == ["switch_compute"], ranks[0]
    assert ranks[0]["norms"], "no step ran without the scaler"
    assert ranks[0]["stepped"][-1] is False  # rank 1's NaN loss skipped the last step on both ranks
    for step, norm in ranks[0]["norms"].items():
        assert ranks[0]["recorded"][step] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("cls", ["AdamW", "SGD"])
def test_fused_optimizers_refuse_dtensor_parameters_by_name(one_rank_group, cls):
    """FSDP2 (and Accelerate's FSDP2, which swaps the optimizer's parameters for the sharded ones) hands the
    optimizer DTensors, which the fused step cannot take: a clear error naming the parameter (it was
    'exp_avgs[0]: is not one of the state values the plan watches'), and nothing changed."""
    from torch.distributed.fsdp import fully_shard

    from adaptive_amp import optim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(model)
    opt = getattr(optim, cls)(model.parameters(), lr=0.1, **({"momentum": 0.9} if cls == "SGD" else {}))
    model(torch.ones(2, 4)).sum().backward()
    before = [p.detach().to_local().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"params\[0\] is a DTensor .*use a torch.optim optimizer"):
        opt.step()
    assert all(torch.equal(p.detach().to_local(), b) for p, b in zip(model.parameters(), before))
    assert not opt.state
