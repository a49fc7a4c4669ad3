"""Seconds-long GPU parity check of our CUDA kernels against their CPU twins.

    python tools/kernel_parity.py

tensor_stats: CUDA against the CPU kernel (exact fields bitwise, moments to
1e-6 relative) for every format, with no scale, a host scale, one device
scale and per-tensor scales that include 0, inf, -inf, NaN and a negative
value (the non-finite ones take the careful path), on fp32/fp16/bf16 tensors
with sizes around the chunk and vector edges, views at odd offsets, and
specials planted. stochastic_round: CUDA against the CPU kernel bitwise for
every source and target, with and without scale and saturate, at sizes that
are not multiples of 4 or 16 and at storage offsets. Exits non-zero on any
mismatch.
"""
import math
import sys

import torch

import adaptive_amp

FORMATS = ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
CHUNK = 16384
failures = []


def spread(n, seed, lo=-40, hi=20):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    return x * torch.exp2(torch.randint(lo, hi, (n,), generator=g).float())


def plant(x, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, x.numel(), (8,), generator=g)
    vals = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-45, 3e38, -448.0, 65504.0])
    x[idx] = vals.to(x.dtype)
    return x


def stats_lists():
    sizes = [1, 3, 4, 15, 17, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 200_003]
    ts = []
    for i, n in enumerate(sizes):
        dt = (torch.float32, torch.float16, torch.bfloat16)[i % 3]
        ts.append(spread(n + 3, i, -30, 10).to(dt)[i % 3:][:n])  # storage offsets
    clean = [spread(n, 100 + i, -20, 8) for i, n in enumerate(sizes)]  # finite: the fast path
    planted = [plant(spread(n, 200 + i), i) if n > 8 else spread(n, 200 + i) for i, n in enumerate(sizes)]
    return {"mixed": ts, "clean_f32": clean, "planted_f32": planted}


def close(a, b, spread=0.0):
    """Within 1e-6 relative; a mean relative to the spread of its data (amax), as the tests do, since
    the mean of centred data may be ~0 and its partial sums are fp32 (csrc/stats_math.h)."""
    if math.isnan(a) and math.isnan(b):
        return True
    return a == b or abs(a - b) <= 1e-6 * (max(abs(a), abs(b)) + spread)


def check_stats():
    for name, ts in stats_lists().items():
        n = len(ts)
        per = torch.exp2(torch.randint(-12, 13, (n,)).float())
        per[1], per[2], per[3], per[4] = 0.0, float("inf"), float("nan"), -float("inf")
        per[5] = -3.0
        for fmt in [None] + FORMATS:
            for sk, s in [("none", None), ("host", 1024.0), ("one", torch.tensor([2.0**-8])), ("per", per)]:
                if fmt is None and s is not None:
                    continue
                cpu = adaptive_amp.tensor_stats(ts, fmt=fmt, scale=s).to_dict()
                sg = s.cuda() if torch.is_tensor(s) else s
                gpu = adaptive_amp.tensor_stats([t.cuda() for t in ts], fmt=fmt, scale=sg).to_dict()
                for field, cv in cpu.items():
                    for i, (a, b) in enumerate(zip(cv, gpu[field])):
                        exact = field not in ("mean", "std", "l2_norm", "dynamic_range")
                        ok = (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))) if exact \
                            else close(a, b, cpu["amax"][i] if field == "mean" else 0.0)
                        if not ok:
                            failures.append(f"stats {name} fmt={fmt} scale={sk} tensor {i} {field}: cpu {a} gpu {b}")
    print("tensor_stats checked")


def check_sround():
    targets = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
    for src in (torch.float32, torch.float16, torch.bfloat16):
        for n in (1, 3, 5, 17, 4099, 65536 + 7, 1_000_003):
            for shift in (0, 1, 3):
                base = plant(spread(n + 8, n + shift), n) if n > 8 else spread(n + 8, n)
                x = base.to(src)[shift:shift + n]
                for tgt in targets:
                    for kw in ({}, {"scale": 0.75}, {"saturate": True}, {"scale": -3.0, "saturate": True}):
                        a = adaptive_amp.stochastic_round(x, tgt, seed=11, offset=5, **kw)
                        b = adaptive_amp.stochastic_round(x.cuda(), tgt, seed=11, offset=5, **kw).cpu()
                        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                            bad = (a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
                            failures.append(f"sround {src}->{tgt} n={n} shift={shift} {kw}: {bad} bytes differ")
    print("stochastic_round checked")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    check_stats()
    check_sround()
    for f in failures[:40]:
        print("FAIL", f)
    print(f"{len(failures)} failures")
    sys.exit(1 if failures else 0)
