"""What the hardware can do natively, as plain data the policy layer decides on.

``HardwareDetector().detect(device)`` returns a frozen :class:`Capabilities`.
Its dtype booleans mean *native* support (tensor cores on a GPU, matrix
instructions on a CPU), not "torch accepts the dtype": a format torch emulates
is slower than float32 and must not be chosen for speed. Tests and reports
build Capabilities directly (``Capabilities(device_type="cuda", ...)``) or load
them from JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

# Native tensor-core support by CUDA compute capability: fp16 came with Volta
# (sm_70), bf16 and tf32 with Ampere (sm_80), fp8 with Ada (sm_89) and Hopper.
# torch.cuda.is_bf16_supported() is not used: it says True on Turing, where
# bf16 is emulated (slow), not native.
_CUDA_MIN_SM = {"fp16": (7, 0), "bf16": (8, 0), "tf32": (8, 0), "fp8": (8, 9)}

# CPU flags (/proc/cpuinfo) of instructions that do the matrix work natively.
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_CPU_FP16_FLAGS = ("avx512_fp16", "amx_fp16")


@dataclass(frozen=True)
class Capabilities:
    """One device's native precision support and size.

    device_type: "cuda" or "cpu". index: the CUDA device index (None on the CPU).
    compute_capability: (major, minor) on CUDA, None elsewhere.
    total_memory: bytes (GPU memory, or physical RAM on the CPU).
    multiprocessors: streaming multiprocessors on a GPU, logical cores on a CPU.
    fp16, bf16, tf32, fp8: native matrix support for each format.
    throughput: measured matmul TFLOP/s by dtype name (empty unless measured).
    """

    device_type: str
    name: str
    compute_capability: Optional[Tuple[int, int]] = None
    total_memory: int = 0
    multiprocessors: int = 0
    fp16: bool = False
    bf16: bool = False
    tf32: bool = False
    fp8: bool = False
    index: Optional[int] = None
    # A dict is not hashable: leave it out of the hash (equality still compares it).
    throughput: Dict[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        # JSON gives lists: keep the capability a tuple so equality and hashing work.
        if self.compute_capability is not None:
            object.__setattr__(self, "compute_capability", tuple(int(v) for v in self.compute_capability))

    def __str__(self) -> str:
        where = self.device_type if self.index is None else f"{self.device_type}:{self.index}"
        lines = [f"device:          {where} ({self.name})"]
        if self.compute_capability is not None:
            lines.append("compute cap.:    sm_%d%d" % self.compute_capability)
        unit = "SMs" if self.device_type == "cuda" else "logical cores"
        lines.append(f"processors:      {self.multiprocessors} {unit}")
        lines.append(f"memory:          {self.total_memory / 2**30:.1f} GiB")
        native = [n for n in ("fp16", "bf16", "tf32", "fp8") if getattr(self, n)]
        lines.append(f"native formats:  {', '.join(native) if native else 'none beyond fp32'}")
        for dtype, tflops in self.throughput.items():
            lines.append(f"matmul {dtype + ':':<9} {tflops:.3g} TFLOP/s")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Capabilities":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown Capabilities field(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Capabilities":
        return cls.from_dict(json.loads(text))


class HardwareDetector:
    """Finds a device's Capabilities (and, on request, its matmul throughput)."""

    def detect(self, device=None, *, measure: bool = False) -> Capabilities:
        """Capabilities of ``device`` (default: the current CUDA device if any, else the CPU).

        measure: also time small matmuls per dtype (a fraction of a second) and
        fill ``throughput`` with TFLOP/s. Off by default: detection stays free.
        """
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda":
            caps = self._detect_cuda(device)
        elif device.type == "cpu":
            caps = self._detect_cpu()
        else:
            raise ValueError(f"HardwareDetector supports 'cuda' and 'cpu' devices, got {str(device)!r}")
        if measure:
            dev = torch.device("cpu") if caps.index is None else torch.device("cuda", caps.index)
            caps = dataclasses.replace(caps, throughput=measure_matmul_tflops(dev, caps))
        return caps

    # ------------------------------------------------------------------ CUDA
    def _detect_cuda(self, device: torch.device) -> Capabilities:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"cannot detect {str(device)!r}: torch reports no usable CUDA device "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                "use detect('cpu') or detect() for the CPU")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"CUDA device index {index} out of range: {torch.cuda.device_count()} device(s)")
        props = torch.cuda.get_device_properties(index)
        cc = (props.major, props.minor)
        if torch.version.hip:
            fp16, bf16, tf32, fp8 = _rocm_formats(getattr(props, "gcnArchName", ""))
        else:
            fp16, bf16, tf32, fp8 = (cc >= _CUDA_MIN_SM[k] for k in ("fp16", "bf16", "tf32", "fp8"))
        return Capabilities(device_type="cuda", name=props.name, compute_capability=cc,
                            total_memory=int(props.total_memory), multiprocessors=int(props.multi_processor_count),
                            fp16=fp16, bf16=bf16, tf32=tf32, fp8=fp8, index=index)

    # ------------------------------------------------------------------ CPU
    def _detect_cpu(self) -> Capabilities:
        name, flags = _read_cpuinfo()
        name = name or platform.processor() or platform.machine() or "unknown CPU"
        # aarch64 lists its BF16 matrix instructions (BFMMLA) as the "bf16" feature.
        bf16 = any(f in flags for f in _CPU_BF16_FLAGS) or (platform.machine() == "aarch64" and "bf16" in flags)
        fp16 = any(f in flags for f in _CPU_FP16_FLAGS)
        return Capabilities(device_type="cpu", name=name, compute_capability=None,
                            total_memory=_physical_memory(), multiprocessors=os.cpu_count() or 1,
                            fp16=fp16, bf16=bf16, tf32=False, fp8=False, index=None)


def _read_cpuinfo(path: str = "/proc/cpuinfo") -> Tuple[str, frozenset]:
    """The first processor's model name and feature flags (empty where there is no /proc)."""
    name, flags = "", frozenset()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:  # x86 / aarch64 spelling
                    flags = frozenset(value.split())
                if name and flags:
                    break
    except OSError:
        pass
    return name, flags


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 0


def _rocm_formats(arch: str) -> Tuple[bool, bool, bool, bool]:
    """fp16, bf16, tf32, fp8 for an AMD GPU by gfx architecture (best effort).

    CDNA2+ (gfx90a, gfx94x, gfx95x) and RDNA3+ (gfx11, gfx12) have bf16 matrix
    cores; fp8 came with gfx94x. torch runs no TF32 on ROCm.
    """
    arch = arch.split(":")[0]
    bf16 = arch.startswith(("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12"))
    fp8 = arch.startswith(("gfx94", "gfx95"))
    return True, bf16, False, fp8


def sleep_cycles_per_ms(device) -> float:
    """Cycles of ``torch.cuda._sleep`` a millisecond on the CUDA device `device`, measured now (the clock varies):
    how long to keep the GPU waiting while the host queues work, so that CUDA events around that work time the
    GPU's alone."""
    cycles = 20_000_000
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1)  # (its first launch loads the kernel: not inside the timed one)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / start.elapsed_time(end)


def measure_matmul_tflops(device: torch.device, caps: Capabilities, n: Optional[int] = None,
                          seconds: float = 0.05) -> Dict[str, float]:
    """Matmul TFLOP/s for float32 and each 16-bit format, on small square matrices.

    A rough number for comparing formats on one device, not a benchmark:
    n defaults to 2048 on a GPU and 256 on the CPU, each dtype runs about
    ``seconds`` after a warm-up. "tf32" is float32 with TF32 allowed (GPUs with it).
    """
    on_gpu = device.type == "cuda"
    n = n or (2048 if on_gpu else 256)
    runs = [("float32", torch.float32, False), ("float16", torch.float16, False),
            ("bfloat16", torch.bfloat16, False)]
    if caps.tf32:
        runs.insert(1, ("tf32", torch.float32, True))
    sync = torch.cuda.synchronize if on_gpu else (lambda *a: None)
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    result = {}
    try:
        for label, dtype, allow_tf32 in runs:
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            torch.mm(a, b)  # warm-up: kernel selection and library loading are not throughput
            sync(device)
            iters, start = 0, time.perf_counter()
            while True:
                torch.mm(a, b)
                iters += 1
                if iters % 4 == 0:  # check the clock rarely so it doesn't cost more than the mm
                    sync(device)
                    elapsed = time.perf_counter() - start
                    if elapsed >= seconds:
                        break
            result[label] = 2.0 * n**3 * iters / elapsed / 1e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    return result
