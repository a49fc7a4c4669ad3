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
