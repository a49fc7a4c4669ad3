"""``python -m adaptive_amp bench zoo`` in its CPU smoke mode: tiny models,
a few steps; the rows must say what the GPU run will report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def _script():
    from adaptive_amp.bench import zoo

    return zoo


def test_recovery_suite_finds_the_planted_layers_and_reports_against_fp32(tmp_path, capsys):
    status = _script().main(["--suite", "recovery", "--tiny-cpu", "--modes", "eager", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "zoo_training_recovery.json").read_text())
    rows = {(r["config"], r["recipe"]): r for r in report["results"]}
    assert not [r for r in report["results"] if "error" in r]
    assert set(rows) == {(c, r) for c in ("gpt2-small", "llama-small") for r in ("fp32", "adaptive", "torch-fp16")}
    steps = report["settings"]["steps"]
    assert report["settings"]["max_grad_norm"] is None and report["settings"]["warmup"] == 10  # what the runs did
    assert all(r["max_grad_norm"] is None and r["warmup"] == 10 for r in report["results"])
    for config, chain in [("gpt2-small", ["transformer.h.1.attn.c_proj"]),
                          ("llama-small", ["model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"])]:
        fp32, ours, torch_amp = (rows[(config, r)] for r in ("fp32", "adaptive", "torch-fp16"))
        assert fp32["size"] == "tiny" and fp32["lost_steps"] == 0 and "ok" not in fp32
        # The planted layer's fp32 output is beyond fp16's range, and so is the input or output of each layer
        # of the chain it feeds.
        amax = fp32["chain_fp32_amax"]
        assert amax[chain[0]]["output"] > 65504 and all(max(amax[layer].values()) > 65504 for layer in chain), amax
        # torch AMP skips every step; the controller promotes the chain, a layer a step, and recovers.
        assert torch_amp["lost_steps"] == steps and not torch_amp["recovered"] and "ok" not in torch_amp
        assert [d[2] for d in ours["decisions"]] == [[layer] for layer in chain]
        assert ours["planted_promoted"] and ours["recovered"]
        assert ours["lost_steps"] == ours["recovery_steps"] == len(chain)
        assert ours["fp32_final_loss"] == fp32["final_loss"] and ours["fp32_mode"] == "eager"
        assert ours["ratio_to_fp32"] == pytest.approx(ours["final_loss"] / fp32["final_loss"], rel=1e-3)
        assert ours["checks"] == {"recovery<=10": True, "lost<=10": True, "loss<=1.05xfp32": True,
                                  "planted_promoted": True} and ours["ok"]
        assert len(ours["losses_every_10"]) >= 2 and ours["policy_end"].startswith("params=float32,compute=float16")
    text = (tmp_path / "zoo_training_recovery.txt").read_text()
    assert text.count("PASS") == 2 and "never" in text
    assert status == 0
    out = capsys.readouterr().out
    assert "verdict: AdaptiveMixedPrecision recovered from the planted overflow in every run" in out
    assert "torch AMP lost" in out


def test_alarms_suite_counts_anomalies_per_model_and_dtype(tmp_path):
    script = _script()
    status = script.main(["--suite", "alarms", "--tiny-cpu", "--steps", "25", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "zoo_training_alarms.json").read_text())
    rows = {(r["family"], r["dtype"]): r for r in report["results"]}
    assert set(rows) == {(f, d) for f in script.ALARM_FAMILIES for d in ("fp16", "bf16")}
    for (family, dtype), r in rows.items():
        assert "error" not in r, r
        assert r["steps"] == 25 and r["mode"] == "eager" and r["read_every"] == 50  # the controller's default
        assert r["policy_start"].startswith(script.DTYPES[dtype])
        assert ("loss_scale=dynamic" in r["policy_start"]) == (dtype == "fp16")
        assert r["anomalies"] == 0 and r["per_1000_steps"] == 0 and r["by_kind"] == {} and r["ok"], r
        assert r["false_actions"] == [] and r["policy_end"] == r["policy_start"]
        assert r["first_step_s"] > 0 and r["final_loss"] == r["final_loss"] and len(r["losses_every_50"]) == 2
    assert report["summary"] == {"runs": 12, "anomalies": 0, "steps": 12 * 25, "false_actions": 0}
    # The settings say what the runs did: they clip at 1.0 and warm up over 5% of the steps, not the recovery
    # suite's no-clipping default and 10-step warm-up.
    assert report["settings"]["max_grad_norm"] == 1.0 and report["settings"]["warmup"] == 1
    assert all(r["max_grad_norm"] == 1.0 and r["warmup"] == 1 for r in report["results"])
    assert status == 0
    assert (tmp_path / "zoo_training_alarms.txt").read_text().count("PASS") == 12


def test_no_run_starts_after_the_budget(tmp_path):
    status = _script().main(["--suite", "alarms", "--tiny-cpu", "--only", "gpt2,resnet", "--dtypes", "bf16",
                             "--budget-s", "0", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "zoo_training_alarms.json").read_text())
    assert status == 0
    assert [(r["family"], r["not_run"]) for r in report["results"]] == [("gpt2", "budget 0 s spent"),
                                                                         ("resnet", "budget 0 s spent")]
    assert "not run" in (tmp_path / "zoo_training_alarms.txt").read_text()
