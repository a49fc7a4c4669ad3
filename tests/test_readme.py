"""The README keeps its word: its code runs, its install names the extras that exist, it stays a front page."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks() -> list:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no python example"
    return blocks


def first_python_block() -> str:
    return python_blocks()[0]


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


def test_every_python_block_is_valid_python():
    for i, block in enumerate(python_blocks()):
        try:
            ast.parse(block)
        except SyntaxError as exc:
            pytest.fail(f"python block {i} of the README: {exc}\n{block}")


def test_the_stochastic_rounding_op_runs():
    """The quickstart's custom op, as written: unbiased on the way forward, identity on the way back."""
    torch = pytest.importorskip("torch")
    import adaptive_amp

    block = next(b for b in python_blocks() if "class QuantizeSR" in b)
    namespace = {"torch": torch, "adaptive_amp": adaptive_amp}
    exec(block, namespace)
    quantize = namespace["QuantizeSR"]
    torch.manual_seed(0)
    x = torch.randn(4096, requires_grad=True)
    q = quantize.apply(x)
    q.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    mean = torch.stack([quantize.apply(x.detach()) for _ in range(64)]).mean(0)
    assert (mean - x.detach()).abs().mean() < 0.2 * (q.detach() - x.detach()).abs().mean()


def test_the_readme_is_a_front_page():
    assert len(README.read_bytes()) <= 12 * 1024, f"README.md is {len(README.read_bytes())} bytes; keep it <= 12 KB"
    # (That it does not speak of how the project was developed: test_docs.py, over every page and the README.)


def test_the_install_names_every_extra_as_it_installs():
    tomllib = pytest.importorskip("tomllib")
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    text = README.read_text()
    table = text[text.index("| extra |"):].split("\n\n")[0]
    rows = set(re.findall(r"^\| `([\w-]+)` \|", table, re.M))
    assert extras <= rows, f"extras of pyproject.toml missing from the README: {sorted(extras - rows)}"
    assert "pip install -e" in text and "not on PyPI" in text
    assert not re.search(r"pip install ['\"]?adaptive-amp", text), "the package is not on an index"


def test_the_performance_rows_cite_their_run():
    text = README.read_text()
    section = text[text.index("## Performance"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    assert 1 <= len(rows) <= 6, rows
    for row in rows:
        cited = row.split(" | ")[-1]
        assert re.search(r"20\d\d-\d\d-\d\d, [0-9a-f]{7}", cited) or cited.strip(" |") == "as above", row
    assert "H200" in section and "torch 2." in section
    commands = re.findall(r"`(python -m adaptive_amp bench[^`]*)`", section)
    assert len(commands) >= len(rows) - 1, commands


def test_relative_links_exist():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" not in target:
            assert (ROOT / target).exists(), f"the README links to {target}, which is not in the tree"
