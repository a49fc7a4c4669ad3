"""``python -m adaptive_amp bench tune`` in its CPU smoke mode: tiny models, a few steps."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_bench_tune_script_smoke(tmp_path):
    from adaptive_amp.bench import tuning as script
    assert script.main(["--tiny", "--device", "cpu", "--train-steps", "12", "--alone-steps", "4", "--seeds", "2",
                        "--tune-steps", "3", "--rounds", "2", "--timed-steps", "1", "--cost-shape", "4x16",
                        "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "evidence.json").read_text())["runs"][0]
    assert set(run["tuned"]) == {"0", "1"} and set(run["torch_bf16"]) == {"0", "1"}
    chosen = run["tuned"]["0"]["chosen"]
    assert run["tuned"]["1"]["chosen"] == chosen and len(run["tuned"]["0"]["losses"]) == 12
    assert chosen in run["alone"] and run["cost"]["fraction_of_10k_steps"] > 0
    t = run["targets"]
    assert t["tuned_vs_torch_bf16"] > 0 and isinstance(t["loss_within_seed_spread"], bool)
    assert t["best_agreeing_alone"] in run["alone"] and not run.get("skipped")
    assert set(t["time_to_common_loss"]) == {"0", "1"}
    c = t["time_to_common_loss"]["1"]
    assert c["loss"] == max(run["tuned"]["1"]["final_loss"], run["torch_bf16"]["1"]["final_loss"])
    assert 1 <= c["tuned_steps"] <= 12 and 1 <= c["torch_steps"] <= 12
    assert (tmp_path / "gpt2-medium-eager" / "tune.txt").exists()


def test_time_to_common_loss_counts_a_faster_run_one_step_behind_as_sooner():
    from adaptive_amp.bench.tuning import time_to_common_loss

    # torch: loss 100 - i at 10 ms a step; tuned: one step behind (101 - i) at 5 ms. Both reach 82.5, the
    # higher final loss (the mean of the last two of 20 steps): tuned at its 20th step, torch at its 19th.
    ref = {"losses": [100.0 - i for i in range(20)], "final_loss": 81.5, "steady_ms_per_step": 10.0}
    tuned = {"losses": [101.0 - i for i in range(20)], "final_loss": 82.5, "steady_ms_per_step": 5.0}
    c = time_to_common_loss(tuned, ref)
    assert (c["loss"], c["tuned_steps"], c["torch_steps"]) == (82.5, 20, 19)
    assert c["tuned_seconds"] == pytest.approx(0.1) and c["torch_seconds"] == pytest.approx(0.19)
    assert c["tuned_sooner"] == pytest.approx(1.9)
    # The other way round: ahead in loss but slower, it is not sooner.
    c = time_to_common_loss(dict(ref, steady_ms_per_step=20.0), dict(tuned, steady_ms_per_step=10.0))
    assert (c["loss"], c["tuned_steps"], c["torch_steps"]) == (82.5, 19, 20) and c["tuned_sooner"] < 1


def test_bench_tune_skips_what_does_not_fit_max_seconds(tmp_path):
    from adaptive_amp.bench import tuning as script
    assert script.main(["--tiny", "--device", "cpu", "--train-steps", "6", "--max-seconds", "0",
                        "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "evidence.json").read_text())["runs"][0]
    assert run["skipped"][0] == "tuned, seed 0" and not run["tuned"] and not run["torch_bf16"]


def test_bench_tune_seeds_part_alone_with_a_given_choice(tmp_path):
    from adaptive_amp.bench import tuning as script
    assert script.main(["--tiny", "--device", "cpu", "--train-steps", "6", "--tune-steps", "2", "--rounds", "1",
                        "--parts", "seeds", "--choice", "bf16", "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "evidence.json").read_text())["runs"][0]
    assert set(run["tuned"]) == {"1"} and set(run["torch_bf16"]) == {"1"} and not run["alone"]
    assert run["tuned"]["1"]["chosen"] == "bf16"


def test_bench_tune_spread_seeds_names_the_seeds_run(tmp_path):
    from adaptive_amp.bench import tuning as script
    assert script.main(["--tiny", "--device", "cpu", "--train-steps", "4", "--tune-steps", "2", "--rounds", "1",
                        "--parts", "seeds", "--choice", "bf16", "--spread-seeds", "3", "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "evidence.json").read_text())["runs"][0]
    assert set(run["tuned"]) == {"3"} and set(run["torch_bf16"]) == {"3"}


def test_bench_tune_every_torch_run_starts_from_fp32_weights_after_a_tuned_run_in_bf16(tmp_path, monkeypatch):
    """A tuned run that chose bf16 weights leaves them in bf16; the next seed's weights are loaded into the
    model as built, not into those."""
    import torch

    from adaptive_amp.bench import tuning as script

    dtypes = []
    real = script.torch_bf16

    def torch_bf16(zm, model, opt, *args):
        dtypes.append({p.dtype for p in zm.model.parameters()})
        return real(zm, model, opt, *args)
    monkeypatch.setattr(script, "torch_bf16", torch_bf16)
    assert script.main(["--tiny", "--device", "cpu", "--train-steps", "4", "--tune-steps", "2", "--rounds", "1",
                        "--parts", "seeds", "--choice", "bf16-weights", "--spread-seeds", "1,2",
                        "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "evidence.json").read_text())["runs"][0]
    assert set(run["tuned"]) == {"1", "2"} and run["tuned"]["1"]["chosen"] == "bf16-weights"
    assert dtypes == [{torch.float32}, {torch.float32}]


@pytest.mark.parametrize("option, bad", [("--spread-seeds", ""), ("--spread-seeds", "two"),
                                         ("--spread-seeds", "1,-2"), ("--parts", ""), ("--parts", "tuned,torches"),
                                         ("--parts", "none,tuned")])
def test_bench_tune_refuses_a_bad_seed_list_or_part_by_name(option, bad, capsys):
    from adaptive_amp.bench import tuning as script
    with pytest.raises(SystemExit):
        script.main(["--tiny", "--device", "cpu", option, bad])
    assert option in capsys.readouterr().err


def test_bench_tune_parts_none_runs_only_the_budget(tmp_path):
    from adaptive_amp.bench import tuning as script
    assert script.main(["--tiny", "--device", "cpu", "--train-steps", "4", "--tune-steps", "2", "--rounds", "1",
                        "--parts", " none", "--budget", "1GiB", "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "evidence.json").read_text())["runs"][0]
    assert not run["tuned"] and not run["torch_bf16"] and not run["alone"]
    assert run["budget"]["tuning_seconds"] > 0 and len(run["budget"]["losses"]) == 4


def test_bench_tune_through_the_cli_says_what_it_compared(tmp_path, capsys):
    from adaptive_amp.bench import main

    assert main(["tune", "--tiny", "--device", "cpu", "--train-steps", "6", "--tune-steps", "2", "--rounds", "1",
                 "--timed-steps", "1", "--parts", "tuned,torch", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "the tuning chose" in out and "torch's bf16 autocast" in out
    assert "one seed: no spread" in out and "seed 0: to the loss both runs reach" in out


def test_bench_tune_compiled_judges_the_cost_and_never_a_loss_targets(tmp_path, capsys):
    from adaptive_amp.bench import tuning as script
    assert "gpt2-small" in script.MODELS
    assert script.main(["--tiny", "--device", "cpu", "--modes", "compiled", "--compile-backend", "aot_eager",
                        "--train-steps", "4", "--tune-steps", "2", "--timed-steps", "1",
                        "--compiled-candidates", "fp32,bf16-pure", "--parts", "cold,tuned,torch",
                        "--cold-steps", "4", "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "evidence.json").read_text())["runs"][0]
    t, tuned, cold = run["targets"], run["tuned"]["0"], run["cold"]
    assert isinstance(t["cost_within_target"], bool) and isinstance(t["never_a_loss"], bool)
    # The compile the user makes anyway counts once: the choice's one-time seconds without tuning come off.
    assert cold["chosen"] == tuned["chosen"] and cold["steps"] == 4 and cold["one_time_seconds"] >= 0
    assert t["seconds_beyond_untuned_cold_start"] == pytest.approx(
        tuned["setup_seconds"] + tuned["one_time_seconds"] - cold["one_time_seconds"])
    assert t["cost_within_target"] == (t["tuning_fraction_of_10k_steps_compile_once"] <= script.COST_TARGET)
    out = capsys.readouterr().out
    assert "the 3% target" in out and "0.99x never-a-loss target" in out and "fresh process" in out


def test_bench_tune_says_what_inductor_compiled_and_loaded_while_tuning():
    from adaptive_amp.bench import tuning as script

    targets = {"tuning_compile_seconds": 7.6, "tuning_fraction_of_10k_steps_steady": 0.0168,
               "cost_within_target": True, "tuned_vs_torch_bf16_steady": 1.3, "never_a_loss": True}
    tuned = {"chosen": "bf16-pure", "setup_seconds": 63.8, "steady_ms_per_step": 380.0,
             "tuning": {"timing": "", "inductor_graphs": {"graphs": 20, "from_cache": 20}}}
    run = {"model": "llama", "mode": "compiled", "shape": "3x2048", "targets": targets, "tuned": {0: tuned}}
    line = next(x for x in script.verdict(run) if "s of it compiling" in x)
    assert "(7.6 s of it compiling; 20 graphs loaded from inductor's on-disk cache) is 1.68%" in line
    tuned["tuning"].pop("inductor_graphs")  # (a report written before the count was kept)
    assert "(7.6 s of it compiling) is 1.68%" in next(x for x in script.verdict(run) if "s of it compiling" in x)
