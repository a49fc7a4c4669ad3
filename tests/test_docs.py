"""The user guide and the API reference keep up with the code (the Sphinx build itself runs in CI).

Checked here without building: every public name has an entry in the reference, every event kind the code
emits is explained in the guide, the layout page describes every module of the package, and no page speaks
of how the project was developed.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "adaptive_amp"


def _api() -> str:
    return (DOCS / "api.rst").read_text()


def test_every_public_name_has_an_entry_in_the_reference():
    import adaptive_amp

    api = _api()
    missing = [name for name in adaptive_amp.__all__ if name != "__version__"
               and not re.search(rf"^\.\. auto\w+:: adaptive_amp\.{re.escape(name)}\s*$", api, re.M)]
    assert not missing, f"docs/api.rst has no entry for {missing}"
    assert "__version__" in api
    for name in ("adaptive_amp.pressure.MemoryGuard", "adaptive_amp.pressure.train_step",
                 "adaptive_amp.tune.TuneResult", "adaptive_amp.optim.AdamW", "adaptive_amp.optim.SGD"):
        assert re.search(rf"^\.\. auto\w+:: {re.escape(name)}\s*$", api, re.M), name


def test_the_reference_leads_with_what_users_reach_for():
    api = _api()
    order = ["adaptive_amp.GradScaler", "adaptive_amp.AdaptiveMixedPrecision", "adaptive_amp.PrecisionPolicy",
             "adaptive_amp.pressure.MemoryGuard", "adaptive_amp.tune.TuneResult", "adaptive_amp.stochastic_round",
             "adaptive_amp.optim.AdamW", "adaptive_amp.unscale_and_check_"]
    positions = [api.index(f":: {name}\n") for name in order]
    assert positions == sorted(positions), "docs/api.rst: the scaler and the controller first, low-level ops last"


def test_the_controllers_public_methods_have_docstrings():
    """autodoc leaves out a method without a docstring: the reference would not show it."""
    torch = pytest.importorskip("torch")  # noqa: F841
    import adaptive_amp
    from adaptive_amp.pressure import MemoryGuard
    from adaptive_amp.tune import TuneResult

    for cls in (adaptive_amp.AdaptiveMixedPrecision, MemoryGuard, TuneResult):
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if callable(func) and not isinstance(func, type):
                assert inspect.getdoc(func), f"{cls.__name__}.{name} has no docstring"
    assert "progress:" in inspect.getdoc(adaptive_amp.AdaptiveMixedPrecision)


def _emitted_event_kinds() -> set:
    kinds = set()
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in ("bench", "demo", "zoo"):
            continue  # (they run training; they emit nothing of their own)
        text = path.read_text()
        kinds |= set(re.findall(r'^\s+\w*kind = "(\w+)"', text, re.M))
        kinds |= set(re.findall(r'_decide\(\s*"(\w+)"', text))
        kinds |= set(re.findall(r'Event\([^,()]+(?:\([^()]*\))?,\s*"(\w+)"', text))
    kinds.discard("detector")  # the base class's placeholder
    return kinds


def test_every_event_kind_is_explained():
    kinds = _emitted_event_kinds()
    assert {"nan_loss", "promote", "memory_pressure"} <= kinds, kinds  # the scan finds them
    concepts = (DOCS / "guide" / "concepts.rst").read_text()
    missing = sorted(k for k in kinds if f"``{k}``" not in concepts)
    assert not missing, f"docs/guide/concepts.rst does not explain the event kinds {missing}"


def test_the_layout_page_describes_every_module():
    layout = (DOCS / "guide" / "layout.rst").read_text()
    modules = [p.name for p in PACKAGE.glob("*.py")]
    packages = [p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    missing = [name for name in modules + packages if not re.search(rf"^\s+{re.escape(name)}\s", layout, re.M)]
    assert not missing, f"docs/guide/layout.rst does not describe {missing}"


def test_no_page_speaks_of_how_the_project_was_developed():
    pages = [*DOCS.rglob("*.rst"), DOCS / "conf.py", ROOT / "README.md", ROOT / "CHANGELOG.md",
             *(ROOT / "examples").glob("*.py")]
    # (The words of a development history; [e] keeps this file from holding the first of them itself.)
    pattern = re.compile(r"(?i)\bs[e]ssions?\b|\bissues? \d|\bitems? \d+\b|\bbootstrap|\bp-value|\bp = 0\.")
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in pages if "_build" not in p.parts
             for m in pattern.finditer(p.read_text())]
    assert not found, found
