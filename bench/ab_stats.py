"""One line of tensor_stats timings, for side-by-side (A/B) runs of kernel variants.

    python bench/ab_stats.py LABEL

Times the adaptive_amp on sys.path (so several builds installed with
``pip install --target DIR`` can run in turn with ``PYTHONPATH=DIR``) with
the bench's own timer and sets: the GPT-2-small set and the 2000 x 4096 set,
fp32, with an fp16 format and without, CUDA-graph replay, median of three,
each against the read ceiling measured in the same process. Run the builds
round robin on one machine; the ceiling moves by a few percent between
processes, so compare milliseconds first.
"""

from __future__ import annotations

import statistics
import sys

import torch

import adaptive_amp
from adaptive_amp.bench.kernels import _ceilings, _GpuTimer, _l2_bytes, _make_sets, gpt2_small_shapes, many_small_shapes


def main(label: str) -> str:
    timer = _GpuTimer(5, 40)
    _, read_gbps = _ceilings("cuda", timer)
    fields = [label, f"read {read_gbps:.0f}"]
    for key, shapes in (("gpt2", gpt2_small_shapes()), ("many", many_small_shapes())):
        sets, nbytes = _make_sets(shapes, "cuda", torch.float32, 4 * _l2_bytes("cuda"))
        for fmt in ("float16", None):
            def call(i, fmt=fmt):
                adaptive_amp.tensor_stats(sets[i % len(sets)], fmt=fmt)

            times = [timer.graph(call, len(sets)) for _ in range(3)]
            if None in times:
                sys.exit("bench/ab_stats.py: CUDA graph capture failed on this machine")
            ms = statistics.median(times)
            fields.append(f"{key}/{fmt}: {ms:.4f} ms {nbytes / ms / 1e6 / read_gbps:.1%}")
        del sets
        torch.cuda.empty_cache()
    return " | ".join(fields)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("bench/ab_stats.py needs a CUDA GPU")
    print(main(sys.argv[1] if len(sys.argv) > 1 else "build"), flush=True)
