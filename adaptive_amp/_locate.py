"""Finding the native extension when a source folder shadows an installed copy.

``python -m adaptive_amp ...`` run from a clone's root after ``pip install .``
imports the clone's ``adaptive_amp/`` folder (``-m`` and ``-c`` put the
current directory first on ``sys.path``), which has no built ``_C``: the
installed copy is hidden behind it. When that copy holds the same code, the
package is pointed at it (its ``__path__``), so every submodule, ``_C``
included, comes from there; otherwise the error says which two folders are
involved and what to do. Needs the standard library only.
"""

from __future__ import annotations

import filecmp
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES

_NAME = "adaptive_amp"


def _has_extension(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, "_C" + suffix)) for suffix in EXTENSION_SUFFIXES)


def _python_files(folder: str) -> set:
    found = set()
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found.update(os.path.relpath(os.path.join(root, f), folder) for f in files if f.endswith(".py"))
    return found


def code_differences(source: str, installed: str) -> list:
    """The .py files (relative paths) that differ between two copies of the package, or exist in one only."""
    a, b = _python_files(source), _python_files(installed)
    differ = sorted(a ^ b)
    differ += [f for f in sorted(a & b) if not filecmp.cmp(os.path.join(source, f), os.path.join(installed, f),
                                                           shallow=False)]
    return differ


def installed_copies(source: str) -> list:
    """Other folders named adaptive_amp on sys.path that hold a built extension, in sys.path order."""
    seen, found = {os.path.realpath(source)}, []
    for entry in sys.path:
        folder = os.path.join(entry or os.getcwd(), _NAME)
        real = os.path.realpath(folder)
        if real in seen or not os.path.isdir(folder):
            continue
        seen.add(real)
        if _has_extension(folder):
            found.append(folder)
    return found


def find_extension(path: list) -> None:
    """Make ``from . import _C`` work for the package whose ``__path__`` is ``path``, or raise ImportError.

    Nothing happens when the package's folder has a built extension (an
    installed copy, or a checkout built in place).
    """
    here = path[0]
    if _has_extension(here):
        return
    checkout = os.path.dirname(os.path.abspath(here))
    copies = installed_copies(here)
    for installed in copies:
        if not code_differences(here, installed):
            path[:] = [installed]  # the same code, built: every submodule now comes from there
            return
    if copies:
        differ = code_differences(here, copies[0])
        raise ImportError(
            f"adaptive_amp: Python imported the source folder {here}, which has no built native extension "
            f"(_C), instead of the installed copy at {copies[0]}, whose code differs ({len(differ)} files, "
            f"e.g. {differ[0]}). The current directory (or PYTHONPATH) comes first on sys.path, so the "
            f"folder hides the installed package. Either run Python from another directory to use the "
            f"installed copy, or build this folder in place with `pip install -e .` in {checkout} "
            f"(or `pip install .` again there to install this code)."
        )
    raise ImportError(
        f"adaptive_amp: the native extension (_C) is not built in {here} and no installed copy was found on "
        f"sys.path. In a checkout, build it in place with `pip install -e .` in {checkout} (or "
        f"`python setup.py build_ext --inplace`); or install the package with `pip install .` there "
        f"(CPU-only: ADAPTIVE_AMP_CUDA=0 pip install .)."
    )
