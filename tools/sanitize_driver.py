"""Exercise every CUDA kernel of adaptive_amp once, on small inputs, for compute-sanitizer.

    compute-sanitizer --tool memcheck python tools/sanitize_driver.py
    (tools/sanitize.sh runs memcheck, racecheck, initcheck and synccheck)

Covers: unscale (every mode, fp32-only and mixed lists, unaligned views,
several launches), the loss-scale update (dynamic and predictive), stochastic
rounding to every target (aligned, unaligned, with amax), tensor_stats (with
and without a format, per-tensor scales, long lists), the fused optimizer
steps (AdamW and SGD, bf16 and fp32 parameters, fp32 and bf16 moments, an
unaligned view, a skipped step).
"""

import itertools

import torch

import adaptive_amp as aa

dev = "cuda"
torch.manual_seed(0)


def mixed(n):
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    return [torch.randn(int(k), device=dev).to(dtypes[i % 3]) for i, k in enumerate(torch.randint(0, 40000, (n,)))]


found = torch.zeros(1, device=dev)
inv = torch.tensor([0.5], device=dev)
base = torch.randn(100003, device=dev)
lists = [
    [torch.randn(70000, device=dev), torch.randn(5, device=dev), torch.randn(0, device=dev)],
    mixed(40),
    [base[1:50001], base[50003:]],  # unaligned views
    [torch.randn(17, device=dev) for _ in range(2500)],  # several launches
]
lists[1][3][-1] = float("inf")
for ts in lists:
    for check_only in (False, True):
        for stats in (False, True):
            aa.unscale_and_check_(ts, found, inv, check_only=check_only, return_stats=stats)

scale = torch.tensor(65536.0, device=dev)
tracker = torch.zeros((), dtype=torch.int32, device=dev)
counters = torch.tensor([2, 0, 0, 0], dtype=torch.int32, device=dev)
hist = torch.zeros(8, device=dev)
for step in range(4):
    fi = torch.tensor(float(step == 2), device=dev)
    aa.update_scale_(scale, tracker, fi, 2.0, 0.5, 2, counters=counters, hysteresis=2)
    aa.update_scale_(scale, tracker, fi, 2.0, 0.5, 2, counters=counters, hysteresis=2,
                     step_amax=torch.tensor(3.0, device=dev), amax_history=hist, margin=2)

x = torch.randn(100003, device=dev)
for target in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
    for src in (x, x[1:], x[:70001].half(), x[:70001].bfloat16()):
        if src.dtype != torch.float32 and target in (torch.bfloat16, torch.float16):
            continue
        aa.stochastic_round(src, target, seed=1, offset=2)
        aa.stochastic_round(src, target, scale=0.25, return_amax=True, saturate=True)

# Chunks that start with a NaN (the pivot search), tensors whose first chunks have no finite element or
# only an outlier (the second merge pass), finished a tensor per warp and, with a tensor of more than 32
# chunks in the list, a tensor per block.
from adaptive_amp.stats import STATS_CHUNK  # noqa: E402

led = torch.randn(5 * STATS_CHUNK + 7, device=dev)
led[::STATS_CHUNK] = float("nan")
led[:2 * STATS_CHUNK] = float("inf")
outlier = torch.randn(3 * STATS_CHUNK, device=dev)
outlier[:STATS_CHUNK] = float("nan")
outlier[STATS_CHUNK - 1] = 1e5
big = torch.randn(33 * STATS_CHUNK + 5, device=dev)
big[:2 * STATS_CHUNK] = float("inf")
for ts in lists[:3] + [mixed(300), [led, led[3:].half(), outlier], [big, outlier]]:
    aa.tensor_stats(ts).to_dict()
    aa.tensor_stats(ts, fmt="float16").to_dict()
    aa.tensor_stats(ts, fmt="float8_e4m3fn", scale=torch.rand(len(ts), device=dev)).to_dict()

from adaptive_amp import optim  # noqa: E402

flat = torch.randn(40003, device=dev).bfloat16()
params = [torch.nn.Parameter(t) for t in (torch.randn(1000, device=dev).bfloat16(), flat[1:20001],
                                          torch.randn(333, device=dev), torch.randn(0, device=dev).bfloat16(),
                                          torch.randn(70001, device=dev).bfloat16())]
makers = (lambda ps: optim.AdamW(ps, lr=1e-3), lambda ps: optim.AdamW(ps, moment_dtype=torch.bfloat16),
          lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True))
for make, track in itertools.product(makers, (False, True)):  # track: the gradient statistics' partials and sums
    opt = make(params)
    opt.track_grad_norm = track
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.grad_scale = torch.tensor(2.0, device=dev)
        opt.found_inf = torch.tensor(float(step == 1), device=dev)  # the second step is skipped
        opt.step()
torch.cuda.synchronize()
print("sanitize driver: done")
