"""End to end: the zoo's models trained under torch's recipes and ours, eager and compiled, side by side.

``python -m adaptive_amp bench --suites e2e`` trains each model for a fixed
number of steps under every recipe and reports tokens/s, peak memory and the
final loss, and, for each adaptive_amp recipe, the controller against the
plain loop it replaces (same dtypes, optimizer, clipping, islands; our
GradScaler where the policy scales), timed in interleaved rounds so that
clock and thermal drift hit both alike (medians of the rounds). It also runs
the drop-in check: with ``torch.use_deterministic_algorithms(True)`` (and
``CUBLAS_WORKSPACE_CONFIG=:4096:8``), torch's GradScaler and ours give
bitwise-equal parameters after N fp16 steps.

Recipes: ``fp32`` (TF32 on CUDA), ``torch-fp16`` (autocast + torch's
GradScaler), ``torch-bf16`` (autocast), ``auto`` (AdaptiveMixedPrecision's
own choice, with the analysis), ``fp16`` (ours, fp16 with loss scaling),
``bf16-pure`` (ours, bf16 weights with the stochastic-rounding AdamW, no autocast),
``bf16-weights`` (ours, the matmul layers' weights in bf16 with that AdamW, under autocast).

Peak memory of a loop is its static memory (parameters, optimizer state,
what its first steps left allocated) plus the largest transient of its
rounds, so that the two loops of a pair, alive together, are each charged
only for their own. The analysis of ``auto`` runs before the warm-up and
is in neither part. On the GPU the timed steps (5-64) include the monitor's
read at step 49 but none of the controller's statistics steps (every 200
steps by default; step 0 is in the warm-up): they cost what the default
cadence costs, a statistics step about once in 200, and a statistics
step's own memory peak is not in the table.

Each row keeps its rounds' times (``round_ms``); a controller row also keeps
the ratio of each round pair (``pair_ratios``: the two rounds ran one after
the other) and which rounds held a statistics step or a read of the monitor
(``stats_rounds``), so that a ratio can be told from the spread of its
rounds. ``--e2e-rounds`` sets how many rounds the timed steps are split into.

On the CPU (tiny models, a few steps) it checks that everything runs; the
numbers mean something on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import torch

#: name -> (zoo family, zoo size) on the GPU; on the CPU every model is the family's tiny size.
MODELS = {"gpt2-small": ("gpt2", "small"), "gpt2-medium": ("gpt2", "medium"), "llama-small": ("llama", "small"),
          "gpt2-large": ("gpt2", "large"), "llama-1b": ("llama", "large")}
#: what runs when no models are named (the large ones are asked for by name)
DEFAULT_MODELS = ("gpt2-small", "gpt2-medium", "llama-small")
RECIPES = ("fp32", "torch-fp16", "torch-bf16", "auto", "fp16", "bf16-pure", "bf16-weights")
CONTROLLER_RECIPES = ("auto", "fp16", "bf16-pure", "bf16-weights")
MAX_GRAD_NORM = 1.0
LR = 1e-4


@dataclass
class E2ERow:
    model: str
    mode: str  # "eager" or "compiled"
    recipe: str
    loop: str  # "plain" or "controller"
    policy: str
    ms_per_step: float
    tokens_per_s: float
    peak_mem_gib: float
    final_loss: float
    skipped_steps: int
    overhead: Optional[float] = None  # controller / plain step time (controller rows): ratio of the medians
    anomalies: Optional[int] = None  # the monitor's events in the controller's run (ordinary training: 0)
    round_ms: List[float] = field(default_factory=list)  # ms per step of each round, in order
    # Controller rows: controller / plain of each round pair (run one after the other), and the rounds in which
    # the controller took a statistics step or read its monitor (one host sync): where a slow round comes from.
    pair_ratios: List[float] = field(default_factory=list)
    stats_rounds: List[int] = field(default_factory=list)


class _Loop:
    """One training loop: ``step(batch) -> loss`` (device tensor), on its own copy of the model."""

    def __init__(self, name: str, model, step: Callable, amp=None, policy: str = ""):
        self.name, self.model, self._step, self.amp, self.policy = name, model, step, amp, policy
        self.losses: List[torch.Tensor] = []
        self._results = []  # the controller's StepResults, read after the run (reading one may wait)

    def step(self, batch):
        loss, stepped = self._step(batch)
        self.losses.append(loss.detach())
        if stepped is not None:
            self._results.append(stepped)

    @property
    def skipped(self) -> int:
        return sum(not r for r in self._results)


def _optimizer(model, sr: bool):
    if sr:
        from ..optim import AdamW

        return AdamW(model.parameters(), lr=LR, stochastic_rounding=True)
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(model.parameters(), lr=LR, fused=fused) if fused else \
        torch.optim.AdamW(model.parameters(), lr=LR)


def _plain(zm, model, fwd, device: str, dtype: Optional[torch.dtype], scaler, sr: bool = False, adjuster=None):
    opt = _optimizer(model, sr)
    autocast = adjuster.autocast if adjuster is not None else (
        (lambda: torch.autocast(device, dtype=dtype)) if dtype is not None else contextlib.nullcontext)

    def step(batch):
        with autocast():
            loss = zm.loss(fwd, batch)
        stepped = None
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, stepped
    return step


def build_loops(recipe: str, zm, device: str, compiled: bool, sample) -> List[_Loop]:
    """The loops of a recipe: one plain loop, or (plain twin, controller) for adaptive_amp's recipes."""
    from ..controller import AdaptiveMixedPrecision
    from ..policy import PrecisionPolicy
    from ..recipes import cast_for_policy, policy_hooks
    from ..scaler import GradScaler

    def fresh():
        model = copy.deepcopy(zm.model)
        return model

    def compiled_(model):
        return torch.compile(model) if compiled else model

    if recipe == "fp32":
        m = fresh()
        return [_Loop("plain", m, _plain(zm, m, compiled_(m), device, None, None), policy="float32 (tf32)")]
    if recipe == "torch-fp16":
        m = fresh()
        return [_Loop("plain", m, _plain(zm, m, compiled_(m), device, torch.float16, torch.amp.GradScaler(device)),
                      policy="torch autocast fp16 + torch GradScaler")]
    if recipe == "torch-bf16":
        m = fresh()
        return [_Loop("plain", m, _plain(zm, m, compiled_(m), device, torch.bfloat16, None),
                      policy="torch autocast bf16")]
    policy = {"auto": "auto", "fp16": "params=float32,compute=float16", "bf16-pure": "bf16-pure",
              "bf16-weights": "bf16-weights"}[recipe]
    sr = recipe in ("bf16-pure", "bf16-weights")  # bf16 weights: the stochastic-rounding AdamW
    mc = fresh()
    if sr:
        cast_for_policy(mc, PrecisionPolicy.from_string(policy))  # the SR optimizer is created on bf16 weights
    fwd_c = compiled_(mc)
    analyze = policy == "auto"
    amp = AdaptiveMixedPrecision(fwd_c, _optimizer(mc, sr), policy=policy,
                                 sample_inputs=zm.inputs(sample) if analyze else None,
                                 loss_fn=zm.output_loss(sample) if analyze else None, progress=False)

    def controller_step(batch):
        with amp.autocast():
            loss = zm.loss(fwd_c, batch)
        amp.backward(loss)
        stepped = amp.step(max_grad_norm=MAX_GRAD_NORM)
        amp.zero_grad()
        return loss, stepped

    # The plain twin of the controller's policy: the same dtypes, islands and loss scaling (our GradScaler).
    p = amp.policy
    mp = fresh()
    if sr:
        cast_for_policy(mp, p)
        policy_hooks(mp, p)  # bf16-pure: inputs cast to bf16; bf16-weights: embeddings return fp32
        plain = _plain(zm, mp, compiled_(mp), device, None if p.pure else torch.bfloat16, None, sr=True)
    else:
        from ..adjust import DynamicPrecisionAdjuster

        adjuster = DynamicPrecisionAdjuster(mp, p) if p.islands else None
        scaler = GradScaler(device, **p.loss_scale.grad_scaler_kwargs()) if p.loss_scale is not None else None
        dtype = p.compute_dtype if p.compute_dtype != torch.float32 else None
        plain = _plain(zm, mp, compiled_(mp), device, dtype, scaler, adjuster=adjuster)
    return [_Loop("plain", mp, plain, policy=str(p)), _Loop("controller", mc, controller_step, amp=amp, policy=str(p))]


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _round(loop: _Loop, batches, start: int, k: int, device: str):
    """Run k steps; return (seconds per step, transient peak bytes)."""
    _sync(device)
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    t0 = time.perf_counter()
    for i in range(k):
        loop.step(batches[(start + i) % len(batches)])
    if device == "cuda":
        end.record()
        end.synchronize()
        seconds = begin.elapsed_time(end) / 1e3
        peak = torch.cuda.max_memory_allocated() - base
    else:
        seconds, peak = time.perf_counter() - t0, 0
    return seconds / k, peak


def run_e2e(models=None, recipes=RECIPES, modes=("eager", "compiled"), steps=None, warmup=None, rounds=None,
            batch=None, seq_len=None, device=None, progress=print) -> Dict[str, list]:
    """Train every (model, mode, recipe); return {"rows": [E2ERow...], "dropin": [...]}.

    `steps` timed steps per loop in `rounds` rounds (GPU: 60 in 6); more rounds of the same length narrow
    the spread of the controller/plain ratio (each row keeps its rounds' times and, for the controller, the
    ratio of each round pair)."""
    from .. import zoo

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    models = list(models or (DEFAULT_MODELS if cuda else ["gpt2-small"]))
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"e2e models {unknown} are unknown; choose from {', '.join(MODELS)}")
    steps = steps or (60 if cuda else 4)  # timed steps per loop, split into rounds
    warmup = warmup if warmup is not None else (5 if cuda else 1)
    rounds = max(1, min(rounds or (6 if cuda else 2), steps))
    k = steps // rounds
    batch = batch or (8 if cuda else 2)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    rows: List[E2ERow] = []
    for name in models:
        family, size = MODELS[name]
        zm = zoo.build(family, size if cuda else "tiny", seed=0, device=device)
        n = seq_len or (512 if cuda else None)
        batches = [zm.make_batch(batch, seed=i, device=device, seq_len=n) for i in range(8)]
        tokens = batches[0]["input_ids"].numel()
        for mode in modes:
            for recipe in recipes:
                bf16 = recipe in ("torch-bf16", "bf16-pure", "bf16-weights")
                if bf16 and cuda and not torch.cuda.is_bf16_supported():
                    continue
                torch._dynamo.reset()
                progress(f"e2e: {name} {mode} {recipe}")
                loops = build_loops(recipe, zm, device, mode == "compiled", batches[0])
                static = {}
                for loop in loops:  # warm-up (and compilation); its static memory is what stays allocated
                    start = torch.cuda.memory_allocated() if cuda else 0
                    for i in range(max(1, warmup)):
                        loop.step(batches[i % len(batches)])
                    _sync(device)
                    static[loop.name] = (torch.cuda.memory_allocated() - start) if cuda else 0
                times = {loop.name: [] for loop in loops}
                peaks = {loop.name: 0 for loop in loops}
                stats_rounds = []
                for r in range(rounds):  # interleaved: plain, controller, plain, controller, ...
                    for loop in (loops if r % 2 == 0 else loops[::-1]):
                        first = loop.amp.step_count if loop.amp is not None else None
                        sec, peak = _round(loop, batches, warmup + r * k, k, device)
                        times[loop.name].append(sec)
                        peaks[loop.name] = max(peaks[loop.name], peak)
                        if first is not None and _monitor_steps(loop.amp, first, loop.amp.step_count):
                            stats_rounds.append(r)
                med = {name_: statistics.median(ts) for name_, ts in times.items()}
                for loop in loops:
                    final = float(torch.stack(loop.losses[-k:]).float().mean())
                    # The controller's model was copied before the plain loop was built: charge the model copy
                    # to the loop that owns it (static) and the transient peak of its own rounds.
                    mem = (static[loop.name] + peaks[loop.name] + _param_bytes(loop.model)) / 2**30 if cuda else 0.0
                    skipped = loop.skipped
                    ctl = loop.name == "controller"
                    rows.append(E2ERow(name, mode, recipe, loop.name, loop.policy, med[loop.name] * 1e3,
                                       tokens / med[loop.name], mem, final, skipped,
                                       med[loop.name] / med["plain"] if ctl else None,
                                       round_ms=[t * 1e3 for t in times[loop.name]],
                                       pair_ratios=[c / p for c, p in zip(times[loop.name], times["plain"])]
                                       if ctl else [],
                                       stats_rounds=list(stats_rounds) if ctl else []))
                for loop in loops:
                    if loop.amp is not None:
                        from ..monitor import KINDS

                        loop.amp.report(plots=False)  # reads the last, partial window
                        rows[-1].anomalies = sum(e.kind in KINDS for e in loop.amp.events)
                        loop.amp.remove()
                del loops
                if cuda:
                    torch.cuda.empty_cache()
    return {"rows": rows, "dropin": [dropin_check(device=device)]}


def _monitor_steps(amp, first: int, end: int) -> bool:
    """Whether the controller's steps first..end-1 include a statistics step or a read of its monitor."""
    mon = amp.monitor
    return any(amp.layer_stats and mon.stats_due(s) or mon.read_due(s) for s in range(first, end))


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def dropin_check(steps: int = 20, device=None, family: str = "gpt2") -> dict:
    """torch's GradScaler and ours, fp16 autocast, deterministic algorithms: bitwise-equal parameters?"""
    from .. import zoo
    from ..scaler import GradScaler

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        zm = zoo.build(family, "small" if cuda else "tiny", seed=0, device=device)
        batches = [zm.make_batch(4, seed=i, device=device, seq_len=128 if cuda else None) for i in range(4)]
        results = []
        for scaler in (torch.amp.GradScaler(device, growth_interval=5), GradScaler(device, growth_interval=5)):
            model = copy.deepcopy(zm.model)
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            for i in range(steps):
                with torch.autocast(device, dtype=torch.float16):
                    loss = zm.loss(model, batches[i % len(batches)])
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            results.append((model, scaler.get_scale()))
        (a, sa), (b, sb) = results
        equal = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
        diff = max(float((x.detach().float() - y.detach().float()).abs().max())
                   for x, y in zip(a.parameters(), b.parameters()))
        return {"model": f"{family}-{'small' if cuda else 'tiny'}", "steps": steps, "bitwise_equal": equal,
                "max_abs_diff": diff, "scale_torch": sa, "scale_ours": sb}
    finally:
        torch.use_deterministic_algorithms(was)


def format_e2e(result: Dict[str, list]) -> str:
    lines = [f"{'model':<12} {'mode':<8} {'recipe':<11} {'loop':<10} {'ms/step':>8} {'tokens/s':>10} "
             f"{'peak GiB':>8} {'loss':>7} {'skip':>4} {'ctl/plain':>9} {'pairs min-max':>13} {'events':>6}  policy"]
    for r in result["rows"]:
        over = f"{r.overhead:.3f}" if r.overhead is not None else ""
        pairs = f"{min(r.pair_ratios):.3f}-{max(r.pair_ratios):.3f}" if r.pair_ratios else ""
        events = str(r.anomalies) if r.anomalies is not None else ""
        lines.append(f"{r.model:<12} {r.mode:<8} {r.recipe:<11} {r.loop:<10} {r.ms_per_step:8.2f} "
                     f"{r.tokens_per_s:10.0f} {r.peak_mem_gib:8.2f} {r.final_loss:7.3f} {r.skipped_steps:4d} "
                     f"{over:>9} {pairs:>13} {events:>6}  {r.policy}")
    for d in result["dropin"]:
        lines.append(f"drop-in check ({d['model']}, {d['steps']} fp16 steps, deterministic): torch GradScaler vs "
                     f"ours bitwise equal: {d['bitwise_equal']} (max |diff| {d['max_abs_diff']:.3g}; scales "
                     f"{d['scale_torch']:g} / {d['scale_ours']:g})")
    return "\n".join(lines)


def to_json(result: Dict[str, list]) -> dict:
    return {"rows": [asdict(r) for r in result["rows"]], "dropin": list(result["dropin"])}
