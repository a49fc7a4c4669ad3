"""Per-step op counts of a training loop from torch.profiler, for the scripts that compare two loops op by op
(bench/e2e_ops.py, bench/tuned_gap.py)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Dict, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_steps(step: Callable[[int], object], n: int, cuda: bool) -> Tuple[Dict[str, List[float]], float, float]:
    """Runs step(0) .. step(n - 1) under torch.profiler. Returns, per step: {kernel: [launches, device us]} (on
    the CPU: {aten op: [calls, 0]}), host-to-device synchronizations, and wall ms (synchronized before and
    after)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(n):
            step(i)
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / n
    kernels = defaultdict(lambda: [0, 0.0])
    syncs = 0
    for e in prof.events():
        device = getattr(e, "device_type", None)
        if cuda and device is not None and device.name == "CUDA":
            k = kernels[e.name]
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        elif not cuda and e.name.startswith("aten::"):
            kernels[e.name][0] += 1
        if e.name in _SYNCS:
            syncs += 1
    return {name: [c / n, us / n] for name, (c, us) in kernels.items()}, syncs / n, wall
