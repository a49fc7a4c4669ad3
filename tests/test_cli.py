"""python -m adaptive_amp info | analyze | demo, called through main() (fast) and once as a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import adaptive_amp
import adaptive_amp.demo
from adaptive_amp.__main__ import main



def tiny_model():
    """The --model factory of these tests: (model, sample_inputs, loss_fn)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.randn(4, 8), lambda y: y.square().mean()


def tiny_model_no_loss():
    model, x, _ = tiny_model()
    return model, x


def not_a_pair():
    return nn.Linear(2, 2)


def test_info_text(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hardware:\n  device:")
    assert "native formats:" in out and "build:" in out and "cuda_built:" in out
    assert "policy: params=float32,compute=" in out and "  - params=float32: master weights" in out


def test_info_json_as_subprocess(tmp_path):
    # The copy under test, whether built in place or installed: its folder's parent first on the path, and
    # a working directory without an adaptive_amp/ folder (a checkout's root would shadow an installed copy).
    here = os.path.dirname(os.path.dirname(os.path.abspath(adaptive_amp.__file__)))
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "adaptive_amp", "info", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) == {"build", "hardware", "policy"}
    assert data["hardware"]["device_type"] in ("cpu", "cuda") and data["hardware"]["throughput"] == {}
    assert data["policy"]["string"].startswith("params=float32") and data["policy"]["reasons"]
    assert data["build"]["version"] and "torch" in data["build"]
    assert data["build"]["extension"] == adaptive_amp._C.__file__


def test_info_measure(capsys, monkeypatch):
    from adaptive_amp import hardware

    monkeypatch.setattr(hardware, "measure_matmul_tflops", lambda device, caps: {"float32": 1.5, "bfloat16": 3.0})
    assert main(["info", "--json", "--measure"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"]["throughput"] == {"float32": 1.5, "bfloat16": 3.0}
    assert main(["info", "--measure"]) == 0
    assert "matmul bfloat16: 3 TFLOP/s" in capsys.readouterr().out


def test_analyze_model_factory(capsys, tmp_path):
    path = tmp_path / "analysis.json"
    assert main(["analyze", "--model", "test_cli:tiny_model", "--device", "cpu", "--no-progress",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("precision analysis: 2 layer(s), formats float16, bfloat16, float8_e4m3fn")
    assert "grad amax" in out  # the factory's loss_fn was used
    assert "risky in float16: none" in out and f"wrote {path}" in out
    data = json.loads(path.read_text())
    assert {r["name"] for r in data["results"]} == {"0", "2"} and len(data["results"]) == 6


def test_analyze_options(capsys):
    assert main(["analyze", "--model", "test_cli:tiny_model_no_loss", "--candidates", "bfloat16",
                 "--threshold", "0.5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "formats bfloat16, model-error thresholds 0.5 (bfloat16)\n" in out and "grad amax" not in out


def test_analyze_demo_model(capsys):
    assert main(["analyze", "--candidates", "bf16", "--batch", "2", "--length", "8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "lm_head" in out and "blocks.layers.0.linear1" in out


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "expected package.module:factory"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("test_cli:missing", "has no callable 'missing'"),
    ("test_cli:not_a_pair", "return \\(model, sample_inputs\\)"),
])
def test_analyze_bad_model_spec(spec, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["analyze", "--model", spec, "--no-progress"])
    assert info.value.code == 2
    assert re.search("error: --model .*" + message, capsys.readouterr().err)


def test_analyze_bad_candidates(capsys):
    with pytest.raises(SystemExit) as info:
        main(["analyze", "--candidates", "bf16,fp12", "--no-progress"])
    assert info.value.code == 2 and "error: --candidates 'bf16,fp12'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["analyze", "--device", "nope"], "--device 'nope'"),
    (["analyze", "--device", "tpu"], "--device 'tpu'"),
    (["analyze", "--threshold", "-1"], "--threshold"),
    (["analyze", "--threshold", "nan"], "--threshold"),
    (["analyze", "--fp8-margin", "-1"], "--fp8-margin"),
    (["analyze", "--batch", "0"], "--batch"),
    (["analyze", "--length", "0"], "--length"),
    (["analyze", "--candidates", "fp8"], "--candidates 'fp8'"),
    (["analyze", "--candidates", ","], "--candidates ','"),
    (["analyze", "--batch", "x"], "--batch"),
    (["tune", "--zoo", "nope"], "--zoo 'nope': unknown family 'nope'"),
    (["tune", "--zoo", "gpt2:huge"], "--zoo 'gpt2:huge': unknown size 'huge'"),
    (["tune", "--device", "nope"], "--device 'nope'"),
    (["tune", "--batch-size", "0"], "--batch-size"),
    (["tune", "--seq-len", "0"], "--seq-len"),
    (["tune", "--batches", "0"], "--batches"),
    (["tune", "--steps", "1"], "--steps"),
    (["tune", "--rounds", "0"], "--rounds"),
    (["tune", "--timed-steps", "0"], "--timed-steps"),
    (["tune", "--lr", "0"], "--lr"),
    (["tune", "--lr", "inf"], "--lr"),
    (["tune", "--loss-tolerance", "-0.1"], "--loss-tolerance"),
    (["tune", "--budget", "abc"], "--budget"),
    (["tune", "--budget", "-1GiB"], "--budget"),
    (["tune", "--budget", "inf"], "--budget"),
    (["tune", "--candidates", "nope"], "--candidates 'nope'"),
    (["tune", "--candidates", ","], "--candidates ','"),
    (["tune", "--candidates", "bf16,bfloat16"], "given twice"),
    (["tune", "--model", "no_colon"], "--model 'no_colon'"),
    (["tune", "--model", "test_cli:missing"], "--model 'test_cli:missing'"),
    (["tune", "--model", "test_cli:not_a_pair"], "--model 'test_cli:not_a_pair'"),
    (["tune", "--steps", "two"], "--steps"),
    (["bench", "--suites", "nope"], "--suites"),
    (["bench", "--device", "nope"], "--device 'nope'"),
    (["bench", "--suites", "e2e", "--e2e-models", "nope"], "--e2e-models"),
    (["bench", "--suites", "e2e", "--e2e-recipes", "nope"], "--e2e-recipes"),
    (["bench", "--suites", "e2e", "--e2e-modes", "nope"], "--e2e-modes"),
    (["bench", "--e2e-steps", "0"], "--e2e-steps"),
    (["bench", "--reps", "0"], "--reps"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--seeds", "0"], "--seeds"),
    (["demo", "--scenarios", ","], "--scenarios"),
    (["demo", "--recipes", "nope"], "--recipes"),
    (["demo", "--device", "tpu"], "--device"),
    (["info", "--json=1"], "--json"),
])
def test_a_bad_argument_is_one_usage_error_naming_it(argv, flag, capsys):
    """Every command: exit status 2 and an error line naming the argument (argparse's style), no traceback."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    error_lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(error_lines) == 1 and flag in error_lines[0], err
    assert "Traceback" not in err


def test_tune_with_an_unknown_zoo_model_as_a_subprocess(tmp_path):
    here = os.path.dirname(os.path.dirname(os.path.abspath(adaptive_amp.__file__)))
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "adaptive_amp", "tune", "--zoo", "nope"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "python -m adaptive_amp tune: error: --zoo 'nope': unknown family 'nope'; choose one of "
        "gpt2, llama, bert, t5, vit, resnet")


def test_unknown_option_is_an_error(capsys):
    with pytest.raises(SystemExit):
        main(["info", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_demo_forwards_arguments(monkeypatch):
    seen = []
    monkeypatch.setattr(adaptive_amp.demo, "main", lambda argv: seen.append(argv) or 0, raising=False)
    assert main(["demo", "--steps", "5", "--help"]) == 0
    assert seen == [["--steps", "5", "--help"]]


def test_demo_without_entry_point_says_so(monkeypatch, capsys):
    monkeypatch.delattr(adaptive_amp.demo, "main", raising=False)
    assert main(["demo"]) == 2
    assert "adaptive_amp.demo has no main(argv)" in capsys.readouterr().err
