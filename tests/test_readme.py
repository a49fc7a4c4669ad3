"""The README's first example runs as written (CPU here; the same code runs on a GPU)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def first_python_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no python example"
    return blocks[0]


def test_the_first_example_is_short_and_leads():
    text = README.read_text()
    code = first_python_block()
    assert text.index("```python") < text.index("## Set up"), "the example comes before the set-up"
    statements = [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(statements) <= 12, f"the leading example has {len(statements)} lines"


def test_the_first_example_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-c", first_python_block()], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    policy, loss = proc.stdout.split()[-2:]
    assert policy.startswith("params=float32,compute=") and float(loss) < 0.5, proc.stdout
