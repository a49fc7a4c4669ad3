"""The end-to-end benchmark runs on the CPU at tiny sizes (the numbers mean something on a GPU)."""

from __future__ import annotations

import json

import pytest

from adaptive_amp.bench.cli import main as bench_main
from adaptive_amp.bench.e2e import CONTROLLER_RECIPES, RECIPES


def test_e2e_eager_every_recipe_with_the_drop_in_check(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    bench_main(["--device", "cpu", "--suites", "e2e", "--e2e-modes", "eager", "--e2e-steps", "2",
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
    assert report["dropin"][0]["bitwise_equal"] is True
    assert "drop-in check" in capsys.readouterr().out


def test_e2e_compiled_controller_and_its_plain_twin():
    from adaptive_amp.bench.e2e import run_e2e

    result = run_e2e(recipes=["bf16-pure"], modes=("compiled",), steps=2, rounds=1, warmup=1, device="cpu",
                     progress=lambda *_: None)
    assert [(r.mode, r.loop) for r in result["rows"]] == [("compiled", "plain"), ("compiled", "controller")]
    assert result["rows"][1].skipped_steps == 0
