"""Benchmark of the fused unscale-and-check kernels; see adaptive_amp/bench.py.

    python bench/bench_unscale.py --json unscale.json [--cpu]

Eager time per call (issue 18 item 14), in one run on one GPU:

    python bench/bench_unscale.py --eager [--reps 200] [--json eager.json]

times each call as a user's own loop makes it (host work included: describing
the tensors, allocating, launching), for adaptive_amp.unscale_and_check_,
adaptive_amp.UnscalePlan (the list described once) and
torch._amp_foreach_non_finite_check_and_unscale_, on the GPT-2-small gradient
set (148 fp32 tensors, 498 MB) and 2000 fp32 tensors of 4096 elements: the
median over reps of CUDA events recorded around one call each, after warm-up,
with the device idle at the start of each rep (a synchronize before it), so
the time is what the call costs when it is not hidden behind earlier work.
The candidates take turns in --rounds rounds (drift on the machine falls on
all of them alike); each row gives the median and the interquartile range of
its calls, and a gap to torch inside the two ranges reads "no measurable
difference". The target is ours <= 1.0x torch's on both sets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def _iqr(xs):
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def eager_main(reps: int, warmup: int, rounds: int, json_path=None):
    import torch

    import adaptive_amp
    from adaptive_amp.bench.kernels import gpt2_small_shapes, many_small_shapes

    device = torch.device("cuda", torch.cuda.current_device())
    sets = {"gpt2": gpt2_small_shapes(), "many": many_small_shapes()}
    found = torch.zeros(1, device=device)
    # Alternating 0.5 and 2.0 keeps the data as it was every two calls (never zeros: randn).
    invs = [torch.tensor([0.5], device=device), torch.tensor([2.0], device=device)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    for key, shapes in sets.items():
        tensors = [torch.randn(s, device=device) for s in shapes]
        nbytes = sum(t.numel() * 4 for t in tensors)
        plan = adaptive_amp.UnscalePlan(tensors)
        candidates = {
            "torch _amp_foreach_non_finite_check_and_unscale_":
                lambda inv: torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv),
            "adaptive_amp.unscale_and_check_": lambda inv: adaptive_amp.unscale_and_check_(tensors, found, inv),
            "adaptive_amp.UnscalePlan": lambda inv: plan.unscale_and_check_(found, inv),
        }
        # Where the plan's time goes (diagnostics, not targets): its per-tensor re-check alone, its native call
        # (re-check, then launch: the launch is the difference), and one data_ptr() read per tensor through
        # Python (the least any re-check can read).
        found_ptr, inv_ptrs = found.data_ptr(), [x.data_ptr() for x in invs]
        stream = torch.cuda.current_stream(device).cuda_stream
        diagnostics = {
            "  (plan: per-tensor re-check only)": lambda inv: plan._native.check(),
            "  (plan: native call, re-check + launch)": lambda inv: plan._native.unscale(
                found_ptr, inv_ptrs[0] if inv is invs[0] else inv_ptrs[1], False, 0, 0, 0, 0, stream, (found, inv)),
            "  (one data_ptr() read a tensor)": lambda inv: list(map(torch.Tensor.data_ptr, tensors)),
        }
        candidates.update(diagnostics)
        samples = {name: [] for name in candidates}
        for fn in candidates.values():
            for i in range(warmup):
                fn(invs[i % 2])
        for _ in range(rounds):  # the candidates take turns: drift falls on all of them alike
            for name, fn in candidates.items():
                for i in range(reps // rounds):
                    torch.cuda.synchronize()
                    start.record()
                    fn(invs[i % 2])
                    end.record()
                    end.synchronize()
                    samples[name].append(start.elapsed_time(end))
        times = {name: statistics.median(xs) for name, xs in samples.items()}
        iqr = {name: _iqr(xs) for name, xs in samples.items()}
        base_name = "torch _amp_foreach_non_finite_check_and_unscale_"
        base = times[base_name]
        print(f"{key}: {len(tensors)} tensors, {nbytes / 1e6:.0f} MB ({torch.cuda.get_device_name(device)}), "
              f"median and interquartile range of {rounds} x {reps // rounds} calls each")
        for name, ms in times.items():
            same = name != base_name and abs(ms - base) <= iqr[name] + iqr[base_name]
            verdict = "  no measurable difference from torch" if same and not name.startswith("  (") else ""
            print(f"  {name:52s} {ms:8.4f} ms +- {iqr[name]:.4f}  {ms / base:5.2f}x torch  "
                  f"{2 * nbytes / ms / 1e6:7.0f} GB/s{verdict}")
            rows.append({"set": key, "tensors": len(tensors), "bytes": nbytes, "name": name, "ms": ms,
                         "iqr_ms": iqr[name], "vs_torch": ms / base, "no_measurable_difference": same})
        del tensors, plan
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "reps": reps,
                       "rounds": rounds,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    if "--eager" in sys.argv:
        parser = argparse.ArgumentParser(description="eager time per call of unscale_and_check_ vs torch")
        parser.add_argument("--eager", action="store_true")
        parser.add_argument("--reps", type=int, default=200)
        parser.add_argument("--warmup", type=int, default=20)
        parser.add_argument("--rounds", type=int, default=5, help="the candidates take turns this many times")
        parser.add_argument("--json", default=None)
        args = parser.parse_args()
        eager_main(args.reps, args.warmup, args.rounds, args.json)
    else:
        from adaptive_amp.bench import main

        main()
