"""A zoo model trained N steps under one recipe, with what the recovery and false-alarm checks read off the run.

Recipes, from the same weights and the same batches (``make_batch(batch, seed=step)``):

* ``"fp32"``: no autocast (on CUDA, TF32 as the caller sets it);
* ``"torch-fp16"``: torch's fp16 autocast and ``torch.amp.GradScaler``;
* ``"adaptive"``: AdaptiveMixedPrecision with the given policy.

The CPU tests (tests/test_controller.py) and the GPU suite
(``python -m adaptive_amp bench zoo``) train through this one loop, so that
the figures the GPU run reports come from the loop the tests check.
"""

from __future__ import annotations

import re
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from .model import ZooModel

RECIPES = ("fp32", "torch-fp16", "adaptive")
#: compute forced to fp16, no islands, nothing said about loss scaling (the controller turns dynamic scaling on)
FP16 = "params=float32,compute=float16"


def recovery_steps(stepped: List[bool]) -> int:
    """Steps from the first skipped step to the first step after it that stepped (0: nothing skipped; the
    number of steps run after the first skip when none stepped again)."""
    if all(stepped):
        return 0
    first = stepped.index(False)
    return stepped.index(True, first) - first if True in stepped[first:] else len(stepped) - first


@dataclass
class TrainRun:
    """One training run (see :func:`train`)."""

    recipe: str
    final_loss: float  # on the held-out batch, fp32, after the last step
    stepped: List[bool]  # per step: whether the optimizer stepped (False: skipped for an overflow)
    losses: List[float]  # per step: the training loss, as the recipe computed it
    amp: object = None  # the AdaptiveMixedPrecision of an "adaptive" run (still attached to the model)
    first_step_s: float = 0.0  # wall time of step 0 (with compile_model: mostly the compilation)
    step_ms: float = 0.0  # median wall time of the later steps (a recompilation after a policy change is one)

    @property
    def lost_steps(self) -> int:
        return self.stepped.count(False)

    @property
    def recovery_steps(self) -> int:
        return recovery_steps(self.stepped)

    @property
    def recovered(self) -> bool:
        """Whether a step stepped after the first skipped one (True when none was skipped)."""
        return all(self.stepped) or True in self.stepped[self.stepped.index(False):]


def _batches(zm: ZooModel, batch: int, seq_len: Optional[int], steps: int, device: torch.device, ahead: bool):
    """``make_batch(batch, seed=step)`` on `device` for each step. With `ahead` (GPU runs) the next batch is
    made on a thread while the step before it runs, as a DataLoader's worker would (an image batch costs the
    host 10-30 ms); for a GPU it is pinned and copied without waiting: a copy from pageable memory would wait
    for the step before it, and the next step's launches with it."""
    pin = device.type == "cuda"

    def make(i):
        b = zm.make_batch(batch, seed=i, seq_len=seq_len)
        return {k: v.pin_memory() for k, v in b.items()} if pin else b

    def to_device(b):
        return {k: v.to(device, non_blocking=pin) for k, v in b.items()}

    if not ahead:
        for i in range(steps):
            yield to_device(make(i))
        return
    with ThreadPoolExecutor(1) as pool:
        coming = pool.submit(make, 0)
        for i in range(steps):
            host = coming.result()
            if i + 1 < steps:
                coming = pool.submit(make, i + 1)
            yield to_device(host)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(zm: ZooModel, recipe: str, steps: int, *, batch: int = 8, seq_len: Optional[int] = None,
          lr: float = 3e-3, warmup: int = 10, max_grad_norm: Optional[float] = None, compile_model: bool = False,
          policy: str = FP16, amp_kwargs: Optional[dict] = None, eval_batch: int = 64, eval_seed: int = 10_000,
          progress: Optional[Callable[[int, float], None]] = None, progress_every: int = 0,
          fused: Optional[bool] = None) -> TrainRun:
    """Train `zm.model` in place for `steps` steps of AdamW (`lr`, a linear warm-up over `warmup` steps, then
    constant; clipping at `max_grad_norm` when given) under `recipe` (one of RECIPES; "adaptive" runs
    AdaptiveMixedPrecision(policy=`policy`, **amp_kwargs)). Batches are ``make_batch(batch, seed=step,
    seq_len=seq_len)`` on the model's device; the final loss is the fp32 loss of ``make_batch(eval_batch,
    seed=eval_seed)``. ``progress(step, loss)`` is called after the first step and every `progress_every`-th
    (0: never). `fused`: torch's fused AdamW, which skips an overflowing step on the device (None: on CUDA)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    if steps < 1:
        raise ValueError(f"steps is {steps}; pass at least 1")
    from ..controller import AdaptiveMixedPrecision

    model = zm.model
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda" if fused is None else fused)
    # The usual linear warm-up of transformer training: without it the first steps, where an overflow is
    # seen and the steps lost, move the loss most (ours then equals fp32 with those steps skipped).
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup)) if warmup else None
    fwd = torch.compile(model) if compile_model else model
    amp = AdaptiveMixedPrecision(fwd, opt, policy=policy, progress=False,
                                 **(amp_kwargs or {})) if recipe == "adaptive" else None
    scaler = torch.amp.GradScaler(device.type) if recipe == "torch-fp16" else None
    params = [p for g in opt.param_groups for p in g["params"]]
    stepped, losses, seconds = [], [], []
    batches = _batches(zm, batch, seq_len, steps, device, ahead=device.type == "cuda")
    for i in range(steps):
        t0 = time.perf_counter()
        b = next(batches)
        if recipe == "fp32":
            loss = zm.loss(fwd, b)
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            stepped.append(True)
        elif recipe == "torch-fp16":
            with torch.autocast(device.type, dtype=torch.float16):
                loss = zm.loss(fwd, b)
            scaler.scale(loss).backward()
            if max_grad_norm is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            stepped.append(scaler.get_scale() >= before)  # torch's scale falls exactly when it skipped
        else:
            with amp.autocast():
                loss = zm.loss(fwd, b)
            amp.backward(loss)
            stepped.append(amp.step(max_grad_norm=max_grad_norm))
        opt.zero_grad()
        if warm is not None:
            with warnings.catch_warnings():
                # The schedule follows the step count, as in a loop with torch's GradScaler: after a skipped
                # first step torch warns that the scheduler stepped before the optimizer; that is intended.
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                warm.step()
        losses.append(loss.detach().float())
        if i == 0:
            _sync(device)
        seconds.append(time.perf_counter() - t0)  # host time: steps that read found_inf wait for the device
        if progress is not None and progress_every and (i == 0 or (i + 1) % progress_every == 0):
            progress(i, float(losses[-1]))
    _sync(device)
    with torch.no_grad():
        final = zm.loss(model, zm.make_batch(eval_batch, seed=eval_seed, device=device, seq_len=seq_len)).item()
    later = sorted(seconds[1:]) or seconds
    return TrainRun(recipe, final, [bool(s) for s in stepped],  # (StepResults read after the run)
                    torch.stack(losses).tolist(), amp, seconds[0],
                    1e3 * later[len(later) // 2])
