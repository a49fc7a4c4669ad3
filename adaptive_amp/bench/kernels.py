"""Kernel microbenchmarks: our ops side by side with torch and the device ceiling.

Every suite times, in one run: our kernel (each mode), the torch equivalent,
the pure-torch reference, and the ceiling of the device measured in the same
run (a large copy for read+write ops, a large reduction for read-only ops).
GPU times come from CUDA events after a warm-up, as medians, in two forms:

* ``eager``: one call as a training loop makes it, host overhead included;
* ``graph``: the same calls captured in a CUDA graph and replayed, i.e. the
  device time alone (how it runs inside a captured training step).

Inputs are random (never zeros) and, where one set would fit in L2, rotated
over several copies so that the cache does not flatter anyone.

Run ``python -m adaptive_amp bench`` (:mod:`adaptive_amp.bench.cli`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from .. import ops, reference


@dataclass
class Row:
    suite: str
    name: str
    mode: str  # "eager", "graph" or "cpu"
    ms: float
    bytes_moved: int
    gbps: float
    ceiling_fraction: Optional[float]  # of the copy (read+write) or read ceiling
    spread_ms: Optional[float] = None  # interquartile range of the repetitions, where measured


def time_ratio(ours: Row, base: Row, what: str) -> str:
    """``"1.10x torch's time"``, or "no measurable difference" when the gap is inside the two spreads.

    Always the same direction (our time over theirs: above 1 is slower), so a ratio never reads
    "0.97x faster".
    """
    if ours.spread_ms is not None and base.spread_ms is not None and \
            abs(ours.ms - base.ms) <= ours.spread_ms + base.spread_ms:
        return (f"no measurable difference from {what} ({ours.ms:.3f} +- {ours.spread_ms:.3f} ms against "
                f"{base.ms:.3f} +- {base.spread_ms:.3f})")
    return f"{ours.ms / base.ms:.2f}x {what}'s time"


def gpt2_small_shapes() -> List[tuple]:
    """The 148 parameter shapes of GPT-2 small (124M elements)."""
    d, ff, vocab, ctx = 768, 3072, 50257, 1024
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, ff), (ff,), (ff, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


def many_small_shapes(count: int = 2000, size: int = 4096) -> List[tuple]:
    return [(size,)] * count


SUITES = {
    "gpt2": ("GPT-2 small gradients (148 tensors, fp32)", gpt2_small_shapes),
    "many": ("2000 tensors of 4096 fp32", many_small_shapes),
}


def _make_sets(shapes, device, dtype, min_bytes):
    """Enough copies of the tensor list to exceed `min_bytes` (outrun the L2 cache)."""
    one = sum(torch.Size(s).numel() for s in shapes) * torch.tensor([], dtype=dtype).element_size()
    copies = max(1, -(-min_bytes // one))
    gen = torch.Generator(device=device).manual_seed(0)
    return [[torch.randn(s, device=device, dtype=dtype, generator=gen) for s in shapes] for _ in range(copies)], one


def _l2_bytes(device) -> int:
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "L2_cache_size", 50 << 20)


class _GpuTimer:
    def __init__(self, warmup: int, reps: int):
        self.warmup, self.reps = warmup, reps

    def eager(self, fn: Callable[[int], None]) -> float:
        for i in range(self.warmup):
            fn(i)
        torch.cuda.synchronize()
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(self.reps):
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def graph(self, fn: Callable[[int], None], calls: int) -> Optional[float]:
        """Median device time per call of `calls` calls captured in one graph."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up off the capture
                for i in range(calls):
                    fn(i)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(calls):
                    fn(i)
        except RuntimeError:
            return None  # not capturable (the pure-torch reference syncs)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(max(3, self.reps // 4)):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        del graph
        return statistics.median(times)


def _gpu_setup(device, warmup: int, reps: int):
    """The CUDA device to time on (made current; "cuda" means the current one) and a timer."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device, _GpuTimer(warmup, reps)


def _ceilings(device, timer: _GpuTimer, nbytes: int = 1 << 30):
    """(copy GB/s counting read+write, read-only GB/s) measured now on `device`."""
    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer.eager(lambda i: dst.copy_(src))
    read_ms = timer.eager(lambda i: src.sum())
    del src, dst
    return 2 * nbytes / copy_ms / 1e6, nbytes / read_ms / 1e6


def unscale_gpu(suites=("gpt2", "many"), device="cuda", warmup=10, reps=50, progress=print) -> List[Row]:
    """The unscale-and-check suite on a CUDA device."""
    device, timer = _gpu_setup(device, warmup, reps)
    copy_gbps, read_gbps = _ceilings(device, timer)
    rows = [Row("ceiling", "device copy (read+write)", "eager", 0.0, 0, copy_gbps, 1.0),
            Row("ceiling", "device reduction (read)", "eager", 0.0, 0, read_gbps, 1.0)]
    progress(f"ceilings: copy {copy_gbps:.0f} GB/s, read {read_gbps:.0f} GB/s")
    found = torch.zeros(1, device=device)
    # Alternating 0.5 and 2.0 keeps the data exactly as it was every two calls.
    invs = [torch.tensor([0.5], device=device), torch.tensor([2.0], device=device)]
    for key in suites:
        title, shapes = SUITES[key]
        sets, set_bytes = _make_sets(shapes(), device, torch.float32, 4 * _l2_bytes(device))
        progress(f"{title}: {len(sets)} rotating set(s) of {set_bytes / 1e6:.0f} MB")

        def pick(i):
            return sets[(i // 2) % len(sets)], invs[i % 2]

        def ours(check_only=False, stats=False):
            def fn(i):
                ts, inv = pick(i)
                ops.unscale_and_check_(ts, found, inv, check_only=check_only, return_stats=stats)
            return fn

        def torch_unscale(i):
            ts, inv = pick(i)
            torch._amp_foreach_non_finite_check_and_unscale_(ts, found, inv)

        def torch_norm(i):
            ts, _ = pick(i)
            torch._foreach_norm(ts)

        def ref(i):
            ts, inv = pick(i)
            reference.unscale_and_check_(ts, found, inv)

        candidates = [
            ("adaptive_amp unscale", ours(), 2, copy_gbps),
            ("adaptive_amp unscale+stats", ours(stats=True), 2, copy_gbps),
            ("adaptive_amp check-only", ours(check_only=True), 1, read_gbps),
            ("adaptive_amp check-only+stats", ours(check_only=True, stats=True), 1, read_gbps),
            ("torch _amp_foreach_non_finite_check_and_unscale_", torch_unscale, 2, copy_gbps),
            ("torch _foreach_norm", torch_norm, 1, read_gbps),
            ("pure-torch reference", ref, 2, copy_gbps),
        ]
        calls = 2 * len(sets)
        for name, fn, passes, ceiling in candidates:
            moved = passes * set_bytes
            is_ref = name.startswith("pure-torch")
            eager_ms = _GpuTimer(2, 5).eager(fn) if is_ref else timer.eager(fn)
            rows.append(Row(key, name, "eager", eager_ms, moved, moved / eager_ms / 1e6, moved / eager_ms / 1e6 / ceiling))
            graph_ms = None if is_ref else timer.graph(fn, calls)
            if graph_ms is not None:
                rows.append(Row(key, name, "graph", graph_ms, moved, moved / graph_ms / 1e6,
                                moved / graph_ms / 1e6 / ceiling))
            progress(f"  {name}: eager {eager_ms:.3f} ms" + (f", graph {graph_ms:.3f} ms" if graph_ms else ""))
        del sets
        torch.cuda.empty_cache()
    return rows


def _cpu_times(fn, warmup, reps):
    """(median, interquartile range) of `reps` timed calls, in ms."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(max(reps, 4)):
        t0 = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t0) * 1e3)
    q1, _, q3 = statistics.quantiles(times, n=4)
    return statistics.median(times), q3 - q1


def _cpu_time(fn, warmup, reps):
    return _cpu_times(fn, warmup, reps)[0]


def unscale_cpu(suites=("gpt2", "many"), warmup=2, reps=7, progress=print) -> List[Row]:
    """The CPU variants against torch's CPU kernel, with a large copy as the ceiling."""
    n = 256 << 20
    src, dst = torch.randn(n // 4), torch.empty(n // 4)
    copy_ms = _cpu_time(lambda i: dst.copy_(src), warmup, reps)
    copy_gbps = 2 * n / copy_ms / 1e6
    del src, dst
    rows = [Row("ceiling", "host copy (read+write)", "cpu", copy_ms, 2 * n, copy_gbps, 1.0)]
    progress(f"host copy {copy_gbps:.1f} GB/s with {torch.get_num_threads()} threads")
    found = torch.zeros(1)
    invs = [torch.tensor([0.5]), torch.tensor([2.0])]
    for key in suites:
        title, shapes = SUITES[key]
        sets, set_bytes = _make_sets(shapes(), "cpu", torch.float32, 0)
        ts = sets[0]

        def ours(check_only=False, stats=False):
            return lambda i: ops.unscale_and_check_(ts, found, invs[i % 2], check_only=check_only, return_stats=stats)

        candidates = [
            ("adaptive_amp unscale", ours(), 2),
            ("adaptive_amp unscale+stats", ours(stats=True), 2),
            ("adaptive_amp check-only", ours(check_only=True), 1),
            ("torch _amp_foreach_non_finite_check_and_unscale_",
             lambda i: torch._amp_foreach_non_finite_check_and_unscale_(ts, found, invs[i % 2]), 2),
            ("pure-torch reference", lambda i: reference.unscale_and_check_(ts, found, invs[i % 2]), 2),
        ]
        for name, fn, passes in candidates:
            ms, spread = _cpu_times(fn, warmup, reps)
            moved = passes * set_bytes
            rows.append(Row(key, name, "cpu", ms, moved, moved / ms / 1e6, moved / ms / 1e6 / copy_gbps, spread))
            progress(f"  {title}: {name}: {ms:.2f} ms")
        del sets, ts
    return rows


def format_table(rows: List[Row]) -> str:
    header = f"{'suite':8} {'mode':6} {'op':52} {'ms':>9} {'GB/s':>8} {'of ceiling':>10}"
    lines = [header, "-" * len(header)]
    above = False
    for r in rows:
        ms = f"{r.ms:9.4f}" if r.ms else " " * 9
        frac = ""
        if r.ceiling_fraction is not None:
            mark = "*" if r.ceiling_fraction > 1.0 else " "
            above |= r.ceiling_fraction > 1.0
            frac = f"{100 * r.ceiling_fraction:8.1f}%{mark}"
        lines.append(f"{r.suite:8} {r.mode:6} {r.name:52} {ms} {r.gbps:8.1f} {frac:>10}")
    if any(r.mode == "cpu" for r in rows):
        lines.append("cpu rows: the ceiling is one large host copy (or reduction) from DRAM; tensors that stay in the "
                     "caches between calls can beat it, so on the CPU 'of ceiling' is a reference, not a bound.")
    if above:
        lines.append("* above the ceiling measured in the same run: the data was served from caches, not memory.")
    return "\n".join(lines)


def speedups(rows: List[Row]) -> List[str]:
    """The ratios the targets are stated in, per suite and mode."""
    out = []
    by = {(r.suite, r.mode, r.name): r for r in rows}
    for suite in SUITES:
        for mode in ("eager", "graph", "cpu"):
            base = by.get((suite, mode, "torch _amp_foreach_non_finite_check_and_unscale_"))
            if base is None:
                continue
            for name in ("adaptive_amp unscale", "adaptive_amp unscale+stats", "adaptive_amp check-only"):
                r = by.get((suite, mode, name))
                if r is not None:
                    out.append(f"{suite} {mode}: {name}: {time_ratio(r, base, 'torch')}")
    return out


# --------------------------------------------------------------------------- stochastic rounding suite
SROUND_TARGETS = (("bf16", torch.bfloat16), ("fp16", torch.float16), ("e4m3", torch.float8_e4m3fn),
                  ("e5m2", torch.float8_e5m2))
SROUND_OURS, SROUND_TO = "adaptive_amp stochastic_round", "torch .to(dtype) (round to nearest)"
SROUND_REF, SROUND_REF_COMPILED = "pure-torch reference, eager", "pure-torch reference, torch.compile"


def _sround_candidates(x, dtype):
    """(name, fn, capturable) of the suite; the reference draws its random bits inside the timed call, as ours does."""

    def reference_call(i):
        bits = torch.randint(-(2**31), 2**31, x.shape, dtype=torch.int32, device=x.device)
        return reference.stochastic_round(x, dtype, random_bits=bits)

    return [
        (SROUND_OURS, lambda i: ops.stochastic_round(x, dtype), True),
        (SROUND_TO, lambda i: x.to(dtype), True),
        (SROUND_REF, reference_call, False),
        (SROUND_REF_COMPILED, torch.compile(reference_call, dynamic=False), False),
    ]


def sround_gpu(device="cuda", numel=256 << 20, warmup=10, reps=50, targets=SROUND_TARGETS, progress=print) -> List[Row]:
    """fp32 -> each target, `numel` elements: ours, `.to(dtype)`, the pure-torch reference (eager and compiled),
    and the copy ceiling, in one run. Bytes moved count 4 read + the target's size written per element."""
    device, timer = _gpu_setup(device, warmup, reps)
    copy_gbps, _ = _ceilings(device, timer)
    rows = [Row("sround", "device copy (read+write)", "eager", 0.0, 0, copy_gbps, 1.0)]
    progress(f"ceiling: copy {copy_gbps:.0f} GB/s; {numel / 2**20:.0f}M fp32 elements per call")
    x = torch.randn(numel, device=device, generator=torch.Generator(device=device).manual_seed(0))
    for tag, dtype in targets:
        moved = numel * (4 + torch.tensor([], dtype=dtype).element_size())
        for name, fn, capturable in _sround_candidates(x, dtype):
            full = f"{name} -> {tag}"
            try:
                is_ref = name.startswith("pure-torch")
                eager_ms = _GpuTimer(2, 5).eager(fn) if is_ref else timer.eager(fn)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # e.g. the reference's fp64 temporaries
                progress(f"  {full}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
                torch.cuda.empty_cache()
                continue
            rows.append(Row("sround", full, "eager", eager_ms, moved, moved / eager_ms / 1e6,
                            moved / eager_ms / 1e6 / copy_gbps))
            graph_ms = timer.graph(fn, 4) if capturable else None
            if graph_ms is not None:
                rows.append(Row("sround", full, "graph", graph_ms, moved, moved / graph_ms / 1e6,
                                moved / graph_ms / 1e6 / copy_gbps))
            progress(f"  {full}: eager {eager_ms:.3f} ms" + (f", graph {graph_ms:.3f} ms" if graph_ms else ""))
            torch.cuda.empty_cache()
    return rows


def sround_cpu(numel=16 << 20, warmup=1, reps=5, targets=SROUND_TARGETS, progress=print) -> List[Row]:
    """The same suite on the host (no compiled reference), against a host copy."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    dst = torch.empty_like(x)
    copy_ms = _cpu_time(lambda i: dst.copy_(x), warmup, reps)
    copy_gbps = 8 * numel / copy_ms / 1e6
    rows = [Row("sround", "host copy (read+write)", "cpu", copy_ms, 8 * numel, copy_gbps, 1.0)]
    for tag, dtype in targets:
        moved = numel * (4 + torch.tensor([], dtype=dtype).element_size())
        for name, fn, _ in _sround_candidates(x, dtype)[:3]:
            ms, spread = _cpu_times(fn, warmup, reps)
            rows.append(Row("sround", f"{name} -> {tag}", "cpu", ms, moved, moved / ms / 1e6, moved / ms / 1e6 / copy_gbps,
                            spread))
            progress(f"  {name} -> {tag}: {ms:.2f} ms")
    return rows


def sround_summary(rows: List[Row]) -> List[str]:
    """The targets: fp32->bf16 at >= 85% of copy and >= 2x the compiled reference; every target <= 1.25x .to."""
    by = {(r.mode, r.name): r for r in rows if r.suite == "sround"}
    out = []
    for mode in ("eager", "graph", "cpu"):
        for tag, _ in SROUND_TARGETS:
            ours, to = by.get((mode, f"{SROUND_OURS} -> {tag}")), by.get((mode, f"{SROUND_TO} -> {tag}"))
            if ours is None:
                continue
            gpu = mode != "cpu"  # the targets are GPU targets
            line = f"sround {mode} fp32->{tag}: {ours.ms:.3f} ms, {100 * ours.ceiling_fraction:.1f}% of copy"
            if to is not None:
                line += f"; {time_ratio(ours, to, '.to()')}" + (" (target <= 1.25x)" if gpu else "")
            ref = by.get(("eager", f"{SROUND_REF_COMPILED} -> {tag}"))
            if ref is not None:
                line += f"; {time_ratio(ours, ref, 'the compiled reference')}"
            if tag == "bf16" and gpu:
                line += " (targets: >= 85% of copy, <= 0.5x the compiled reference's time)"
            out.append(line)
    return out


# --------------------------------------------------------------------------- tensor statistics suite
STATS_OURS = "adaptive_amp tensor_stats, all stats, float16"
STATS_OURS_FP8 = "adaptive_amp tensor_stats, e4m3fn, per-tensor scale"
STATS_OURS_PLAIN = "adaptive_amp tensor_stats, no format"
STATS_LOOP = "torch per-tensor loop, same stats, no .item()"
STATS_NORM = "torch _foreach_norm"


def torch_stats_loop(tensors, fmt=torch.float16, scale=None):
    """What a user would write in torch: the same statistics, tensor by tensor, without host syncs.

    Returns a (tensors, 15) float32 device tensor (the columns of adaptive_amp.stats.FIELDS).
    """
    info = torch.finfo(fmt)
    rows = []
    for i, t in enumerate(tensors):
        x = t.float().reshape(-1)
        finite = torch.isfinite(x)
        n = finite.sum()
        xf = torch.where(finite, x, 0.0)
        mn = torch.where(finite, x, float("inf")).min()
        mx = torch.where(finite, x, float("-inf")).max()
        amax = torch.maximum(mn.abs(), mx.abs())
        man = torch.where(finite & (x != 0), x.abs(), float("inf")).min()
        mean = xf.sum() / n
        dev = torch.where(finite, x - mean, 0.0)
        std = (dev.square().sum() / (n - 1)).sqrt()
        l2 = torch.linalg.vector_norm(xf)
        s = 1.0 if scale is None else scale[i]
        y = x * s
        cast = y.to(fmt).float()
        over = (finite & (y.abs() > info.max)).sum()
        under = (finite & (x != 0) & (cast == 0)).sum()
        sub = (finite & (cast != 0) & (cast.abs() < info.smallest_normal)).sum()
        rows.append(torch.stack([
            x.new_full((), float(x.numel())), torch.isnan(x).sum().float(), torch.isinf(x).sum().float(),
            (x == 0).sum().float(), mn, mx, amax, man, mean, std, l2, torch.log2(amax / man), over.float(),
            under.float(), sub.float()]))
    return torch.stack(rows)


def _stats_candidates(ts, scale):
    return [
        (STATS_OURS, lambda: ops.tensor_stats(ts, fmt="float16"), True),
        (STATS_OURS_FP8, lambda: ops.tensor_stats(ts, fmt="float8_e4m3fn", scale=scale), True),
        (STATS_OURS_PLAIN, lambda: ops.tensor_stats(ts), True),
        (STATS_LOOP, lambda: torch_stats_loop(ts), False),
        (STATS_NORM, lambda: torch._foreach_norm(ts), True),
    ]


def stats_gpu(suites=("gpt2", "many"), device="cuda", warmup=10, reps=50, progress=print) -> List[Row]:
    """tensor_stats on the GPT-2-small and 2000x4096 sets: ours (all statistics and a format), a per-tensor
    torch loop computing the same statistics, torch._foreach_norm, and the read-only ceiling, eager and graph."""
    device, timer = _gpu_setup(device, warmup, reps)
    _, read_gbps = _ceilings(device, timer)
    rows = [Row("stats", "device reduction (read)", "eager", 0.0, 0, read_gbps, 1.0)]
    progress(f"ceiling: read {read_gbps:.0f} GB/s")
    for key in suites:
        title, shapes = SUITES[key]
        sets, set_bytes = _make_sets(shapes(), device, torch.float32, 4 * _l2_bytes(device))
        scales = [torch.exp2(torch.randint(-4, 5, (len(ts),), device=device).float()) for ts in sets]
        progress(f"{title}: {len(sets)} rotating set(s) of {set_bytes / 1e6:.0f} MB")
        per_set = [_stats_candidates(ts, sc) for ts, sc in zip(sets, scales)]
        for j, (name, _, capturable) in enumerate(per_set[0]):
            def fn(i, j=j):
                per_set[i % len(sets)][j][1]()
            slow = name == STATS_LOOP
            eager_ms = _GpuTimer(2, 5).eager(fn) if slow else timer.eager(fn)
            rows.append(Row(key, name, "eager", eager_ms, set_bytes, set_bytes / eager_ms / 1e6,
                            set_bytes / eager_ms / 1e6 / read_gbps))
            graph_ms = timer.graph(fn, len(sets)) if capturable else None
            if graph_ms is not None:
                rows.append(Row(key, name, "graph", graph_ms, set_bytes, set_bytes / graph_ms / 1e6,
                                set_bytes / graph_ms / 1e6 / read_gbps))
            progress(f"  {name}: eager {eager_ms:.3f} ms" + (f", graph {graph_ms:.3f} ms" if graph_ms else ""))
        del sets, per_set
        torch.cuda.empty_cache()
    return rows


def stats_cpu(suites=("gpt2", "many"), warmup=1, reps=5, progress=print) -> List[Row]:
    """The same suite on the host (ours, the torch loop, _foreach_norm) against a host reduction."""
    n = 256 << 20
    src = torch.randn(n // 4)
    read_ms = _cpu_time(lambda i: src.sum(), warmup, reps)
    read_gbps = n / read_ms / 1e6
    del src
    rows = [Row("stats", "host reduction (read)", "cpu", read_ms, n, read_gbps, 1.0)]
    for key in suites:
        title, shapes = SUITES[key]
        sets, set_bytes = _make_sets(shapes(), "cpu", torch.float32, 0)
        ts = sets[0]
        scale = torch.exp2(torch.randint(-4, 5, (len(ts),)).float())
        for name, fn, _ in _stats_candidates(ts, scale):
            read = name.startswith("adaptive")  # ours: include reading the results
            ms, spread = _cpu_times(lambda i, fn=fn, read=read: fn().to_dict() if read else fn(), warmup, reps)
            rows.append(Row(key, name, "cpu", ms, set_bytes, set_bytes / ms / 1e6, set_bytes / ms / 1e6 / read_gbps,
                            spread))
            progress(f"  {title}: {name}: {ms:.2f} ms")
        del sets, ts
    return rows


def stats_summary(rows: List[Row]) -> List[str]:
    """The targets: GPT-2 set at >= 80% of the read ceiling; >= 100x faster than the torch loop."""
    by = {(r.suite, r.mode, r.name): r for r in rows}
    out = []
    for suite in SUITES:
        for mode in ("eager", "graph", "cpu"):
            ours = by.get((suite, mode, STATS_OURS))
            if ours is None:
                continue
            line = f"stats {suite} {mode}: {ours.ms:.3f} ms, {100 * ours.ceiling_fraction:.1f}% of the read ceiling"
            loop = by.get((suite, "eager" if mode == "graph" else mode, STATS_LOOP))
            if loop is not None:
                line += f"; {ours.ms / loop.ms:.4f}x the time of the torch loop ({loop.ms:.1f} ms eager)"
            norm = by.get((suite, mode, STATS_NORM))
            if norm is not None:
                line += f"; {time_ratio(ours, norm, '_foreach_norm')}"
            if mode != "cpu":  # the targets are GPU targets
                line += " (targets: gpt2 >= 80% of read, <= 0.01x the loop's time)"
            out.append(line)
    return out
