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
    """Rank 1's loss (and so its gradients) is NaN from step 2 on; no layer's output overflows."""
    import datetime
    import json

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        amp = CollectiveAdaptiveMixedPrecision(model, opt, "params=float32,compute=float16,loss_scale=dynamic",
                                               read_every=50, progress=False)
        gen = torch.Generator().manual_seed(rank)
        for i in range(steps):
            with amp.autocast():
                loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).mean()
            if rank == 1 and i >= 2:
                loss = loss * float("nan")
            amp.backward(loss)
            amp.step()
            amp.zero_grad()
        history = [(s, str(p)) for s, p in amp.policy_history]
        decisions = [(e.step, e.kind) for e in amp.events if e.kind in ("promote", "switch_compute")]
        with open(out / f"rank{rank}.json", "w") as f:
            json.dump({"history": history, "decisions": decisions}, f)
    finally:
        dist.destroy_process_group()


def test_a_nan_loss_on_one_rank_is_decided_on_by_every_rank(tmp_path):
    """The per-step diagnosis asks whether the loss was finite when no layer is to blame: a per-rank value.
    Collectively, every rank must switch at the same step (alone, rank 1 switched and rank 0 then hung in
    the scaler's all-reduce)."""
    import json

    torch.multiprocessing.spawn(_nan_loss_on_one_rank, args=(tmp_path / "store", tmp_path, 8), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert [kind for _, kind in ranks[0]["decisions"]] == ["switch_compute"], ranks[0]
