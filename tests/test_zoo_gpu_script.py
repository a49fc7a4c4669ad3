"""bench/zoo_gpu.py (the lead's GPU run of the zoo at real size) still runs: its CPU smoke mode, tiny models."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script

pytest.importorskip("transformers")


def test_zoo_gpu_script_smoke(tmp_path):
    script = load_bench_script("zoo_gpu")
    status = script.main(["--tiny-cpu", "--no-hook-cost", "--only", "gpt2-small,resnet-small", "--modes", "eager",
                          "--steps", "6", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "zoo_gpu.json").read_text())
    assert status == 0, report
    runs = {r["config"]: r for r in report["results"]}
    assert runs["gpt2-small"]["checks"]["planted"] and runs["gpt2-small"]["ok"]
    assert runs["resnet-small"]["ok"] and runs["resnet-small"]["stats_steps"] == [0, 4]
    assert "PASS" in (tmp_path / "zoo_gpu.txt").read_text()
