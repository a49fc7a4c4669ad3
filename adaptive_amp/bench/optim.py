"""The fused-optimizer suite of ``python -m adaptive_amp bench --suites optim``.

One optimizer step (``opt.step()``, gradients already in place) over the
GPT-2-small parameter set (148 tensors, 124M parameters; 1.7 GB or more of
traffic per step, far beyond L2), side by side in one run:

* ours: ``adaptive_amp.optim.AdamW`` on bf16 params with fp32 moments (and
  with bf16 moments), stochastic rounding; ``adaptive_amp.optim.SGD`` with
  momentum on bf16 params; the fp32-moment AdamW again with the gradient
  norm a training loop tracks, measured in the step's own pass
  (``track_grad_norm``) and by a second pass (``torch._foreach_norm``);
* torch: ``torch.optim.AdamW(fused=True)`` / ``torch.optim.SGD(fused=True)``
  on the same set in fp32;
* a pure-torch SR AdamW on bf16 params (torchao style: fp32 math with
  foreach ops, then stochastic rounding by adding 16 random bits from
  ``torch.randint`` to the fp32 pattern and truncating);
* the device copy ceiling measured in the same run.

Each row reports three times per step, medians over ``reps`` rounds of
``n`` back-to-back steps (after warm-up):

* ``wall_ms``, pipelined wall time: ``synchronize``; host clock; ``n``
  steps; ``synchronize``; host clock; divided by ``n``. What a training loop
  sees: the host enqueues step k+1 while the GPU runs step k, so a step
  costs max(host, GPU) plus what does not overlap. The speed-up against
  torch's fused AdamW is judged on this number.
* ``gpu_ms``, device time with the host hidden: a ``torch.cuda._sleep``
  long enough to cover the host's enqueueing is put on the stream first,
  then CUDA events around the ``n`` steps; the GPU runs them back to back
  from a full queue, so the events measure kernels and the gaps between
  them only. GB/s and the fraction of the copy ceiling come from this.
* ``host_ms``: host clock around the same ``n`` ``step()`` calls while the
  GPU is still asleep (Python, validation, launch overhead; no waiting).

GB/s counts the bytes each step must move (below), and "B/param" the memory
of parameter + optimizer state per parameter, without / with the gradient.
The pure-torch row runs fewer steps per round (it launches thousands of
kernels per step, more than the launch queue holds behind the sleep).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import List

import torch

from ..hardware import sleep_cycles_per_ms
from .kernels import Row, _ceilings, _gpu_setup, gpt2_small_shapes

# Bytes moved per parameter by one step: (read, written).
#   AdamW fp32:            p, g, m, v read (16), p, m, v written (12)      = 28
#   AdamW bf16, fp32 m/v:  p, g (2+2), m, v (8) read; p (2), m, v (8) written = 22
#   AdamW bf16, bf16 m/v:  4 + 4 read, 2 + 4 written                       = 14
#   SGD fp32 + momentum:   p, g, buf read (12), p, buf written (8)         = 20
#   SGD bf16, fp32 buf:    2 + 2 + 4 read, 2 + 4 written                   = 14
#   + a second pass for the gradient norm (torch._foreach_norm): the bf16 gradients read again (2) = 24
_MOVED = {"adamw_fp32": 28, "adamw_bf16_m32": 22, "adamw_bf16_m16": 14, "sgd_fp32": 20, "sgd_bf16_m32": 14,
          "adamw_bf16_m32_norm": 24}
# Memory per parameter: (param + optimizer state, the same plus the gradient).
_MEMORY = {"adamw_fp32": (12, 16), "adamw_bf16_m32": (10, 12), "adamw_bf16_m16": (6, 8), "sgd_fp32": (8, 12),
           "sgd_bf16_m32": (6, 8), "adamw_bf16_m32_norm": (10, 12)}


@dataclass
class OptimRow(Row):
    kind: str = ""
    bytes_per_param: int = 0
    bytes_per_param_with_grad: int = 0
    ratio_to_torch: float = 0.0  # pipelined wall time over torch's (the figure the speed-up is judged on)
    gpu_ms: float = 0.0
    host_ms: float = 0.0
    wall_ms: float = 0.0
    gpu_ratio_to_torch: float = 0.0
    steps_per_round: int = 0


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


class _WithSecondPassNorm:
    """An optimizer step followed by the gradient norm in a second pass, as a controller without our
    optimizer takes it (fp32 norms of the bf16 gradients, then their norm)."""

    def __init__(self, opt, params):
        self.opt, self.params = opt, params

    def step(self):
        self.opt.step()
        grads = [p.grad for p in self.params]
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


def time_steps(step, device, *, n=20, warmup=3, reps=10, cycles_per_ms=None):
    """(gpu_ms, wall_ms, host_ms) per step of ``step()``; see the module docstring."""
    cycles_per_ms = cycles_per_ms or sleep_cycles_per_ms(device)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu, wall, host = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
        wall.append(wall_ms / n)
        # Asleep for twice the whole pipelined run: the host is done enqueueing long before the GPU wakes.
        torch.cuda._sleep(int(max(2.0 * wall_ms, 1.0) * cycles_per_ms))
        start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        host.append((time.perf_counter() - t0) * 1e3 / n)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / n)
    return statistics.median(gpu), statistics.median(wall), statistics.median(host)


def optim_row(name: str, kind: str, times, steps: int, numel: int, copy_gbps: float) -> OptimRow:
    """The row of one optimizer timed as `kind` (see _MOVED) over `numel` parameters: times = (gpu_ms, wall_ms,
    host_ms) per step."""
    gpu_ms, wall_ms, host_ms = times
    moved = _MOVED[kind] * numel
    gbps = moved / gpu_ms / 1e6
    mem = _MEMORY[kind]
    # (Keywords past Row's own fields: Row gained spread_ms, and positional ones landed one field off.)
    return OptimRow("optim", name, "eager", wall_ms, moved, gbps, gbps / copy_gbps, kind=kind, bytes_per_param=mem[0],
                    bytes_per_param_with_grad=mem[1], gpu_ms=gpu_ms, host_ms=host_ms, wall_ms=wall_ms,
                    steps_per_round=steps)


def optim_gpu(device="cuda", warmup=3, reps=10, n=20, progress=print) -> List[OptimRow]:
    from .. import optim

    device, timer = _gpu_setup(device, 5, 30)
    numel = sum(torch.Size(s).numel() for s in gpt2_small_shapes())
    copy_gbps, _ = _ceilings(device, timer)
    cycles = sleep_cycles_per_ms(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows: List[OptimRow] = []

    def add(name, kind, times, steps):
        rows.append(optim_row(name, kind, times, steps, numel, copy_gbps))
        progress(f"optim: {name}: GPU {times[0]:.3f} ms, wall {times[1]:.3f} ms, host {times[2]:.3f} ms per step")

    def time_opt(make, dtype, steps=n):
        ps = _params(device, dtype, gen)
        opt = make(ps)
        times = time_steps(opt.step, device, n=steps, warmup=warmup, reps=reps, cycles_per_ms=cycles)
        del opt, ps
        torch.cuda.empty_cache()
        return times

    add("torch.optim.AdamW(fused=True) fp32", "adamw_fp32",
        time_opt(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), torch.float32), n)
    add("adaptive_amp.optim.AdamW bf16, fp32 moments, SR", "adamw_bf16_m32",
        time_opt(lambda ps: optim.AdamW(ps, lr=1e-3), torch.bfloat16), n)
    # The gradient norm a training loop tracks: measured by the step's own pass, or by a second one.
    add("  + its grad norm (track_grad_norm, same pass)", "adamw_bf16_m32",
        time_opt(lambda ps: optim.AdamW(ps, lr=1e-3, track_grad_norm=True), torch.bfloat16), n)
    add("  + its grad norm by _foreach_norm (2nd pass)", "adamw_bf16_m32_norm",
        time_opt(lambda ps: _WithSecondPassNorm(optim.AdamW(ps, lr=1e-3), ps), torch.bfloat16), n)
    add("adaptive_amp.optim.AdamW bf16, bf16 moments, SR", "adamw_bf16_m16",
        time_opt(lambda ps: optim.AdamW(ps, lr=1e-3, moment_dtype=torch.bfloat16), torch.bfloat16), n)
    ps = _params(device, torch.bfloat16, gen)
    add("pure-torch SR AdamW bf16 (foreach + randint)", "adamw_bf16_m32",
        time_steps(_torch_sr_adamw(ps), device, n=2, warmup=2, reps=max(3, reps // 2), cycles_per_ms=cycles), 2)
    del ps
    torch.cuda.empty_cache()
    add("torch.optim.SGD(momentum=0.9, fused=True) fp32", "sgd_fp32",
        time_opt(lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True), torch.float32), n)
    add("adaptive_amp.optim.SGD(momentum=0.9) bf16, SR", "sgd_bf16_m32",
        time_opt(lambda ps: optim.SGD(ps, lr=1e-3, momentum=0.9), torch.bfloat16), n)
    # The copy ceiling, as a row: 1 GiB read + 1 GiB written.
    copy_ms = 2 * (1 << 30) / copy_gbps / 1e6
    rows.append(OptimRow("optim", "device copy (ceiling)", "eager", copy_ms, 2 << 30, copy_gbps, 1.0, kind="copy",
                         gpu_ms=copy_ms, wall_ms=float("nan"), host_ms=float("nan")))
    base = {r.kind.split("_")[0]: r for r in rows if r.name.startswith("torch.optim")}
    for r in rows:
        ref = base.get(r.kind.split("_")[0])
        r.ratio_to_torch = r.wall_ms / ref.wall_ms if ref else float("nan")
        r.gpu_ratio_to_torch = r.gpu_ms / ref.gpu_ms if ref else float("nan")
    return rows


def format_optim(rows: List[OptimRow]) -> str:
    head = (f"{'optimizer step (GPT-2 small, 124M params)':50} {'GPU ms':>7} {'wall ms':>7} {'host ms':>7} "
            f"{'GB/s':>7} {'of copy':>7} {'x torch':>7} {'GPU x':>6} {'B/param':>7} {'+grad':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:50} {r.gpu_ms:7.3f} {r.wall_ms:7.3f} {r.host_ms:7.3f} {r.gbps:7.0f} "
                     f"{100 * r.ceiling_fraction:6.1f}% {r.ratio_to_torch:7.2f} {r.gpu_ratio_to_torch:6.2f} "
                     f"{r.bytes_per_param:7d} {r.bytes_per_param_with_grad:5d}")
    lines.append("GPU ms: device time, host hidden behind a sleep; wall ms: steps back to back, one sync at the end; "
                 "host ms: time in step() on the host. x torch: wall-time ratio; GPU x: GPU-time ratio.")
    ours = next((r for r in rows if r.name.startswith("adaptive_amp.optim.AdamW bf16, fp32")), None)
    if ours is not None:
        lines.append(f"target: SR AdamW step <= 1.1x torch fused AdamW fp32 (pipelined wall time): "
                     f"{ours.ratio_to_torch:.2f}x ({'met' if ours.ratio_to_torch <= 1.1 else 'NOT met'}); "
                     f"GPU time {ours.gpu_ratio_to_torch:.2f}x, host time {ours.host_ms:.3f} ms")
    return "\n".join(lines)
