"""Every script in examples/ runs to the end (its own asserts check what it claims) and prints its result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each example runs in a fresh interpreter: seconds each (`pytest -m slow`).
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# script -> a line its output must contain
EXPECTED = {
    "gpt2_grad_scaler.py": "skipped steps 0",
    "compiled_adaptive.py": "in 60 compiled steps",
    "bf16_pure_adamw.py": "adaptive_amp AdamW (SR)",
    "sround_autograd.py": "training through the fp8 quantizer",
    "find_overflow.py": "the layer that overflows fp16: blow_up",
}


# The integrations' examples, run by tests/test_examples_integrations.py with the frameworks' arguments.
INTEGRATIONS = {"lightning_gpt2.py", "hf_trainer_gpt2.py", "accelerate_gpt2.py"}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted({*EXPECTED, *INTEGRATIONS})
    runner = (Path(__file__).parent / "test_examples_integrations.py").read_text()
    assert all(f'"{name}"' in runner for name in INTEGRATIONS)


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script, tmp_path):
    if script == "gpt2_grad_scaler.py":
        pytest.importorskip("transformers")
    env = dict(os.environ, MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert EXPECTED[script] in proc.stdout, proc.stdout[-3000:]
