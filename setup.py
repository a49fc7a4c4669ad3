"""Build of adaptive_amp._C: C++17 CPU kernels always, CUDA kernels when nvcc is found.

Needs only setuptools and pybind11 (no torch). Environment variables:

  ADAPTIVE_AMP_CUDA        "auto" (default): CUDA kernels when nvcc is found;
                           "0": CPU-only build; "1": CUDA required (fail without it).
  ADAPTIVE_AMP_CUDA_ARCHS  GPU architectures, e.g. "80;90" (default), "8.6 9.0", "90a".
                           Machine code for each, plus PTX of the newest for later GPUs.
  CUDA_HOME / CUDA_PATH    The CUDA toolkit. Otherwise /usr/local/cuda, then whatever
                           `nvcc` on PATH reports with --dryrun.
  ADAPTIVE_AMP_BUILD_JOBS  Parallel nvcc jobs (default: the number of CPUs).
  ADAPTIVE_AMP_NVCC_FLAGS  Extra nvcc flags (e.g. "-DAAMP_UNSCALE_THREADS=512" for tuning sweeps).
"""

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pybind11
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"
DEFAULT_ARCHS = "80;90"
# Kernel parameter tables up to 32 KB need CUDA 12.1.
MIN_CUDA = (12, 1)


class BuildError(SystemExit):
    """A build problem, said in one line (pip shows SystemExit text as is)."""

    def __init__(self, message):
        super().__init__(f"error: adaptive_amp build: {message}")


def _run(cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _nvcc_top(nvcc):
    """The toolkit root nvcc itself reports (works behind wrapper scripts)."""
    try:
        proc = subprocess.run([nvcc, "--dryrun", "--version"], capture_output=True, text=True, check=False)
    except OSError:
        return None
    match = re.search(r"^#\$ TOP=(.+)$", proc.stdout + proc.stderr, re.MULTILINE)
    return Path(match.group(1)).resolve() if match else None


def find_cuda():
    """(cuda_home, nvcc) or (None, None) when no toolkit is found."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            nvcc = Path(home) / "bin" / "nvcc"
            if not nvcc.exists():
                raise BuildError(f"{var}={home} has no bin/nvcc; point it at a CUDA toolkit or unset it")
            return Path(home), str(nvcc)
    if (Path("/usr/local/cuda") / "bin" / "nvcc").exists():
        return Path("/usr/local/cuda"), "/usr/local/cuda/bin/nvcc"
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None, None
    return _nvcc_top(nvcc) or Path(nvcc).resolve().parent.parent, nvcc


def nvcc_version(nvcc):
    out = _run([nvcc, "--version"])
    match = re.search(r"release (\d+)\.(\d+)", out)
    if not match:
        raise BuildError(f"could not read the version of {nvcc} (got: {out.strip()[:80]!r})")
    return int(match.group(1)), int(match.group(2))


def cudart_static_dir(home):
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        if (home / sub / "libcudart_static.a").exists():
            return home / sub
    raise BuildError(f"no libcudart_static.a under {home} (lib64/, lib/, targets/*/lib); set CUDA_HOME")


def parse_archs(spec):
    """'80;90' / '8.0 9.0' / '90a' -> ['80', '90', ...], sorted."""
    archs = []
    for token in re.split(r"[;,\s]+", spec.strip()):
        if not token:
            continue
        match = re.fullmatch(r"(\d+)\.?(\d)([af]?)(\+PTX)?", token)
        if not match:
            raise BuildError(f"ADAPTIVE_AMP_CUDA_ARCHS: cannot read {token!r}; use e.g. '80;90' or '8.6'")
        archs.append(match.group(1) + match.group(2) + match.group(3))
    if not archs:
        raise BuildError("ADAPTIVE_AMP_CUDA_ARCHS is empty; use e.g. '80;90'")
    return sorted(set(archs), key=lambda a: (int(re.sub(r"\D", "", a)), a))


def gencode_flags(archs):
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    newest = archs[-1]
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")  # PTX for newer GPUs
    return flags


class BuildExt(build_ext):
    def build_extensions(self):
        cxx = self.compiler.compiler_so[0]
        if shutil.which(cxx) is None:
            raise BuildError(f"no C++ compiler found (looked for {cxx!r}); install g++ or set CC/CXX")
        # setuptools compiles .cpp with the C compiler's driver; that is fine for gcc/clang.
        for ext in self.extensions:
            self._add_cuda(ext)
        super().build_extensions()

    def _add_cuda(self, ext):
        mode = os.environ.get("ADAPTIVE_AMP_CUDA", "auto").lower()
        if mode not in ("auto", "0", "1"):
            raise BuildError(f"ADAPTIVE_AMP_CUDA={mode!r}; use auto, 0 or 1")
        cu_sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cu"))
        if mode == "0":
            print("adaptive_amp: ADAPTIVE_AMP_CUDA=0, building CPU kernels only")
            return
        home, nvcc = find_cuda()
        if nvcc is None:
            if mode == "1":
                raise BuildError("ADAPTIVE_AMP_CUDA=1 but nvcc was not found; set CUDA_HOME or put nvcc on PATH")
            print("adaptive_amp: nvcc not found, building CPU kernels only")
            return
        version = nvcc_version(nvcc)
        if version < MIN_CUDA:
            raise BuildError(
                f"nvcc {version[0]}.{version[1]} at {nvcc} is too old: CUDA "
                f"{MIN_CUDA[0]}.{MIN_CUDA[1]}+ is needed; set CUDA_HOME to a newer toolkit or "
                "ADAPTIVE_AMP_CUDA=0 for a CPU-only build"
            )
        archs = parse_archs(os.environ.get("ADAPTIVE_AMP_CUDA_ARCHS", DEFAULT_ARCHS))
        libdir = cudart_static_dir(home)
        print(f"adaptive_amp: CUDA {version[0]}.{version[1]} from {home}, archs {';'.join(archs)} (+PTX)")

        build_temp = Path(self.build_temp) / "cuda"
        build_temp.mkdir(parents=True, exist_ok=True)
        defines = ["-DAAMP_WITH_CUDA", f'-DAAMP_CUDA_ARCHS="{";".join(archs)}"']
        flags = [
            # Exact IEEE behaviour: subnormals kept, no fast math.
            "-O3", "-std=c++17", "-ftz=false", "-prec-div=true", "-prec-sqrt=true", "-lineinfo",
            "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
            f"-I{CSRC}", *defines, *gencode_flags(archs),
            *os.environ.get("ADAPTIVE_AMP_NVCC_FLAGS", "").split(),
        ]

        def compile_one(src):
            obj = build_temp / (Path(src).stem + ".o")
            cmd = [nvcc, "-c", str(ROOT / src), "-o", str(obj), *flags]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout + proc.stderr)
                raise BuildError(f"nvcc failed on {src} (output above)")
            return str(obj)

        jobs = int(os.environ.get("ADAPTIVE_AMP_BUILD_JOBS", os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objects = list(pool.map(compile_one, cu_sources))
        ext.extra_objects.extend(objects)
        ext.define_macros.append(("AAMP_WITH_CUDA", None))
        ext.define_macros.append(("AAMP_CUDA_ARCHS", f'"{";".join(archs)}"'))
        ext.library_dirs.append(str(libdir))
        # Static runtime: the installed package needs only the driver.
        ext.libraries.extend(["cudart_static", "dl", "rt", "pthread"])


ext = Extension(
    "adaptive_amp._C",
    sources=sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp")),
    include_dirs=[str(CSRC), pybind11.get_include()],
    language="c++",
    # -ffp-contract=off: no FMA contraction, so the CPU kernels round every
    # operation once, as the CUDA kernels' _rn intrinsics and torch do.
    extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-fopenmp", "-fno-fast-math", "-ffp-contract=off"],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
