"""bench/snapshot_cost.py (the tuning snapshot's cost against the old per-tensor copies) in its tiny CPU mode."""

from __future__ import annotations

from conftest import load_bench_script


def test_three_ways_timed_twice(capsys):
    assert load_bench_script("snapshot_cost").main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert out.count("Snapshot, one block (registered)") == 2 and out.count("old: a pinned allocation") == 2
