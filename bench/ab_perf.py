"""A/B timing of the experimental tensor_stats variants in ONE build (an experiment, to be removed with them).

    python bench/ab_perf.py [--reps 50]

The variants (csrc/experiments.h) are switched inside this one process through the hidden
`adaptive_amp._C._set_variant(name, value)`; nothing is built. For each variant it captures the calls
in a CUDA graph and times replays with CUDA events (warm-up replays first, the median of --reps timed
replays), on the inputs of `python -m adaptive_amp bench`:

* tensor_stats (variants of "stats") on the GPT-2-small gradient set (148 fp32 tensors, 124M elements,
  rotated over copies if one set fits the L2): all statistics + fp16 format, and no format;
* stochastic_round of 256M fp32 elements to e4m3, e5m2 and bf16 (no variants left: reference rows), and
  torch's `.to()` of each;
* the read ceiling (sum of 1 GiB of fp32) and the copy ceiling (1 GiB copy, read + write counted).

Each variant's results are checked against variant 0 (and against itself, run twice, for determinism):
stats counts/extrema equal, mean/std/l2 within 1e-9 relative to the data's amax (or to the value);
stochastic rounding run twice bitwise equal. Exits non-zero on any mismatch. Runs in well under 2 minutes on an H200.
"""
import argparse
import math
import statistics
import sys
import time

import torch

import adaptive_amp
from adaptive_amp import _C, bench, ops

STATS_VARIANTS = (0, 1)
EXACT_FIELDS = ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "amax", "min_abs_nonzero",
                "overflow_count", "underflow_count", "subnormal_count")
MOMENT_FIELDS = ("mean", "std", "l2_norm", "dynamic_range")


def graph_ms(fn, calls, reps, warmup=5):
    """Median device ms per call of `calls` calls (fn(i)) captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (and allocate) off the capture
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def stats_mismatches(a, b, tag):
    """Differences between two to_dict() results, as messages."""
    bad = []
    for field in a:
        for i, (x, y) in enumerate(zip(a[field], b[field])):
            if isinstance(x, float) and math.isnan(x) and math.isnan(y):
                continue
            if field in EXACT_FIELDS:
                ok = x == y
            else:
                ok = abs(x - y) <= 1e-9 * max(a["amax"][i], abs(x), abs(y))
            if not ok:
                bad.append(f"{tag} tensor {i} {field}: {x!r} vs {y!r}")
    return bad


def bitwise_same(a, b):
    """Two to_dict() results equal bit for bit (NaN equal to NaN)."""
    return all(x == y or (math.isnan(x) and math.isnan(y)) for f in a for x, y in zip(a[f], b[f]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50, help="timed graph replays per row (median; >= 50)")
    ap.add_argument("--numel", type=int, default=256 << 20, help="elements of the stochastic_round input")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    t0 = time.time()
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name(dev)}; adaptive_amp from {adaptive_amp.__file__}")
    rows, failures = [], []  # rows: (group, name, variant, ms, bytes, ceiling GB/s)

    # Ceilings, in graphs like everything else.
    n = (1 << 30) // 4
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    copy_ms = graph_ms(lambda i: dst.copy_(src), 1, args.reps)
    read_ms = graph_ms(lambda i: src.sum(), 1, args.reps)
    copy_gbps, read_gbps = 2 * (1 << 30) / copy_ms / 1e6, (1 << 30) / read_ms / 1e6
    rows.append(("ceiling", "read (sum, 1 GiB)", "-", read_ms, 1 << 30, read_gbps))
    rows.append(("ceiling", "copy (1 GiB, r+w)", "-", copy_ms, 2 << 30, copy_gbps))
    del src, dst

    # tensor_stats on the GPT-2 set (rotated over copies when one set fits 4x the L2, as bench.py does).
    sets, set_bytes = bench._make_sets(bench.gpt2_small_shapes(), dev, torch.float32, 4 * bench._l2_bytes(dev))
    ref = {}
    for v in STATS_VARIANTS:
        _C._set_variant("stats", v)
        for label, fmt in (("stats all + fp16", "float16"), ("stats, no format", None)):
            ms = graph_ms(lambda i: ops.tensor_stats(sets[i % len(sets)], fmt=fmt), len(sets), args.reps)
            rows.append(("stats gpt2", label, v, ms, set_bytes, read_gbps))
            first = ops.tensor_stats(sets[0], fmt=fmt).to_dict()
            again = ops.tensor_stats(sets[0], fmt=fmt).to_dict()
            if not bitwise_same(first, again):
                failures.append(f"stats variant {v} fmt={fmt}: not deterministic run to run")
            if v == STATS_VARIANTS[0]:
                ref[fmt] = first
            else:
                failures += stats_mismatches(ref[fmt], first, f"stats variant {v} fmt={fmt}")[:10]
    _C._set_variant("stats", 0)
    del sets
    torch.cuda.empty_cache()

    # stochastic_round of 256M fp32 (the bench input): e4m3, e5m2, bf16 and .to() of each.
    x = torch.randn(args.numel, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
    moved = {d: args.numel * (4 + torch.tensor([], dtype=d).element_size())
             for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16)}
    e4 = torch.float8_e4m3fn
    got = ops.stochastic_round(x, e4, seed=1234, offset=8).view(torch.uint8)
    again = ops.stochastic_round(x, e4, seed=1234, offset=8).view(torch.uint8)
    if not torch.equal(got, again):
        failures.append("sround e4m3: not deterministic")
    del got, again
    for tag, d in (("e4m3", e4), ("e5m2", torch.float8_e5m2), ("bf16", torch.bfloat16)):
        rows.append(("sround", f"fp32->{tag}", 0, graph_ms(lambda i: ops.stochastic_round(x, d), 1, args.reps),
                     moved[d], copy_gbps))
        rows.append(("sround", f"fp32->{tag} torch .to()", "-", graph_ms(lambda i: x.to(d), 1, args.reps),
                     moved[d], copy_gbps))
    del x
    torch.cuda.empty_cache()

    # The table: ms, GB/s, fraction of the ceiling, and the ratio to variant 0 (stats) or to .to() (sround).
    base = {(g, name): ms for g, name, v, ms, _, _ in rows if v == 0}
    to = {name.split(" ")[0]: ms for g, name, v, ms, _, _ in rows if name.endswith(".to()")}
    print(f"\n{'group':<11} {'row':<26} {'var':>3} {'ms':>8} {'GB/s':>7} {'of ceil':>7} {'vs v0':>6} {'vs .to()':>8}")
    for g, name, v, ms, nbytes, ceil in rows:
        gbps = nbytes / ms / 1e6
        vs0 = f"{ms / base[(g, name)]:.3f}" if (g, name) in base and v != "-" else ""
        vst = f"{ms / to[name]:.3f}x" if g == "sround" and name in to else ""
        print(f"{g:<11} {name:<26} {v!s:>3} {ms:8.4f} {gbps:7.0f} {gbps / ceil:7.1%} {vs0:>6} {vst:>8}")
    ideal = set_bytes / read_gbps / 1e6
    print(f"\nstats target: <= {ideal / 0.8:.4f} ms (80% of read; ideal {ideal:.4f} ms); "
          f"sround target: <= 1.25x .to(). {time.time() - t0:.0f} s.")
    for f in failures[:40]:
        print("FAIL", f)
    print(f"{len(failures)} check failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
