"""GradScaler benchmarks: per-step overhead against torch.amp.GradScaler, and predictive mode.

Overhead is the wall time per step of an optimizer loop with the scaler minus
the same loop without it, both on the GPU in the same run; the host time spent
inside the scaler's calls is reported too. Gradients are restored from a
scaled copy before every step, in every loop alike, so the data never drifts.

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

    @property
    def torch_overhead(self) -> float:
        return self.torch_ms - self.plain_ms

    @property
    def ours_overhead(self) -> float:
        return self.ours_ms - self.plain_ms


def _params(shapes, device):
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in shapes]
    scaled = [torch.randn(s, device=device, generator=gen) * 2.0**16 * 1e-3 for s in shapes]
    return params, scaled


def _time_loop(step_fn, steps, reps):
    """(median wall ms per step, median host ms per step inside step_fn's scaler part)."""
    walls, hosts = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        host = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            host += step_fn()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3 / steps)
        hosts.append(host * 1e3 / steps)
    return statistics.median(walls), statistics.median(hosts)


def scaler_overhead_gpu(suites=("gpt2", "many"), steps=30, reps=5, progress=print) -> List[OverheadRow]:
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for key in suites:
        title, shapes = SUITES[key]
        for fused in (False, True):
            for clip in (False, True):
                params, scaled = _params(shapes(), device)
                opt = torch.optim.AdamW(params, lr=1e-4, foreach=not fused, fused=fused)
                loss = torch.ones((), device=device, requires_grad=True)
                grads = [torch.empty_like(p) for p in params]
                for p, g in zip(params, grads):
                    p.grad = g

                def restore():
                    torch._foreach_copy_(grads, scaled)

                def plain():
                    restore()
                    if clip:
                        torch.nn.utils.clip_grad_norm_(params, 1.0)
                    opt.step()
                    return 0.0

                def with_torch(scaler=torch.amp.GradScaler("cuda")):
                    restore()
                    t0 = time.perf_counter()
                    scaler.scale(loss)
                    if clip:
                        scaler.unscale_(opt)
                        torch.nn.utils.clip_grad_norm_(params, 1.0)
                    scaler.step(opt)
                    scaler.update()
                    return time.perf_counter() - t0

                def with_ours(scaler=GradScaler("cuda")):
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
                plain_ms, _ = _time_loop(plain, steps, reps)
                torch_ms, torch_host = _time_loop(with_torch, steps, reps)
                ours_ms, ours_host = _time_loop(with_ours, steps, reps)
                row = OverheadRow(key, "AdamW fused" if fused else "AdamW foreach", clip, plain_ms, torch_ms,
                                  ours_ms, torch_host, ours_host)
                rows.append(row)
                progress(f"{title}, {row.optimizer}, clip={clip}: overhead torch {row.torch_overhead:.3f} ms, "
                         f"ours {row.ours_overhead:.3f} ms")
                del params, scaled, opt, grads
                torch.cuda.empty_cache()
    return rows


def format_overhead(rows: List[OverheadRow]) -> str:
    head = (f"{'set':5} {'optimizer':14} {'clip':5} {'plain ms':>9} {'torch ovh':>10} {'ours ovh':>9} "
            f"{'ratio':>6} {'torch host':>11} {'ours host':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = r.ours_overhead / r.torch_overhead if r.torch_overhead > 0 else float("nan")
        lines.append(f"{r.suite:5} {r.optimizer:14} {str(r.clip):5} {r.plain_ms:9.3f} {r.torch_overhead:10.3f} "
                     f"{r.ours_overhead:9.3f} {ratio:6.2f} {r.torch_host_ms:11.3f} {r.ours_host_ms:10.3f}")
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
