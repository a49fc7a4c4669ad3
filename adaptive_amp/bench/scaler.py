"""GradScaler benchmarks: per-step overhead against torch.amp.GradScaler, and predictive mode.

Overhead is the wall time per step of an optimizer loop with the scaler minus
the same loop without it, both on the same device in the same run; the host
time spent inside the scaler's calls is reported too. Gradients are restored
from a scaled copy before every step, in every loop alike, so the data never
drifts. With ``frozen`` a fraction of the parameter tensors, spread evenly over
the list, is frozen (``requires_grad=False``, ``.grad`` None) but stays in the
optimizer, as in fine-tuning that hands ``model.parameters()`` to the optimizer.

The LM part trains the demo language model (adaptive_amp.demo) in fp16 with
torch's scaler, ours in mode dynamic, and ours in mode predictive, and
reports skipped steps and final loss.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import List

import torch

from ..demo.model import train_lm
from ..scaler import GradScaler
from .kernels import SUITES


@dataclass
class OverheadRow:
    suite: str
    optimizer: str
    clip: bool
    plain_ms: float
    torch_ms: float
    ours_ms: float
    torch_host_ms: float
    ours_host_ms: float
    frozen: float = 0.0  # fraction of parameter tensors without a gradient

    @property
    def torch_overhead(self) -> float:
        return self.torch_ms - self.plain_ms

    @property
    def ours_overhead(self) -> float:
        return self.ours_ms - self.plain_ms


def _params(shapes, device, frozen=0.0):
    """(params, scaled gradients of the trainable ones, trainable ones): every tensor i with
    floor((i + 1) * frozen) > floor(i * frozen) is frozen, so the frozen ones are spread evenly."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in shapes]
    for i, p in enumerate(params):
        if int((i + 1) * frozen) > int(i * frozen):
            p.requires_grad_(False)
    trainable = [p for p in params if p.requires_grad]
    scaled = [torch.randn(p.shape, device=device, generator=gen) * 2.0**16 * 1e-3 for p in trainable]
    return params, scaled, trainable


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_loop(step_fn, steps, reps, device):
    """(median wall ms per step, median host ms per step inside step_fn's scaler part)."""
    walls, hosts = [], []
    for _ in range(reps):
        _sync(device)
        host = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            host += step_fn()
        _sync(device)
        walls.append((time.perf_counter() - t0) * 1e3 / steps)
        hosts.append(host * 1e3 / steps)
    return statistics.median(walls), statistics.median(hosts)


def scaler_overhead_gpu(suites=("gpt2", "many"), steps=30, reps=5, progress=print, frozen=0.0) -> List[OverheadRow]:
    device = torch.device("cuda", torch.cuda.current_device())
    return scaler_overhead(suites, device, steps=steps, reps=reps, progress=progress, frozen=frozen)


def scaler_overhead(suites=("gpt2", "many"), device="cuda", steps=30, reps=5, progress=print, frozen=0.0,
                    shapes=None, optimizers=("AdamW foreach", "AdamW fused")) -> List[OverheadRow]:
    """Per-step overhead rows; ``shapes`` (a list of shapes) replaces the suites' sets, named "custom".

    On the CPU the times are host-clock medians of a shared machine: they show
    the host-side cost, not the GPU figures the project's claims rest on.
    """
    device = torch.device(device)
    rows = []
    sets = [("custom", "custom", lambda: shapes)] if shapes is not None else \
        [(key, *SUITES[key]) for key in suites]
    for key, title, set_shapes in sets:
        for name in optimizers:
            fused = name == "AdamW fused"
            for clip in (False, True):
                params, scaled, trainable = _params(set_shapes(), device, frozen)
                opt = torch.optim.AdamW(params, lr=1e-4, foreach=not fused, fused=fused)
                loss = torch.ones((), device=device, requires_grad=True)
                grads = [torch.empty_like(p) for p in trainable]
                for p, g in zip(trainable, grads):
                    p.grad = g

                def restore():
                    torch._foreach_copy_(grads, scaled)

                def plain():
                    restore()
                    if clip:
                        torch.nn.utils.clip_grad_norm_(params, 1.0)
                    opt.step()
                    return 0.0

                def with_torch(scaler=torch.amp.GradScaler(device.type)):
                    restore()
                    t0 = time.perf_counter()
                    scaler.scale(loss)
                    if clip:
                        scaler.unscale_(opt)
                        torch.nn.utils.clip_grad_norm_(params, 1.0)
                    scaler.step(opt)
                    scaler.update()
                    return time.perf_counter() - t0

                def with_ours(scaler=GradScaler(device.type)):
                    restore()
                    t0 = time.perf_counter()
                    scaler.scale(loss)
                    if clip:
                        scaler.clip_grad_norm_(opt, 1.0)
                    scaler.step(opt)
                    scaler.update()
                    return time.perf_counter() - t0

                for fn in (plain, with_torch, with_ours):  # warm up (lazy state, allocator)
                    for _ in range(3):
                        fn()
                plain_ms, _ = _time_loop(plain, steps, reps, device)
                torch_ms, torch_host = _time_loop(with_torch, steps, reps, device)
                ours_ms, ours_host = _time_loop(with_ours, steps, reps, device)
                row = OverheadRow(key, name, clip, plain_ms, torch_ms, ours_ms, torch_host, ours_host, frozen)
                rows.append(row)
                progress(f"{title}, {row.optimizer}, clip={clip}, frozen={frozen:g}: overhead torch "
                         f"{row.torch_overhead:.3f} ms, ours {row.ours_overhead:.3f} ms")
                del params, scaled, opt, grads
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


class _NoStep(torch.optim.Optimizer):
    """An optimizer whose step does nothing: what remains of a step is the scaler's own cost."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


@dataclass
class CallsRow:
    frozen: float
    params: int
    frozen_params: int
    torch_us: float
    ours_us: float
    torch_iqr: tuple
    ours_iqr: tuple


def scaler_calls_cpu(frozen=0.0, steps=600, warmup=30, shrink=32) -> CallsRow:
    """CPU: microseconds of ``unscale_(opt); step(opt); update()`` per step, ours and torch's.

    GPT-2 small's 148 parameter shapes with every dimension divided by
    ``shrink`` (small tensors: the cost is the scaler's host work), a no-op
    optimizer, one intra-op thread; the two scalers alternate step by step so
    a loaded machine slows both alike. Medians and interquartile ranges.
    """
    shapes = [tuple(max(1, d // shrink) for d in s) for s in SUITES["gpt2"][1]()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params, scaled, trainable = _params(shapes, torch.device("cpu"), frozen)
        opt = _NoStep(params)
        grads = [torch.empty_like(p) for p in trainable]
        for p, g in zip(trainable, grads):
            p.grad = g
        one = torch.ones(())
        scalers = {"torch": torch.amp.GradScaler("cpu"), "ours": GradScaler("cpu")}
        times = {k: [] for k in scalers}
        for i in range(warmup + steps):
            for k, scaler in scalers.items():
                torch._foreach_copy_(grads, scaled)
                scaler.scale(one)
                t0 = time.perf_counter()
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
                if i >= warmup:
                    times[k].append((time.perf_counter() - t0) * 1e6)
    finally:
        torch.set_num_threads(threads)

    def iqr(v):
        q = statistics.quantiles(v, n=4)
        return (q[0], q[2])

    return CallsRow(frozen, len(params), len(params) - len(trainable), statistics.median(times["torch"]),
                    statistics.median(times["ours"]), iqr(times["torch"]), iqr(times["ours"]))


def format_calls(rows: List[CallsRow]) -> str:
    head = f"{'frozen':>6} {'params':>6} {'torch us':>9} {'(IQR)':>15} {'ours us':>8} {'(IQR)':>15} {'ratio':>6}"
    lines = ["unscale_ + step + update per step, CPU host clock, no-op optimizer (medians)", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.frozen:6.2f} {r.params:6d} {r.torch_us:9.1f} {r.torch_iqr[0]:7.1f}-{r.torch_iqr[1]:<7.1f} "
                     f"{r.ours_us:8.1f} {r.ours_iqr[0]:7.1f}-{r.ours_iqr[1]:<7.1f} {r.ours_us / r.torch_us:6.2f}")
    return "\n".join(lines)


def format_overhead(rows: List[OverheadRow]) -> str:
    head = (f"{'set':6} {'frozen':>6} {'optimizer':14} {'clip':5} {'plain ms':>9} {'torch ovh':>10} {'ours ovh':>9} "
            f"{'ratio':>6} {'torch host':>11} {'ours host':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = r.ours_overhead / r.torch_overhead if r.torch_overhead > 0 else float("nan")
        lines.append(f"{r.suite:6} {r.frozen:6.2f} {r.optimizer:14} {str(r.clip):5} {r.plain_ms:9.3f} "
                     f"{r.torch_overhead:10.3f} {r.ours_overhead:9.3f} {ratio:6.2f} {r.torch_host_ms:11.3f} "
                     f"{r.ours_host_ms:10.3f}")
    return "\n".join(lines)


def lm_modes_gpu(steps=2000, seeds=(0, 1), growth_interval=100, progress=print):
    """fp16 training of the demo LM: torch's scaler, ours dynamic, ours predictive.

    growth_interval is shorter than torch's default 2000 so that 2000 steps
    hold several growth-overflow cycles of dynamic scaling (Megatron and
    DeepSpeed default to 1000); predictive mode uses it only to relax its
    extra margin after an overflow.
    """
    makers = {
        "torch dynamic": lambda: torch.amp.GradScaler("cuda", growth_interval=growth_interval),
        "ours dynamic": lambda: GradScaler("cuda", growth_interval=growth_interval),
        "ours predictive": lambda: GradScaler("cuda", growth_interval=growth_interval, mode="predictive"),
    }
    results = {}
    for name, make in makers.items():
        for seed in seeds:
            r = train_lm(make, steps=steps, seed=seed, device="cuda", dtype=torch.float16)
            results[(name, seed)] = r
            progress(f"{name} seed {seed}: skipped {r.skipped_steps}, final loss {r.final_loss:.4f} "
                     f"(floor {r.entropy_floor:.3f}), {r.seconds:.1f} s")
    return results


def format_lm(results) -> str:
    head = f"{'scaler':16} {'seed':>4} {'skipped':>8} {'final loss':>11} {'last scale':>11} {'seconds':>8}"
    lines = [head, "-" * len(head)]
    for (name, seed), r in results.items():
        lines.append(f"{name:16} {seed:4d} {r.skipped_steps:8d} {r.final_loss:11.4f} {r.scales[-1]:11.0f} "
                     f"{r.seconds:8.1f}")
    return "\n".join(lines)
