"""Build of adaptive_amp._C: C++17 CPU kernels always, CUDA kernels when nvcc is found.

Needs only setuptools and pybind11 (no torch). Environment variables:

  ADAPTIVE_AMP_CUDA        "auto" (default): CUDA kernels when nvcc is found;
                           "0": CPU-only build; "1": CUDA required (fail without it).
  ADAPTIVE_AMP_CUDA_ARCHS  GPU architectures, e.g. "80;90" (default), "8.6 9.0", "90a".
                           Machine code for each, plus PTX of the newest for later GPUs.
  CUDA_HOME / CUDA_PATH    The CUDA toolkit. Otherwise /usr/local/cuda, then whatever
                           `nvcc` on PATH reports with --dryrun.
  ADAPTIVE_AMP_BUILD_JOBS  Parallel compiler jobs, C++ and nvcc (default: the number of CPUs).
  ADAPTIVE_AMP_NVCC_FLAGS  Extra nvcc flags (e.g. "-DAAMP_UNSCALE_THREADS=512" for tuning sweeps).
  ADAPTIVE_AMP_OPENMP      "1" (default): parallel CPU kernels; "0": no OpenMP (e.g. a compiler without it).

Builds are keyed by these settings: objects live in build/temp.*/<key>/, so
switching settings never reuses objects built for other ones (and switching
back reuses the cached ones), and the extension is relinked whenever the
settings it was built with differ from the current ones (a stamp per output
file records them). An object is compiled only when its source or a csrc
header is newer: a rebuild after a Python-only change, or `pip install -e .`
again, compiles nothing. C++ and CUDA sources compile in parallel.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
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


def cuda_settings():
    """The CUDA part of the build from the environment: None for a CPU-only build, else a dict."""
    mode = os.environ.get("ADAPTIVE_AMP_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise BuildError(f"ADAPTIVE_AMP_CUDA={mode!r}; use auto, 0 or 1")
    if mode == "0":
        print("adaptive_amp: ADAPTIVE_AMP_CUDA=0, building CPU kernels only")
        return None
    home, nvcc = find_cuda()
    if nvcc is None:
        if mode == "1":
            raise BuildError("ADAPTIVE_AMP_CUDA=1 but nvcc was not found; set CUDA_HOME or put nvcc on PATH")
        print("adaptive_amp: nvcc not found, building CPU kernels only")
        return None
    version = nvcc_version(nvcc)
    if version < MIN_CUDA:
        raise BuildError(
            f"nvcc {version[0]}.{version[1]} at {nvcc} is too old: CUDA "
            f"{MIN_CUDA[0]}.{MIN_CUDA[1]}+ is needed; set CUDA_HOME to a newer toolkit or "
            "ADAPTIVE_AMP_CUDA=0 for a CPU-only build"
        )
    return {"home": str(home), "nvcc": str(nvcc), "version": list(version),
            "archs": parse_archs(os.environ.get("ADAPTIVE_AMP_CUDA_ARCHS", DEFAULT_ARCHS)),
            "nvcc_flags": os.environ.get("ADAPTIVE_AMP_NVCC_FLAGS", "").split()}


def openmp_setting():
    value = os.environ.get("ADAPTIVE_AMP_OPENMP", "1")
    if value not in ("0", "1"):
        raise BuildError(f"ADAPTIVE_AMP_OPENMP={value!r}; use 1 (default) or 0")
    return value == "1"


def settings_key(settings):
    """A short name for a set of build settings (the folder of their objects)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def build_jobs():
    return max(1, int(os.environ.get("ADAPTIVE_AMP_BUILD_JOBS", os.cpu_count() or 1)))


def newest_mtime(paths):
    return max((os.path.getmtime(p) for p in paths), default=0.0)


class BuildExt(build_ext):
    def build_extensions(self):
        cxx = self.compiler.compiler_so[0]
        if shutil.which(cxx) is None:
            raise BuildError(f"no C++ compiler found (looked for {cxx!r}); install g++ or set CC/CXX")
        # setuptools compiles .cpp with the C compiler's driver; that is fine for gcc/clang.
        cuda = cuda_settings()
        openmp = openmp_setting()
        settings = {"cuda": cuda, "openmp": openmp, "cxx": self.compiler.compiler_so,
                    "flags": [os.environ.get(v, "") for v in ("CFLAGS", "CPPFLAGS", "LDFLAGS")],
                    "python": sys.implementation.cache_tag}
        key = settings_key(settings)
        # Objects per settings: setuptools would otherwise link objects built for other settings.
        stamps = Path(self.build_temp) / "settings-stamps"
        self.build_temp = str(Path(self.build_temp) / key)
        for ext in self.extensions:
            if openmp:
                ext.extra_compile_args.append("-fopenmp")
                ext.extra_link_args.append("-fopenmp")
            else:
                ext.extra_compile_args.append("-Wno-unknown-pragmas")
            if cuda is not None:
                self._add_cuda(ext, cuda)
            target = Path(self.get_ext_fullpath(ext.name)).resolve()
            stamp = stamps / (hashlib.sha256(str(target).encode()).hexdigest()[:16] + ".json")
            # setuptools skips an extension whose file is newer than its sources, whatever it was
            # built with: relink when the settings (or the file) differ from what the stamp says.
            if not self._stamp_matches(stamp, target, key):
                self.force = True
                self.compiler.force = True  # the linker, too, skips an output newer than its objects
        self._compile_in_parallel_with_cache()
        super().build_extensions()
        stamps.mkdir(parents=True, exist_ok=True)
        for ext in self.extensions:
            target = Path(self.get_ext_fullpath(ext.name)).resolve()
            stamp = stamps / (hashlib.sha256(str(target).encode()).hexdigest()[:16] + ".json")
            stamp.write_text(json.dumps({"target": str(target), "key": key, "settings": settings,
                                         "mtime": target.stat().st_mtime}, indent=1))

    def _compile_in_parallel_with_cache(self):
        """setuptools compiles every source, one after the other: compile only the objects older
        than their source or a header, in parallel (the folder is per settings, so flags match)."""
        compiler = self.compiler
        if not all(hasattr(compiler, name) for name in ("_setup_compile", "_get_cc_args", "_compile")):
            return  # another compiler class: setuptools' own way

        def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=False, extra_preargs=None,
                    extra_postargs=None, depends=None):
            macros, objects, extra, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs)
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
            headers = newest_mtime(CSRC.glob("*.h"))

            def one(obj):
                src, ext = build[obj]
                if os.path.exists(obj) and os.path.getmtime(obj) > max(headers, os.path.getmtime(src)):
                    return
                partial = obj + ".partial"  # an interrupted compile must not look cached
                compiler._compile(partial, src, ext, cc_args, extra, pp_opts)
                os.replace(partial, obj)

            with ThreadPoolExecutor(max_workers=build_jobs()) as pool:
                list(pool.map(one, objects))
            return objects

        compiler.compile = compile

    @staticmethod
    def _stamp_matches(stamp, target, key):
        if not target.exists() or not stamp.exists():
            return False
        try:
            recorded = json.loads(stamp.read_text())
        except ValueError:
            return False
        return recorded.get("key") == key and recorded.get("mtime") == target.stat().st_mtime

    def _add_cuda(self, ext, cuda):
        cu_sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cu"))
        home, nvcc, version = Path(cuda["home"]), cuda["nvcc"], tuple(cuda["version"])
        archs = cuda["archs"]
        libdir = cudart_static_dir(home)
        print(f"adaptive_amp: CUDA {version[0]}.{version[1]} from {home}, archs {';'.join(archs)} (+PTX)")

        build_temp = Path(self.build_temp) / "cuda"
        build_temp.mkdir(parents=True, exist_ok=True)
        defines = ["-DAAMP_WITH_CUDA", f'-DAAMP_CUDA_ARCHS="{";".join(archs)}"']
        flags = [
            # Exact IEEE behaviour: subnormals kept, no fast math.
            "-O3", "-std=c++17", "-ftz=false", "-prec-div=true", "-prec-sqrt=true", "-lineinfo",
            "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
            f"-I{CSRC}", *defines, *gencode_flags(archs), *cuda["nvcc_flags"],
        ]
        # An object is current when it is newer than its .cu and every header (the folder is per settings).
        headers = newest_mtime([*CSRC.glob("*.h"), *CSRC.glob("*.cuh")])

        def compile_one(src):
            obj = build_temp / (Path(src).stem + ".o")
            if obj.exists() and obj.stat().st_mtime > max(headers, os.path.getmtime(ROOT / src)):
                return str(obj), False
            partial = obj.with_suffix(".o.partial")  # an interrupted compile must not look cached
            cmd = [nvcc, "-c", str(ROOT / src), "-o", str(partial), *flags]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout + proc.stderr)
                raise BuildError(f"nvcc failed on {src} (output above)")
            os.replace(partial, obj)
            return str(obj), True

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=build_jobs()) as pool:
            done = list(pool.map(compile_one, cu_sources))
        objects = [obj for obj, _ in done]
        compiled = sum(fresh for _, fresh in done)
        print(f"adaptive_amp: CUDA kernels: {compiled} of {len(done)} objects compiled "
              f"({time.perf_counter() - start:.0f} s), the rest cached in {build_temp}")
        ext.extra_objects.extend(objects)
        ext.define_macros.append(("AAMP_WITH_CUDA", None))
        ext.define_macros.append(("AAMP_CUDA_ARCHS", f'"{";".join(archs)}"'))
        ext.library_dirs.append(str(libdir))
        # Static runtime: the installed package needs only the driver.
        ext.libraries.extend(["cudart_static", "dl", "rt", "pthread"])


ext = Extension(
    "adaptive_amp._C",
    sources=sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp")),
    # Headers and CUDA sources: a change to any of them rebuilds the extension.
    depends=sorted(str(p.relative_to(ROOT)) for pattern in ("*.h", "*.cuh", "*.cu") for p in CSRC.glob(pattern)),
    include_dirs=[str(CSRC), pybind11.get_include()],
    language="c++",
    # -ffp-contract=off: no FMA contraction, so the CPU kernels round every
    # operation once, as the CUDA kernels' _rn intrinsics and torch do.
    # (-fopenmp is added by BuildExt unless ADAPTIVE_AMP_OPENMP=0.)
    extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-fno-fast-math", "-ffp-contract=off"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
