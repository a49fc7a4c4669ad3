"""TrainingReport (text, JSON, plots) and comparison_table, from plain recorded data."""

from __future__ import annotations

import json
import math
import sys
import warnings

import pytest

from adaptive_amp.report import TrainingReport, comparison_table, policy_diff

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NAN = math.nan
FP16 = "params=float32,compute=float16,loss_scale=dynamic:65536"
FP16_ISLAND = "params=float32,compute=float16,islands=lm_head,loss_scale=dynamic:65536"


def run_history(n=100):
    """A falling loss; overflows (skipped) at steps 10 and 60 with the scale halving; a NaN loss at 60."""
    scale, skipped = 65536.0, 0
    h = {k: [] for k in ("step", "loss", "grad_norm", "scale", "found_inf", "skipped_steps")}
    for i in range(n):
        inf = i in (10, 60)
        if inf:
            scale /= 2
            skipped += 1
        h["step"].append(i)
        h["loss"].append(NAN if i == 60 else 3.0 - 2.0 * i / (n - 1))
        h["grad_norm"].append(NAN if inf else 1.0 + (i % 7) / 10)
        h["scale"].append(scale)
        h["found_inf"].append(int(inf))
        h["skipped_steps"].append(skipped)
    return h


EVENTS = [
    {"step": 10, "kind": "overflow_rate", "layer": None, "message": "overflow rate 5% over 20 steps", "data": {}},
    {"step": 60, "kind": "nan_loss", "layer": None, "message": "loss is nan", "data": {"loss": NAN}},
    {"step": 60, "kind": "promote", "layer": "lm_head", "message": "promote lm_head: its output overflows fp16",
     "data": {"amax": 1e5}},
] + [{"step": 20 + i, "kind": "loss_spike", "layer": None, "message": f"spike {i}", "data": {}} for i in range(5)]

ANALYSIS = {
    "error_threshold": 0.02, "candidates": ["float16", "bfloat16"], "grad_amax": 3.0, "skipped": {},
    "results": [
        {"name": "blocks.0.ff", "layer_type": "Linear", "dtype": "float16", "model_error": 1e-4},
        {"name": "blocks.0.ff", "layer_type": "Linear", "dtype": "bfloat16", "model_error": 1e-3},
        {"name": "lm_head", "layer_type": "Linear", "dtype": "float16", "model_error": None},  # overflow: inf
        {"name": "lm_head", "layer_type": "Linear", "dtype": "bfloat16", "model_error": 0.05},
        {"name": "embed_proj", "layer_type": "Linear", "dtype": "float16", "model_error": 0.0},
        {"name": "embed_proj", "layer_type": "Linear", "dtype": "bfloat16", "model_error": 2e-3},
    ],
    "risky": {"float16": [["lm_head", "overflow"]], "bfloat16": [["lm_head", "model output error 0.05 > 0.02"]]},
}


@pytest.fixture
def report():
    return TrainingReport(run_history(), EVENTS, [(0, FP16), (60, FP16_ISLAND)], analysis=ANALYSIS,
                          summary={"step_time_ms": 12.5, "device": "cpu"})


def test_text_states_the_run(report):
    text = str(report)
    assert text == report.text()
    assert "steps:        100 (step 0 to 99)" in text
    s = report.stats()
    assert s["final_loss"] == pytest.approx(sum(3.0 - 2.0 * i / 99 for i in range(90, 100)) / 10)
    assert s["steps"] == 100 and s["final_loss_steps"] == 10
    assert f"final loss:   {s['final_loss']:.4g} (mean of the last 10 step(s))" in text
    assert "loss trend:   down" in text and "1 non-finite loss(es)" in text
    assert "skipped:      2 of 100 step(s) (2.00%); overflow rate 2.00%" in text
    assert "loss scale:   16384 to 65536 (final 16384)" in text
    assert "grad norm:    1 to 1.6" in text
    assert "step_time_ms: 12.5" in text and "device:       cpu" in text


def test_text_policy_changes_with_reasons(report):
    text = report.text()
    assert f"policy: {FP16} (from step 0)" in text
    assert f"step 60: +islands=lm_head (now {FP16_ISLAND})" in text
    assert "because: promote lm_head: its output overflows fp16" in text
    (change,) = report.policy_changes()
    assert change["reasons"] == ["promote lm_head: its output overflows fp16"]


def test_text_events_grouped_by_kind(report):
    text = report.text()
    assert "events: 8" in text
    assert "loss_spike x5 (steps 20 to 24)" in text
    assert "spike 0" in text and "spike 2" in text and "spike 3" not in text and "... and 2 more" in text
    assert "step 60 [lm_head]: promote lm_head" in text
    assert list(report.events_by_kind()) == ["overflow_rate", "loss_spike", "nan_loss", "promote"]  # by step


def test_text_sensitive_layers(report):
    layers = report.sensitive_layers()
    assert [e["name"] for e in layers] == ["lm_head", "embed_proj", "blocks.0.ff"]
    assert layers[0]["risky"] == ["float16", "bfloat16"] and math.isinf(layers[0]["errors"]["float16"])
    lines = report.text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("most sensitive layers"))
    assert lines[i + 1].split() == ["layer", "float16", "bfloat16", "risky", "in"]
    assert lines[i + 3].split() == ["lm_head", "inf", "0.05", "float16,", "bfloat16"]


def test_json_round_trip(report):
    text = report.to_json()
    data = json.loads(text)  # strict JSON: NaN became null
    assert "NaN" not in text and data["history"]["loss"][60] is None
    assert data["stats"]["skipped_steps"] == 2 and data["policies"][1] == [60, FP16_ISLAND]
    back = TrainingReport.from_json(text)
    assert back.text() == report.text()
    assert back.to_dict() == report.to_dict()
    assert math.isnan(back.history["loss"][60])
    assert back.events_by_kind()["nan_loss"][0]["data"] == {"loss": None}


def test_accepts_objects_with_to_dict_and_policy_objects():
    class Analysis:
        def to_dict(self):
            return ANALYSIS

    class Policy:
        def __str__(self):
            return FP16

    r = TrainingReport(run_history(5), policies=[(0, Policy())], analysis=Analysis())
    assert r.policies == [(0, FP16)] and r.analysis["candidates"] == ["float16", "bfloat16"]


def test_empty_history():
    r = TrainingReport({})
    text = r.text()
    assert "steps:        none recorded" in text and "policy: not recorded" in text and "events: none" in text
    assert r.stats()["final_loss"] is None and r.stats()["overflow_rate"] is None
    assert TrainingReport.from_json(r.to_json()).text() == text


def test_all_nan_columns_and_single_step():
    r = TrainingReport({"step": [7], "loss": [NAN], "grad_norm": [NAN], "scale": [NAN], "found_inf": [1],
                        "skipped_steps": [1]})
    text = r.text()
    assert "steps:        1 (step 7 to 7)" in text
    assert "no finite loss in the last 1 step(s)" in text
    assert "loss trend:   one step only; 1 non-finite loss(es)" in text
    assert "loss scale:   none (no loss scaling)" in text and "grad norm:    not recorded" in text
    assert "skipped:      1 of 1 step(s) (100.00%)" in text


def test_missing_columns_are_filled_in():
    r = TrainingReport({"loss": [2.0, 1.0, 1.5], "found_inf": [0, 1, 1]})
    assert r.history["step"] == [0, 1, 2] and r.history["skipped_steps"] == [0, 1, 2]
    assert all(math.isnan(v) for v in r.history["scale"])


def test_bad_input_says_what_is_wrong():
    with pytest.raises(ValueError, match="differ in length: step=3, loss=2"):
        TrainingReport({"step": [0, 1, 2], "loss": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"events\[0\] has no 'kind'"):
        TrainingReport({}, [{"step": 1}])
    with pytest.raises(ValueError, match=r"unknown key\(s\) severity.*'data'"):
        TrainingReport({}, [{"step": 1, "kind": "x", "severity": 2}])
    with pytest.raises(ValueError, match=r"policies\[0\].*\(step, policy\) pairs"):
        TrainingReport({}, policies=["bf16"])
    with pytest.raises(TypeError, match=r"history\['loss'\] holds 'high'"):
        TrainingReport({"loss": ["high"]})


def test_policy_diff():
    assert policy_diff(FP16, FP16_ISLAND) == "+islands=lm_head"
    assert policy_diff("params=float32,compute=float16,tf32=1", "params=float32,compute=bfloat16") == \
        "compute: float16 -> bfloat16, -tf32"
    assert policy_diff(FP16, FP16) == "no change"


def test_comparison_table():
    rows = [{"run": "fp32", "final_loss": 1.234567, "step_time_ms": 10.0, "skipped_steps": 0, "policy": "fp32"},
            {"run": "torch AMP", "final_loss": 1.25, "step_time_ms": 6.25, "skipped_steps": 4},
            {"run": "adaptive_amp", "final_loss": NAN, "step_time_ms": None, "skipped_steps": 1,
             "policy": "params=float32,compute=bfloat16"}]
    lines = comparison_table(rows).splitlines()
    assert lines[0].split() == ["run", "final_loss", "step_time_ms", "skipped_steps", "policy"]
    assert set(lines[1]) == {"-", " "}
    assert lines[2].split() == ["fp32", "1.235", "10", "0", "fp32"]
    assert lines[3].split() == ["torch", "AMP", "1.25", "6.25", "4"]  # a missing policy is blank
    assert lines[4].split() == ["adaptive_amp", "nan", "-", "1", "params=float32,compute=bfloat16"]
    # numbers right-aligned, text left-aligned: the columns line up
    assert lines[2].index("1.235") + 5 == lines[0].index("final_loss") + len("final_loss")
    assert comparison_table(rows, ["run", "final_loss"]).splitlines()[0].split() == ["run", "final_loss"]
    assert comparison_table([]) == "(no rows)"
    # From 10,000 up a whole number (memory in MiB, tokens/s), not 2.784e+04; small ones keep an exponent.
    big = comparison_table([{"memory MiB": 27840.5, "tokens/s": 150432.4, "tiny": 2.5e-5, "ms": 9999.4}])
    assert big.splitlines()[2].split() == ["27840", "150432", "2.500e-05", "9999"]
    with pytest.raises(TypeError, match=r"rows\[0\] is a list"):
        comparison_table([[1, 2]])


# ---------------------------------------------------------------------- plots


def assert_png(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_plots_are_pngs(report, tmp_path):
    pytest.importorskip("matplotlib")
    assert_png(report.plot_timeline(str(tmp_path / "t.png")))
    assert_png(report.plot_sensitivity(str(tmp_path / "sub" / "s.png")))


def test_plots_of_edge_cases(tmp_path):
    pytest.importorskip("matplotlib")
    TrainingReport({}).plot_timeline(str(tmp_path / "empty.png"))
    TrainingReport({"step": [3], "loss": [NAN], "grad_norm": [0.0], "scale": [NAN]}).plot_timeline(
        str(tmp_path / "one.png"))
    many = [{"step": i, "kind": f"kind{i % 12}"} for i in range(300)]  # more kinds than fixed colours
    TrainingReport(run_history(300), many, [(0, FP16), (50, FP16_ISLAND), (51, FP16)]).plot_timeline(
        str(tmp_path / "many.png"))
    for name in ("empty", "one", "many"):
        assert_png(tmp_path / f"{name}.png")
    with pytest.raises(ValueError, match="no precision analysis"):
        TrainingReport({}).plot_sensitivity(str(tmp_path / "s.png"))


def test_save_writes_everything(report, tmp_path):
    pytest.importorskip("matplotlib")
    paths = report.save(str(tmp_path / "out"))
    assert set(paths) == {"text", "json", "timeline", "sensitivity"}
    assert open(paths["text"]).read().strip() == report.text()
    assert TrainingReport.from_json(open(paths["json"]).read()).text() == report.text()
    assert_png(paths["timeline"]) and assert_png(paths["sensitivity"])
    assert set(TrainingReport(run_history(3)).save(str(tmp_path / "no_analysis"))) == {"text", "json", "timeline"}
    assert set(report.save(str(tmp_path / "no_plots"), plots=False)) == {"text", "json"}


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError


def test_without_matplotlib_plots_say_how_to_install(report, tmp_path, no_matplotlib):
    with pytest.raises(ImportError, match=r"pip install matplotlib"):
        report.plot_timeline(str(tmp_path / "t.png"))
    with pytest.raises(ImportError, match="matplotlib"):
        report.plot_sensitivity(str(tmp_path / "s.png"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = report.save(str(tmp_path / "out"))
    assert set(paths) == {"text", "json"}
    assert len(caught) == 1 and "pip install matplotlib" in str(caught[0].message)
    assert not (tmp_path / "out" / "timeline.png").exists()


def test_summary_lines_that_repeat_the_report_are_left_out():
    r = TrainingReport(run_history(5), policies=[(0, FP16)],
                       summary={"steps": 5, "policy": FP16, "device": "cpu", "loss_trend": -0.5})
    text = r.text()
    assert text.count("steps:") == 1 and text.count("policy:") == 1, text
    assert "device:       cpu" in text and "recent loss slope per step:" in text


def test_timeline_without_loss_scaling_has_no_scale_panels(tmp_path):
    from matplotlib.image import imread

    h = run_history(40)
    h["scale"] = [NAN] * 40
    h["found_inf"] = [0] * 40
    h.pop("skipped_steps", None)
    unscaled = imread(TrainingReport(h).plot_timeline(str(tmp_path / "unscaled.png")))
    scaled = imread(TrainingReport(run_history(40)).plot_timeline(str(tmp_path / "scaled.png")))
    assert unscaled.shape[0] < 0.75 * scaled.shape[0]  # two panels fewer


def test_recipes_plot(tmp_path):
    from adaptive_amp.report import plot_recipes

    runs = {"fp32": {"losses": [3.0 - 0.01 * i for i in range(100)], "scales": [], "skipped_at": [],
                     "step_times": [5.0, 5.2, 4.9, 5.1]},
            "torch AMP": {"losses": [NAN] * 100, "scales": [2.0 ** (16 - i) for i in range(100)],
                          "skipped_at": list(range(100)), "step_times": [4.0]},
            "adaptive_amp": {"losses": [3.0 - 0.01 * i for i in range(100)], "scales": [65536.0] * 100,
                             "skipped_at": [0, 1, 2], "step_times": []}}
    assert_png(plot_recipes(runs, str(tmp_path / "r.png"), notes=["fp32: float32"]))


def test_recipes_plot_without_loss_scaling_has_no_scale_panels(tmp_path):
    from matplotlib.image import imread

    from adaptive_amp.report import plot_recipes

    bf16 = {"losses": [3.0 - 0.01 * i for i in range(50)], "scales": [NAN] * 50, "skipped_at": [], "step_times": [5.0]}
    unscaled = imread(plot_recipes({"torch bf16": bf16, "tuned": dict(bf16, scales=[])}, str(tmp_path / "u.png")))
    one_skip = imread(plot_recipes({"torch bf16": bf16, "fp16": dict(bf16, skipped_at=[3])}, str(tmp_path / "s.png")))
    assert unscaled.shape[0] < 0.75 * one_skip.shape[0]  # two panels fewer; a skipped step alone brings them back
