"""What inductor compiled and loaded from its on-disk cache (adaptive_amp.compile_cache), and the tuning's report
of it."""

from __future__ import annotations

import random

import pytest
import torch

from adaptive_amp import compile_cache, zoo
from adaptive_amp.compile_cache import describe_graphs, graphs_since, inductor_counts
from adaptive_amp.hardware import Capabilities
from adaptive_amp.policy import AdaptivePrecisionSelector

CPU = Capabilities(device_type="cpu", name="test cpu", bf16=True)


def test_a_graph_compiled_is_counted_then_loaded_from_the_cache():
    # A size no other test compiles, so that the first compile cannot find it in the session's cache.
    x = torch.randn(random.randrange(10_000, 1_000_000))
    expected = x.cos() * 3

    def compile_once():
        torch._dynamo.reset()
        before = inductor_counts()
        out = torch.compile(lambda t: t.cos() * 3, backend="inductor", dynamic=False)(x)
        torch.testing.assert_close(out, expected)
        return graphs_since(before)

    assert compile_once() == {"graphs": 1, "from_cache": 0}
    assert compile_once() == {"graphs": 1, "from_cache": 1}
    # An eager call compiles nothing.
    before = inductor_counts()
    x.cos()
    assert graphs_since(before) is None
    # Counters cleared meanwhile (a profiler or test harness may): no count, rather than a negative one.
    from torch._dynamo.utils import counters

    assert graphs_since({"hit": 10**9, "miss": 0, "bypass": 0}) is None
    kept = {k: v.copy() for k, v in counters.items()}
    try:
        counters["inductor"]["fxgraph_cache_miss"] += 1
        before = inductor_counts()
        counters.clear()
        assert graphs_since(before) is None
    finally:  # (process-wide: put back what other code counted)
        counters.clear()
        counters.update(kept)


def test_the_graphs_in_words():
    assert describe_graphs(None) == ""
    assert describe_graphs({"graphs": 14, "from_cache": 0}) == \
        "inductor compiled its 14 graphs, none of them in its on-disk cache"
    assert describe_graphs({"graphs": 14, "from_cache": 3}) == \
        "inductor compiled 11 of its 14 graphs and loaded 3 from its on-disk cache"
    assert describe_graphs({"graphs": 14, "from_cache": 14}) == "inductor loaded its 14 graphs from its on-disk cache"
    assert describe_graphs({"graphs": 1, "from_cache": 1}) == "inductor loaded its graph from its on-disk cache"
    assert describe_graphs({"graphs": 1, "from_cache": 0}) == "inductor compiled its graph, not in its on-disk cache"


def _tune():
    zm = zoo.build("gpt2", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=3e-3)
    batches = [zm.make_batch(4, seed=i) for i in range(2)]
    return AdaptivePrecisionSelector().tune(zm.model, opt, batches, zm.loss, capabilities=CPU,
                                            candidates=["fp32", "bf16"], steps=2, rounds=1, timed_steps=1)


def test_a_tuning_reports_what_inductor_compiled_over_all_of_it(monkeypatch):
    eager = _tune()
    assert eager.inductor_graphs is None and "inductor" not in eager.table()
    assert eager.to_dict()["inductor_graphs"] is None
    # Counted from before the fp8 map to after the last trial: the counters read at the start and at the end.
    reads = iter([{"hit": 5, "miss": 1, "bypass": 0}, {"hit": 7, "miss": 2, "bypass": 0}])
    monkeypatch.setattr(compile_cache, "inductor_counts", lambda: next(reads))
    result = _tune()
    assert result.inductor_graphs == {"graphs": 3, "from_cache": 2}
    assert result.to_dict()["inductor_graphs"] == {"graphs": 3, "from_cache": 2}
    head = result.table().splitlines()[0]
    assert head.endswith("; inductor compiled 1 of its 3 graphs and loaded 2 from its on-disk cache")
    with pytest.raises(StopIteration):  # (read exactly twice)
        next(reads)
