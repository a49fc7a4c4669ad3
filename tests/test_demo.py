"""``python -m adaptive_amp demo`` end to end on the CPU, shortened (the default CPU demo takes about a minute)."""

from __future__ import annotations

import json
import re

import pytest

from adaptive_amp.demo import main


def test_demo_runs_and_writes_its_table_reports_and_checks(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["--device", "cpu", "--steps", "12", "--timing-rounds", "1", "--out", str(out),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "demo.json").read_text())
    runs = {(r["scenario"], r["recipe"]): r for r in result["results"]}
    assert set(runs) == {(s, r) for s in ("ordinary", "planted") for r in ("fp32", "torch_amp", "adaptive")}
    # The planted layer overflows in fp16 from the first step: torch AMP skips every step; adaptive_amp diagnoses
    # the overflow the step it appears (step 0 collects statistics), promotes the layer and trains from step 1.
    assert runs["planted", "torch_amp"]["skipped_steps"] == 12
    planted = runs["planted", "adaptive"]
    assert planted["skipped_steps"] == 1 and "islands=inp" in planted["policy"]
    assert any(e["kind"] == "promote" and e["layer"] == "inp" for e in planted["events"])
    assert all(r["step_ms"] > 0 for r in runs.values())
    assert "planted: adaptive_amp repaired the planted overflow at step 1 (inp now runs in float32)" in printed
    assert "planted: torch's AMP skipped every one of its 12 steps, so the model never trained" in printed
    assert (out / "demo.txt").read_text().startswith("scenario")
    for line in result["checks"]:  # sentences: what was compared and the verdict, no bare numbers
        assert line.startswith(("planted: ", "ordinary: ", "note: ")) and " " in line.split(": ", 1)[1], line
    overheads = [r["overhead_ms"] for r in _table_rows(printed)]
    assert len(overheads) == 8 and not any(re.search(r"(?<!\+)-\d", cell) for cell in overheads), overheads
    for scenario in ("ordinary", "planted"):  # the recipes side by side
        assert (out / f"recipes_{scenario}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(runs["planted", "torch_amp"]["skipped_at"]) == 12 and len(runs["planted", "adaptive"]["losses"]) == 12
    for scenario in ("ordinary", "planted"):
        assert (out / f"report_{scenario}" / "report.txt").exists()
        assert (out / f"report_{scenario}" / "report.json").exists()


def test_demo_runs_only_the_recipes_asked_for(tmp_path):
    out = tmp_path / "demo"
    assert main(["--device", "cpu", "--steps", "4", "--timing-rounds", "0", "--scenarios", "ordinary",
                 "--recipes", "torch_amp, adaptive", "--seeds", "1", "--out", str(out), "--no-progress"]) == 0
    result = json.loads((out / "demo.json").read_text())
    assert [(r["scenario"], r["recipe"]) for r in result["results"]] == [("ordinary", "torch_amp"),
                                                                         ("ordinary", "adaptive")]
    assert "ordinary: neither adaptive_amp nor torch AMP skipped a step." in result["checks"]


def test_demo_refuses_an_unknown_recipe(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--recipes", "fp32,apex", "--out", str(tmp_path / "demo")])
    assert "--recipes: unknown recipe 'apex'" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("torch_dtype, hint", [("float16", True), ("bfloat16", False)])
def test_verdict_explains_equal_skips_only_where_torch_amp_scales_fp16(torch_dtype, hint):
    from adaptive_amp.demo.run import RunResult, verdicts

    def result(recipe, seed, loss, policy):
        return RunResult("ordinary", recipe, seed, final_loss=loss, train_loss=loss, train_ms=1.0, skipped_steps=0,
                         policy=policy, step_ms=1.0)

    runs = [result("torch_amp", s, 1.0 + s / 10, f"autocast {torch_dtype} + GradScaler") for s in (0, 1)]
    runs += [result("adaptive", s, 1.05, "params=float32,compute=bfloat16") for s in (0, 1)]
    lines = verdicts(runs)
    assert "ordinary: neither adaptive_amp nor torch AMP skipped a step." in lines
    assert any("--steps 14000" in line for line in lines) == hint


def test_step_time_verdict_does_not_flip_on_noise():
    """10.29 against 10.11 ms with a spread of 0.3 ms is no measurable difference (it printed FAIL once)."""
    from adaptive_amp.demo.run import RunResult, compare_times, verdicts

    sentence, verdict = compare_times([10.0, 10.29, 10.6, 10.2, 10.4], [10.11, 9.8, 10.4, 10.0, 10.3], "torch AMP")
    assert verdict == "same" and sentence.endswith("the 0.18 ms between them (2%) is within the timing noise "
                                                   "(+-0.43 ms): no measurable difference"), sentence
    sentence, verdict = compare_times([12.0, 12.1, 11.9, 12.05], [10.0, 10.1, 9.9, 10.05], "torch AMP")
    assert verdict == "slower" and sentence.endswith("1.20x torch AMP's time")
    assert compare_times([8.0, 8.1, 7.9, 8.05], [10.0, 10.1, 9.9, 10.05], "torch AMP")[1] == "faster"

    def result(recipe, times):
        return RunResult("ordinary", recipe, 0, final_loss=1.0, train_loss=1.0, train_ms=1.0, skipped_steps=0,
                         policy="params=float32,compute=bfloat16", step_ms=times[0], step_times=times)

    noisy = verdicts([result("torch_amp", [10.11, 9.8, 10.4, 10.0]), result("adaptive", [10.29, 10.0, 10.6, 10.2])])
    line = next(v for v in noisy if v.startswith("ordinary: step time"))
    assert "no measurable difference" in line and line.endswith("PASS"), line
    slower = verdicts([result("torch_amp", [10.0, 10.1, 9.9, 10.05]), result("adaptive", [12.0, 12.1, 11.9, 12.05])])
    line = next(v for v in slower if v.startswith("ordinary: step time"))
    assert "1.20x torch AMP's time" in line and line.endswith("FAIL (measurably slower)"), line
    assert not any(v.startswith("note: on the CPU") for v in slower)
    assert any(v.startswith("note: on the CPU") for v in verdicts(slower and [result("adaptive", [1.0])], "cpu"))


def _table_rows(printed: str) -> list:
    lines = printed[printed.index("scenario  recipe"):].splitlines()
    header = lines[0]
    start, end = header.index("overhead_ms"), header.index("skipped")
    rows = []
    for line in lines[2:]:
        if not line.strip():
            break
        rows.append({"overhead_ms": line[start:end].strip()})
    return rows


def test_overhead_inside_the_noise_is_said_in_words_never_as_a_negative_cost():
    from adaptive_amp.demo.run import RunResult, overhead_words, verdicts

    assert overhead_words([0.8, 1.0, 1.1, 0.9, 1.2]) == "1.00+-0.15"
    assert overhead_words([-0.3, 0.2, -0.1, 0.4, 0.1]) == "within noise (+-0.25)"
    assert overhead_words([-5.0, -4.0, -4.5, -4.8]) == "none measured (+-0.41)"  # the bare steps ran slower
    assert overhead_words([-0.4]) == "none measured" and overhead_words([0.4]) == "0.40"
    assert overhead_words([]) == "-"

    def result(recipe, overheads):
        return RunResult("ordinary", recipe, 0, final_loss=1.0, train_loss=1.0, train_ms=1.0, skipped_steps=0,
                         policy="params=float32,compute=bfloat16", step_ms=10.0, step_times=[10.0, 10.1, 9.9, 10.0],
                         overheads=overheads)

    noisy = verdicts([result("torch_amp", [0.1, -0.2, 0.0, 0.1]), result("adaptive", [-0.3, 0.2, -0.1, 0.4])])
    assert "ordinary: the controller's own cost is too small to measure here" in "\n".join(noisy)
    costly = verdicts([result("torch_amp", [0.1, -0.2, 0.0, 0.1]), result("adaptive", [1.0, 1.1, 0.9, 1.05])])
    assert any(v.startswith("ordinary: the controller itself costs 1.02 ms per step") for v in costly), costly


def test_torch_amp_skips_count_the_steps_at_a_zero_scale():
    """After about 150 overflowing steps in a row torch's scale reaches 0 and stops going down; every step there
    is skipped still (a 300-step planted run once read "skipped 166 of 300")."""
    from adaptive_amp.demo.run import torch_skips

    assert torch_skips(4.0, [2.0, 4.0, 4.0, 2.0]) == [0, 3]
    assert torch_skips(2.0 ** -148, [2.0 ** -149, 0.0, 0.0]) == [0, 1, 2]


def test_full_runs_the_gpu_lengths_on_the_cpu_and_bad_counts_are_refused(tmp_path, capsys):
    from adaptive_amp.demo.run import Config

    quick, full, gpu = Config.for_device("cpu"), Config.for_device("cpu", full=True), Config.for_device("cuda")
    assert (quick.steps, quick.seeds, quick.timing_rounds) == (300, 2, 5)
    assert (full.steps, full.seeds, full.timing_rounds, full.timing_steps) == (gpu.steps, gpu.seeds, 7, 30)
    assert full.d_model == quick.d_model and Config.for_device("cpu", 40, full=True).steps == 40
    for option in ("--steps", "--seeds"):
        with pytest.raises(SystemExit):
            main([option, "0", "--out", str(tmp_path / "demo")])
        assert f"{option} is 0; pass at least 1" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()
