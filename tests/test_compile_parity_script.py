"""bench/compile_parity.py (eager against compiled, issue 21) still runs: its CPU smoke mode, the tiny Llama."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script

pytest.importorskip("transformers")


def test_compile_parity_script_smoke(tmp_path):
    out = tmp_path / "parity.json"
    report = load_bench_script("compile_parity").main(["--tiny", "--device", "cpu", "--warm-steps", "2", "--batch",
                                                       "2", "--seq", "16", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    # The compiled model is the same model: fp32 agrees to rounding, and no position sees a later token.
    assert report["logits_fp32_max_diff"] < 1e-4 * max(1.0, report["logits_fp32_max_abs"])
    assert report["causal_leak_fp32_eager"] == report["causal_leak_fp32_compiled"] == 0.0
    errors = report["grad_rel_error_vs_fp32_eager"]
    assert errors["compiled_fp32"]["all"] < 1e-4
    assert 0 < errors["eager_bf16"]["all"] < 0.2 and 0 < errors["compiled_bf16"]["all"] < 0.2
