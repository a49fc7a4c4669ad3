"""The fused-optimizer suite of ``python -m adaptive_amp bench --suites optim``.

One optimizer step over the GPT-2-small parameter set (148 tensors, 124M
parameters; 2.7 GB or more of traffic, far beyond L2), timed in one run with
CUDA events (medians after warm-up):

* ours: ``adaptive_amp.optim.AdamW`` on bf16 params with fp32 moments (and
  with bf16 moments), stochastic rounding; ``adaptive_amp.optim.SGD`` with
  momentum on bf16 params;
* torch: ``torch.optim.AdamW(fused=True)`` / ``torch.optim.SGD(fused=True)``
  on the same set in fp32;
* a pure-torch SR AdamW on bf16 params (torchao style: fp32 math with
  foreach ops, then stochastic rounding by adding 16 random bits from
  ``torch.randint`` to the fp32 pattern and truncating);
* the device copy ceiling measured in the same run.

GB/s counts the bytes each step must move (below), and "B/param" the memory
of parameter + optimizer state per parameter, without / with the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from .bench import Row, _ceilings, _gpu_setup, gpt2_small_shapes

# Bytes moved per parameter by one step: (read, written).
#   AdamW fp32:            p, g, m, v read (16), p, m, v written (12)      = 28
#   AdamW bf16, fp32 m/v:  p, g (2+2), m, v (8) read; p (2), m, v (8) written = 22
#   AdamW bf16, bf16 m/v:  4 + 4 read, 2 + 4 written                       = 14
#   SGD fp32 + momentum:   p, g, buf read (12), p, buf written (8)         = 20
#   SGD bf16, fp32 buf:    2 + 2 + 4 read, 2 + 4 written                   = 14
_MOVED = {"adamw_fp32": 28, "adamw_bf16_m32": 22, "adamw_bf16_m16": 14, "sgd_fp32": 20, "sgd_bf16_m32": 14}
# Memory per parameter: (param + optimizer state, the same plus the gradient).
_MEMORY = {"adamw_fp32": (12, 16), "adamw_bf16_m32": (10, 12), "adamw_bf16_m16": (6, 8), "sgd_fp32": (8, 12),
           "sgd_bf16_m32": (6, 8)}


@dataclass
class OptimRow(Row):
    kind: str = ""
    bytes_per_param: int = 0
    bytes_per_param_with_grad: int = 0
    ratio_to_torch: float = 0.0


def _params(device, dtype, gen):
    ps = []
    for s in gpt2_small_shapes():
        p = torch.nn.Parameter((0.02 * torch.randn(s, device=device, generator=gen)).to(dtype))
        p.grad = (1e-3 * torch.randn(s, device=device, generator=gen)).to(dtype)
        ps.append(p)
    return ps


def _torch_sr_adamw(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
    """A pure-torch SR AdamW step on bf16 params (fp32 moments), torchao style."""
    state = {"step": 0, "m": [torch.zeros_like(p, dtype=torch.float32) for p in params],
             "v": [torch.zeros_like(p, dtype=torch.float32) for p in params]}

    @torch.no_grad()
    def step():
        state["step"] += 1
        t = state["step"]
        b1, b2 = betas
        p32 = [p.float() for p in params]
        g32 = [p.grad.float() for p in params]
        torch._foreach_mul_(p32, 1 - lr * weight_decay)
        torch._foreach_lerp_(state["m"], g32, 1 - b1)
        torch._foreach_mul_(state["v"], b2)
        torch._foreach_addcmul_(state["v"], g32, g32, 1 - b2)
        denom = torch._foreach_sqrt(state["v"])
        torch._foreach_div_(denom, (1 - b2**t) ** 0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(p32, state["m"], denom, -lr / (1 - b1**t))
        for p, x in zip(params, p32):
            bits = x.view(torch.int32) + torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)
            p.copy_(bits.bitwise_and_(-65536).view(torch.float32))  # exact: the low half is zero

    return step


def optim_gpu(device="cuda", warmup=5, reps=30, progress=print) -> List[OptimRow]:
    from . import optim

    device, timer = _gpu_setup(device, warmup, reps)
    numel = sum(torch.Size(s).numel() for s in gpt2_small_shapes())
    copy_gbps, _ = _ceilings(device, timer)
    gen = torch.Generator(device=device).manual_seed(0)
    rows: List[OptimRow] = []

    def add(name, kind, ms):
        moved = _MOVED[kind] * numel
        gbps = moved / ms / 1e6
        mem = _MEMORY[kind]
        rows.append(OptimRow("optim", name, "eager", ms, moved, gbps, gbps / copy_gbps, kind, mem[0], mem[1]))
        progress(f"optim: {name}: {ms:.3f} ms")

    def time_opt(make, dtype):
        ps = _params(device, dtype, gen)
        opt = make(ps)
        ms = timer.eager(lambda i: opt.step())
        del opt, ps
        torch.cuda.empty_cache()
        return ms

    add("torch.optim.AdamW(fused=True) fp32", "adamw_fp32",
        time_opt(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), torch.float32))
    add("adaptive_amp.optim.AdamW bf16, fp32 moments, SR", "adamw_bf16_m32",
        time_opt(lambda ps: optim.AdamW(ps, lr=1e-3), torch.bfloat16))
    add("adaptive_amp.optim.AdamW bf16, bf16 moments, SR", "adamw_bf16_m16",
        time_opt(lambda ps: optim.AdamW(ps, lr=1e-3, moment_dtype=torch.bfloat16), torch.bfloat16))
    ps = _params(device, torch.bfloat16, gen)
    add("pure-torch SR AdamW bf16 (foreach + randint)", "adamw_bf16_m32", timer.eager(lambda i, s=_torch_sr_adamw(ps): s()))
    del ps
    torch.cuda.empty_cache()
    add("torch.optim.SGD(momentum=0.9, fused=True) fp32", "sgd_fp32",
        time_opt(lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True), torch.float32))
    add("adaptive_amp.optim.SGD(momentum=0.9) bf16, SR", "sgd_bf16_m32",
        time_opt(lambda ps: optim.SGD(ps, lr=1e-3, momentum=0.9), torch.bfloat16))
    # The copy ceiling, as a row: 1 GiB read + 1 GiB written.
    rows.append(OptimRow("optim", "device copy (ceiling)", "eager", 2 * (1 << 30) / copy_gbps / 1e6, 2 << 30,
                         copy_gbps, 1.0, "copy", 0, 0))
    base = {r.kind.split("_")[0]: r.ms for r in rows if r.name.startswith("torch.optim")}
    for r in rows:
        family = r.kind.split("_")[0]
        r.ratio_to_torch = r.ms / base[family] if family in base else float("nan")
    return rows


def format_optim(rows: List[OptimRow]) -> str:
    head = f"{'optimizer step (GPT-2 small, 124M params)':52} {'ms':>8} {'GB/s':>8} {'of copy':>8} " \
           f"{'x torch':>8} {'B/param':>8} {'+grad':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:52} {r.ms:8.3f} {r.gbps:8.1f} {100 * r.ceiling_fraction:7.1f}% "
                     f"{r.ratio_to_torch:8.2f} {r.bytes_per_param:8d} {r.bytes_per_param_with_grad:6d}")
    ours = next((r for r in rows if r.name.startswith("adaptive_amp.optim.AdamW bf16, fp32")), None)
    if ours is not None:
        lines.append(f"target: SR AdamW step <= 1.1x torch fused AdamW fp32: {ours.ratio_to_torch:.2f}x "
                     f"({'met' if ours.ratio_to_torch <= 1.1 else 'NOT met'})")
    return "\n".join(lines)
