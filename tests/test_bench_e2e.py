"""The end-to-end benchmark runs on the CPU at tiny sizes (the numbers mean something on a GPU)."""

from __future__ import annotations

import json

import pytest

from adaptive_amp.bench.cli import main as bench_main
from adaptive_amp.bench.e2e import CONTROLLER_RECIPES, RECIPES


@pytest.mark.slow
def test_e2e_eager_every_recipe_with_the_drop_in_check(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    bench_main(["--device", "cpu", "--suites", "e2e", "--e2e-modes", "eager", "--e2e-steps", "2", "--e2e-rounds", "2",
                "--json", str(out)])
    report = json.loads(out.read_text())["e2e"]
    rows = report["rows"]
    assert [(r["recipe"], r["loop"]) for r in rows] == [
        (recipe, loop) for recipe in RECIPES
        for loop in (("plain", "controller") if recipe in CONTROLLER_RECIPES else ("plain",))]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 and r["final_loss"] == pytest.approx(4.86, abs=0.2)
        assert (r["overhead"] is not None) == (r["loop"] == "controller")
        assert r["anomalies"] == (0 if r["loop"] == "controller" else None)
        assert len(r["round_ms"]) == 2 and r["ms_per_step"] == pytest.approx(sum(r["round_ms"]) / 2)
        if r["loop"] == "controller":  # each round against the plain loop's round next to it
            plain = next(p for p in rows if p["recipe"] == r["recipe"] and p["loop"] == "plain")
            assert r["pair_ratios"] == pytest.approx([c / p for c, p in zip(r["round_ms"], plain["round_ms"])])
            # 1 warm-up step, then rounds of 1 step: steps 1 and 2, neither a statistics step nor a read
            assert r["stats_rounds"] == []
        else:
            assert r["pair_ratios"] == [] and r["stats_rounds"] == []
    assert report["dropin"][0]["bitwise_equal"] is True
    assert "drop-in check" in capsys.readouterr().out


@pytest.mark.slow
def test_e2e_compiled_controller_and_its_plain_twin():
    from adaptive_amp.bench.e2e import run_e2e

    result = run_e2e(recipes=["bf16-pure", "bf16-weights"], modes=("compiled",), steps=2, rounds=1, warmup=1,
                     device="cpu", progress=lambda *_: None)
    assert [(r.recipe, r.loop) for r in result["rows"]] == [("bf16-pure", "plain"), ("bf16-pure", "controller"),
                                                            ("bf16-weights", "plain"), ("bf16-weights", "controller")]
    assert all(r.skipped_steps == 0 for r in result["rows"])
    assert result["rows"][3].policy == "params=bfloat16,compute=bfloat16,scope=matmul" == result["rows"][2].policy


def test_rounds_with_a_statistics_step_or_a_read_are_marked():
    """The GPU default (5 warm-up steps, 6 rounds of 10): the controller's statistics step 50 and its read at step
    49 fall in round 4; a row's stats_rounds says which rounds hold such a step (one host sync, per-layer
    launches)."""
    from types import SimpleNamespace

    from adaptive_amp.bench.e2e import _monitor_steps
    from adaptive_amp.monitor import StabilityMonitor

    amp = SimpleNamespace(monitor=StabilityMonitor(read_every=50), layer_stats=True)
    assert [r for r in range(6) if _monitor_steps(amp, 5 + 10 * r, 15 + 10 * r)] == [4]
    assert _monitor_steps(amp, 50, 51) and _monitor_steps(amp, 49, 50) and not _monitor_steps(amp, 51, 98)
    amp.layer_stats = False  # reads only
    assert not _monitor_steps(amp, 50, 51) and _monitor_steps(amp, 99, 100)


def test_an_unknown_model_names_the_known_ones():
    from adaptive_amp.bench.e2e import run_e2e

    with pytest.raises(ValueError, match="unknown; choose from .*llama-1b"):
        run_e2e(models=["llama-7b"], device="cpu")
