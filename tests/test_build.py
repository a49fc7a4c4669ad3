"""The built extension: what it links against, what it reports, and that it works without torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import adaptive_amp

elffile = pytest.importorskip("elftools.elf.elffile")

# Anything torch ships, and the shared CUDA runtime (the build links cudart statically).
FORBIDDEN_PREFIXES = ("libtorch", "libc10", "libtorch_python", "libcudart.so", "libtorch_cpu", "libtorch_cuda")


def _needed(path):
    with open(path, "rb") as f:
        elf = elffile.ELFFile(f)
        needed = []
        for section in elf.iter_sections():
            if section.header.sh_type == "SHT_DYNAMIC":
                needed.extend(tag.needed for tag in section.iter_tags("DT_NEEDED"))
        return needed


def test_extension_is_a_shared_object_with_dynamic_section():
    path = adaptive_amp._C.__file__
    assert os.path.isfile(path)
    needed = _needed(path)
    # Sanity: the parser found the dynamic section (every extension needs libc).
    assert any(n.startswith("libc.so") for n in needed), needed


@pytest.mark.parametrize("prefix", FORBIDDEN_PREFIXES)
def test_extension_does_not_need(prefix):
    needed = _needed(adaptive_amp._C.__file__)
    offenders = [n for n in needed if n.startswith(prefix)]
    assert not offenders, f"{adaptive_amp._C.__file__} needs {offenders} (DT_NEEDED: {needed})"


def test_extension_needs_no_shared_cudart_of_any_version():
    needed = _needed(adaptive_amp._C.__file__)
    assert not [n for n in needed if n.startswith("libcudart")], needed


def test_build_info_keys_and_types():
    info = adaptive_amp.build_info()
    for key in ("cuda_built", "cuda_archs", "cuda_runtime_version", "version"):
        assert key in info, f"build_info() lacks {key!r}: {sorted(info)}"
    assert isinstance(info["cuda_built"], bool)
    assert isinstance(info["cuda_archs"], str)
    assert isinstance(info["cuda_runtime_version"], int)
    assert info["version"] == adaptive_amp.__version__
    if info["cuda_built"]:
        assert info["cuda_archs"], "a CUDA build names its architectures"
        assert info["cuda_runtime_version"] >= 12010, "kernel parameter tables need CUDA 12.1+"
    else:
        assert info["cuda_runtime_version"] == 0


def test_cuda_available_is_bool():
    value = adaptive_amp.cuda_available()
    assert isinstance(value, bool)
    if value:
        assert adaptive_amp.build_info()["cuda_built"]


def test_unscale_chunk_exposed():
    assert adaptive_amp.UNSCALE_CHUNK == 16384


def test_import_and_run_without_torch(tmp_path):
    """`import adaptive_amp` and the op on numpy arrays work with torch blocked."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import numpy as np
        import adaptive_amp
        assert "torch" not in sys.modules or sys.modules["torch"] is None

        rng = np.random.default_rng(0)
        x32 = rng.standard_normal(40000).astype(np.float32)
        x16 = rng.standard_normal(1000).astype(np.float16)
        x32[12345] = np.inf
        a32, a16 = x32.copy(), x16.copy()
        found = np.zeros(1, np.float32)
        inv = np.array([0.25], np.float32)
        sumsq, amax = adaptive_amp.unscale_and_check_([a32, a16], found, inv, return_stats=True)
        assert found[0] == 1.0, found
        exp32 = (x32 * np.float32(0.25)).astype(np.float32)
        assert np.array_equal(a32.view(np.int32), exp32.view(np.int32))
        exp16 = (x16.astype(np.float32) * np.float32(0.25)).astype(np.float16)
        assert np.array_equal(a16.view(np.int16), exp16.view(np.int16))
        assert isinstance(sumsq, np.ndarray) and isinstance(amax, np.ndarray)
        assert sumsq.dtype == np.float32 and amax.dtype == np.float32
        assert sumsq.shape == (2,) and amax.shape == (2,)
        assert np.isinf(amax[0]) and amax[1] == np.abs(exp16.astype(np.float32)).max()
        info = adaptive_amp.build_info()
        assert "torch" not in sys.modules or sys.modules["torch"] is None
        print("OK", info["version"])
        """
    )
    # The copy under test (built in place or installed), from a folder that cannot shadow it.
    here = os.path.dirname(os.path.dirname(os.path.abspath(adaptive_amp.__file__)))
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


def test_build_info_names_the_loaded_extension():
    info = adaptive_amp.build_info()
    assert info["extension"] == adaptive_amp._C.__file__ and os.path.isfile(info["extension"])


# --------------------------------------------------------------------------- a source folder shadowing an install


def _package(folder, files, built):
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    if built:
        from importlib.machinery import EXTENSION_SUFFIXES

        (folder / ("_C" + EXTENSION_SUFFIXES[0])).write_bytes(b"")  # only its presence is looked at


FILES = {"__init__.py": "x = 1\n", "ops.py": "y = 2\n", "bench/__init__.py": ""}


def test_a_source_folder_hands_over_to_an_installed_copy_of_the_same_code(tmp_path, monkeypatch):
    from adaptive_amp._locate import find_extension

    source, installed = tmp_path / "clone" / "adaptive_amp", tmp_path / "site" / "adaptive_amp"
    _package(source, FILES, built=False)
    _package(installed, FILES, built=True)
    monkeypatch.setattr(sys, "path", [str(source.parent), str(installed.parent)])
    path = [str(source)]
    find_extension(path)
    assert path == [str(installed)]


def test_a_source_folder_that_differs_from_the_installed_copy_says_what_to_do(tmp_path, monkeypatch):
    from adaptive_amp._locate import find_extension

    source, installed = tmp_path / "clone" / "adaptive_amp", tmp_path / "site" / "adaptive_amp"
    _package(source, dict(FILES, **{"ops.py": "y = 3\n"}), built=False)
    _package(installed, FILES, built=True)
    monkeypatch.setattr(sys, "path", ["", str(installed.parent)])
    monkeypatch.chdir(source.parent)
    path = [str(source)]
    with pytest.raises(ImportError) as info:
        find_extension(path)
    message = str(info.value)
    assert str(source) in message and str(installed) in message and "ops.py" in message
    assert "another directory" in message and f"pip install -e .` in {source.parent}" in message
    assert path == [str(source)]


def test_a_source_folder_without_any_build_says_how_to_build(tmp_path, monkeypatch):
    from adaptive_amp._locate import find_extension

    source = tmp_path / "clone" / "adaptive_amp"
    _package(source, FILES, built=False)
    monkeypatch.setattr(sys, "path", [str(source.parent)])
    with pytest.raises(ImportError, match=r"not built in .*pip install -e \.` in .*ADAPTIVE_AMP_CUDA=0 pip install \."):
        find_extension([str(source)])


def test_a_built_folder_is_left_alone(tmp_path, monkeypatch):
    from adaptive_amp._locate import find_extension

    source, installed = tmp_path / "clone" / "adaptive_amp", tmp_path / "site" / "adaptive_amp"
    _package(source, FILES, built=True)
    _package(installed, FILES, built=True)
    monkeypatch.setattr(sys, "path", [str(source.parent), str(installed.parent)])
    path = [str(source)]
    find_extension(path)
    assert path == [str(source)]
