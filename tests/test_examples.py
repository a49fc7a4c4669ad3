"""Every script in examples/ runs to the end (its own asserts check what it claims) and prints its result,
says at its top what it needs, and without it stops with one line that says what to install."""

from __future__ import annotations

import ast
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


# The frameworks of the `integrations` extra (pyproject.toml), by their import names.
FRAMEWORKS = ("transformers", "accelerate", "pytorch_lightning", "lightning")
INTEGRATIONS_EXTRA = 'pip install -e ".[integrations]"'


def _needs_frameworks(script: str) -> bool:
    tree = ast.parse((EXAMPLES / script).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return any(name.split(".")[0] in FRAMEWORKS for name in names)


ALL = sorted({*EXPECTED, *INTEGRATIONS})


@pytest.mark.parametrize("script", ALL)
def test_every_example_says_what_it_needs(script):
    doc = ast.get_docstring(ast.parse((EXAMPLES / script).read_text()))
    if _needs_frameworks(script):
        assert f"Needs the ``integrations`` extra: ``{INTEGRATIONS_EXTRA}``" in doc, doc
    else:
        assert "Needs torch only, no extra" in doc, doc


# Runs an example with some top-level packages made unimportable, as in an environment without them.
_WITHOUT = """
import runpy, sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
sys.argv = [SCRIPT]
runpy.run_path(SCRIPT, run_name="__main__")
"""


@pytest.mark.parametrize("script", ALL)
def test_an_example_without_what_it_needs_says_what_to_install(script):
    if _needs_frameworks(script):
        blocked, expected = FRAMEWORKS, INTEGRATIONS_EXTRA
    else:
        blocked, expected = ("torch",), "pip install torch"
    code = f"BLOCKED = {blocked!r}\nSCRIPT = {str(EXAMPLES / script)!r}\n" + _WITHOUT
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "is missing" in lines[0], proc.stderr[-2000:]
