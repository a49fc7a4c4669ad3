"""A fresh clone, installed as the README says (non-editable), run from the clone's root.

The clone's ``adaptive_amp/`` folder (no built extension) comes first on
``sys.path`` under ``python -m``, ahead of the installed copy: the README's
first command must still work, a clone whose code differs must say why it
cannot, and builds must follow their settings (a stale ``build/`` must not be
reused). The install is CPU-only (``ADAPTIVE_AMP_CUDA=0``), uses this
environment's build tools (``--no-build-isolation``) and torch (``--no-deps``),
and goes into a target folder put on ``PYTHONPATH``, which sits behind the
current directory on ``sys.path`` exactly as site-packages does. An editable
install of the checkout running these tests (``pip install -e .``: a finder
on ``sys.meta_path`` that answers for any ``adaptive_amp`` module) is taken
out of the child processes, as in a fresh environment.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Builds and installs a fresh copy of the checkout, then runs the demo from it: minutes (`pytest -m slow`).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("pybind11", reason="the build needs pybind11 (pip install -e '.[test]')")


_NOT_IN_A_CLONE = ("build", "dist", "out", ".git", "__pycache__", ".pytest_cache", ".hypothesis", "_build")


def _tracked_files():
    """The files of a fresh clone: tracked plus new, unignored ones (so uncommitted work is tested too);
    without git, every file but build outputs, caches and environments."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
        return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for folder, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in _NOT_IN_A_CLONE and not d.startswith(".venv")
                       and not d.endswith(".egg-info")]
            rel = Path(folder).relative_to(ROOT)
            files += [str(rel / n) for n in names if not n.endswith((".so", ".o", ".pyc", ".whl"))]
        return files


def _run(cmd, cwd, env=None, timeout=300):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


# Imported at start-up (after the .pth files): drops an editable install's finder for adaptive_amp.
_SITECUSTOMIZE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "adaptive_amp" not in getattr(f, "__module__", "")]
"""


def _env(site=None, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ADAPTIVE_AMP_OPENMP")}
    env.update({"ADAPTIVE_AMP_CUDA": "0", "MPLBACKEND": "Agg"})
    env.update(extra)
    if site is not None:
        shim = Path(site).parent / "no-editable-finder"
        shim.mkdir(exist_ok=True)
        (shim / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join([str(shim), str(site)])
    return env


def _pip_install(clone, target, **extra_env):
    proc = _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps",
                 "--target", str(target), str(clone)], cwd=clone, env=_env(**extra_env), timeout=600)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _build_info(site, cwd):
    code = "import adaptive_amp, json; print(json.dumps(adaptive_amp.build_info()))"
    proc = _run([sys.executable, "-c", code], cwd=cwd, env=_env(site))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    dest = tmp_path_factory.mktemp("fresh") / "adaptive_amp"
    for rel in _tracked_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    assert not list((dest / "adaptive_amp").glob("_C*")), "a fresh clone has no built extension"
    return dest


@pytest.fixture(scope="module")
def site(clone):
    target = clone.parent / "site-packages"
    _pip_install(clone, target)
    return target


def readme_commands():
    """The README's bash blocks under "Set up", one command line each."""
    text = (ROOT / "README.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


def python_part(command: str) -> list:
    """`pip install ... && python -m adaptive_amp demo` -> [sys.executable, "-m", "adaptive_amp", "demo"]."""
    parts = [shlex.split(p) for p in command.split("&&")]
    python = [p for p in parts if p and p[0] in ("python", "python3")]
    assert len(python) == 1, f"expected one python command in {command!r}"
    return [sys.executable, *python[0][1:]]


def test_readme_has_the_two_commands():
    commands = readme_commands()
    assert len(commands) >= 2, commands
    demo, tests = commands[:2]
    assert "pip install" in demo and python_part(demo)[1:] == ["-m", "adaptive_amp", "demo"], demo
    assert "pip install -e" in tests and tests.split("&&")[-1].strip() == "pytest", tests


def test_readme_first_command_runs_from_the_clone_root(clone, site, tmp_path):
    """The README's demo command after a non-editable install, from the clone's root (shortened by options)."""
    cmd = python_part(readme_commands()[0])
    quick = ["--steps", "12", "--seeds", "1", "--timing-rounds", "1", "--no-progress", "--out", str(tmp_path / "demo")]
    proc = _run(cmd + quick, cwd=clone, env=_env(site), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "adaptive_amp demo on cpu" in proc.stdout and (tmp_path / "demo" / "demo.txt").is_file()
    # ... and it ran the installed copy's extension, not a build of the source folder.
    info = _build_info(site, cwd=clone)
    assert Path(info["extension"]).resolve().parent == (site / "adaptive_amp").resolve(), info
    assert not list((clone / "adaptive_amp").glob("_C*"))


def test_a_clone_whose_code_differs_says_what_to_do(clone, site):
    edited = clone / "adaptive_amp" / "debug.py"
    original = edited.read_text()
    edited.write_text(original + "\n# edited after the install\n")
    try:
        proc = _run([sys.executable, "-c", "import adaptive_amp"], cwd=clone, env=_env(site))
    finally:
        edited.write_text(original)
    assert proc.returncode != 0
    message = proc.stderr
    assert "hides the installed package" in message and "debug.py" in message, message
    assert "pip install -e ." in message and "another directory" in message, message
    assert "circular import" not in message, message


def test_build_follows_its_settings_and_caches_objects(clone, site, tmp_path):
    """A build/ left by an earlier build is not reused for other settings, and is reused for the same ones."""
    assert _build_info(site, cwd=tmp_path)["openmp"] > 0, "the default build uses OpenMP"
    no_omp = tmp_path / "site-no-openmp"
    _pip_install(clone, no_omp, ADAPTIVE_AMP_OPENMP="0")  # same clone, same build/ folder
    assert _build_info(no_omp, cwd=tmp_path)["openmp"] == 0, "a stale build/ was reused for other settings"
    # Back to the default settings: their objects are cached (no compile), the extension is relinked.
    proc = _run([sys.executable, "setup.py", "build_ext"], cwd=clone, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = [line for line in proc.stdout.splitlines() if " -c csrc/" in line]
    assert not compiled, f"cached objects were compiled again: {compiled[:2]}"
    assert "-shared" in proc.stdout, "the extension was not relinked for the other settings"
    lib = next((clone / "build").glob("lib.*"))
    assert _build_info(lib, cwd=tmp_path)["openmp"] > 0


def _nvcc():
    return shutil.which("nvcc") or (Path("/usr/local/cuda/bin/nvcc").exists() and "/usr/local/cuda/bin/nvcc")


@pytest.mark.skipif(not _nvcc() or os.environ.get("ADAPTIVE_AMP_TEST_CUDA_BUILD") != "1",
                    reason="builds the CUDA kernels three times (minutes): needs nvcc and ADAPTIVE_AMP_TEST_CUDA_BUILD=1")
def test_cuda_settings_rebuild_what_they_affect(clone, tmp_path):
    """The reported case: ADAPTIVE_AMP_CUDA_ARCHS and ADAPTIVE_AMP_CUDA in a clone built before (no GPU needed)."""
    builds = {}
    for name, env in {"archs90": {"ADAPTIVE_AMP_CUDA": "1", "ADAPTIVE_AMP_CUDA_ARCHS": "90"},
                      "archs80_90": {"ADAPTIVE_AMP_CUDA": "1", "ADAPTIVE_AMP_CUDA_ARCHS": "80;90"},
                      "cpu": {"ADAPTIVE_AMP_CUDA": "0"},
                      "archs90_again": {"ADAPTIVE_AMP_CUDA": "1", "ADAPTIVE_AMP_CUDA_ARCHS": "90"}}.items():
        _pip_install(clone, tmp_path / name, **env)
        builds[name] = _build_info(tmp_path / name, cwd=tmp_path)
    assert builds["archs90"]["cuda_built"] and builds["archs90"]["cuda_archs"] == "90", builds["archs90"]
    assert builds["archs80_90"]["cuda_archs"] == "80;90", builds["archs80_90"]
    assert not builds["cpu"]["cuda_built"] and builds["cpu"]["cuda_archs"] == "", builds["cpu"]
    assert builds["archs90_again"]["cuda_archs"] == "90", builds["archs90_again"]
