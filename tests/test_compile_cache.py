"""What inductor compiled and loaded from its on-disk cache (adaptive_amp.compile_cache), and the tuning's report
of it."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from adaptive_amp import tune as tune_module, zoo
from adaptive_amp import policy as policy_module
from adaptive_amp.compile_cache import GraphCount, describe_graphs
from adaptive_amp.hardware import Capabilities
from adaptive_amp.policy import AdaptivePrecisionSelector

CPU = Capabilities(device_type="cpu", name="test cpu", bf16=True)


@pytest.fixture
def kept_counters():
    """torch's counters as they were after the test (they are process-wide)."""
    kept = {k: v.copy() for k, v in counters.items()}
    yield
    counters.clear()
    counters.update(kept)


def test_a_graph_compiled_is_counted_then_loaded_from_the_cache():
    from torch._inductor import config
    from torch._inductor.utils import fresh_inductor_cache

    if not config.fx_graph_cache:
        pytest.skip("inductor's FX graph cache is off here (it alone counts its graphs)")
    x = torch.randn(1000)

    def compile_once():
        torch._dynamo.reset()
        count = GraphCount()
        out = torch.compile(lambda t: t.cos() * 3, backend="inductor", dynamic=False)(x)
        torch.testing.assert_close(out, x.cos() * 3)
        return count.graphs()

    with fresh_inductor_cache():  # (an empty cache directory, whatever the environment's)
        assert compile_once() == {"graphs": 1, "from_cache": 0}
        assert compile_once() == {"graphs": 1, "from_cache": 1}
    # An eager call compiles nothing.
    count = GraphCount()
    x.cos()
    assert count.graphs() is None


def test_counters_cleared_meanwhile_give_no_count(kept_counters):
    count = GraphCount()
    counters["inductor"]["fxgraph_cache_miss"] += 1
    assert count.graphs() == {"graphs": 1, "from_cache": 0}
    counters["inductor"]["fxgraph_cache_hit"] += 2
    count = GraphCount()
    counters.clear()  # (a profiler or a test harness may)
    assert count.graphs() is None


def test_the_graphs_in_words():
    assert describe_graphs(None) == ""
    assert describe_graphs({"graphs": 14, "from_cache": 0}) == \
        "14 graphs compiled by inductor, none found in its on-disk cache"
    assert describe_graphs({"graphs": 14, "from_cache": 3}) == \
        "14 graphs: 11 compiled by inductor, 3 loaded from its on-disk cache"
    assert describe_graphs({"graphs": 14, "from_cache": 14}) == "14 graphs loaded from inductor's on-disk cache"
    assert describe_graphs({"graphs": 1, "from_cache": 1}) == "1 graph loaded from inductor's on-disk cache"


def _tune():
    zm = zoo.build("gpt2", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=3e-3)
    batches = [zm.make_batch(4, seed=i) for i in range(2)]
    return AdaptivePrecisionSelector().tune(zm.model, opt, batches, zm.loss, capabilities=CPU,
                                            candidates=["fp32", "bf16"], steps=2, rounds=1, timed_steps=1)


def test_a_tuning_reports_what_inductor_compiled_over_all_of_it(monkeypatch, kept_counters):
    eager = _tune()
    assert eager.inductor_graphs is None and "inductor" not in eager.table()
    assert eager.to_dict()["inductor_graphs"] is None
    # The count spans the candidates' making (where the fp8 map is measured) and the trials: a graph loaded from
    # the cache in the one, one compiled in the other.
    candidates, run = policy_module.candidate_recipes, tune_module.Tuner.run

    def making(*args, **kwargs):
        counters["inductor"]["fxgraph_cache_hit"] += 1
        return candidates(*args, **kwargs)

    def trials(self):
        counters["inductor"]["fxgraph_cache_miss"] += 1
        return run(self)
    monkeypatch.setattr(policy_module, "candidate_recipes", making)
    monkeypatch.setattr(tune_module.Tuner, "run", trials)
    result = _tune()
    assert result.inductor_graphs == {"graphs": 2, "from_cache": 1}
    assert result.to_dict()["inductor_graphs"] == {"graphs": 2, "from_cache": 1}
    assert result.table().splitlines()[0].endswith(
        "; 2 graphs: 1 compiled by inductor, 1 loaded from its on-disk cache")
