"""python -m adaptive_amp info | analyze | demo, called through main() (fast) and once as a subprocess."""

from __future__ import annotations

import json
import os
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
def test_analyze_bad_model_spec(spec, message):
    with pytest.raises(SystemExit, match=message):
        main(["analyze", "--model", spec, "--no-progress"])


def test_analyze_bad_candidates():
    with pytest.raises(SystemExit, match="--candidates 'bf16,fp12'"):
        main(["analyze", "--candidates", "bf16,fp12", "--no-progress"])


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
