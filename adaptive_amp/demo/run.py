"""``python -m adaptive_amp demo``: fp32, torch AMP and adaptive_amp side by side on TinyLM.

Two scenarios, each trained under three recipes with the same data, seed
and optimizer (AdamW, fused on CUDA):

* ``ordinary``: TinyLM as it is. fp32; torch AMP (autocast fp16 on CUDA,
  bf16 on the CPU, + torch.amp.GradScaler, clipping after ``unscale_``); adaptive_amp with
  ``policy="auto"`` (hardware detection and a sensitivity analysis of a
  sample batch pick the policy).
* ``planted``: TinyLM with an input projection whose fp16 outputs overflow.
  torch AMP skips every step until its scale collapses; adaptive_amp, with
  compute forced to fp16, finds the layer and promotes it to fp32.

For each run: the final loss (fp32 evaluation of held-out batches), the
mean training loss of the last steps, the step time and the per-step
overhead of the recipe's scaler/controller (the same steps without it) from
a round-robin timing phase after training (every run timed in turn, several
rounds, medians: the host's speed drifts, and a small model's step is bound
by the host), skipped steps and the policy in force at the end. The table
and its findings, in sentences, are printed and written with the adaptive
runs' reports (text, JSON, PNG plots when matplotlib is installed) under
``--out``. The default on a CPU takes about a minute; ``--full`` runs the
GPU's run lengths there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import torch
from torch import nn

from .._progress import progress_bar
from ..policy import dtype_name
from .model import MarkovCorpus, TinyLM

RECIPES = ("fp32", "torch_amp", "adaptive")
FORCED_FP16 = "params=float32,compute=float16,loss_scale=dynamic:65536"
CPU_STEPS = 300


@dataclass
class Config:
    device: str
    steps: int
    batch: int
    length: int
    d_model: int
    layers: int
    lr: float = 3e-3
    max_grad_norm: float = 1.0
    planted: float = 1e6
    read_every: int = 50
    timing_rounds: int = 7  # round-robin rounds of the step-time phase
    timing_steps: int = 30  # steps per recipe per round
    seeds: int = 3  # seeds per recipe of the ordinary scenario (the run-to-run spread)

    @classmethod
    def for_device(cls, device: str, steps: Optional[int] = None, full: bool = False) -> "Config":
        if device == "cuda":
            return cls(device, steps or 2000, batch=32, length=64, d_model=128, layers=2)
        if full:  # the GPU's run lengths on the CPU's model: minutes
            return cls(device, steps or 2000, batch=16, length=32, d_model=64, layers=1, read_every=10)
        # The default on a CPU: all eight runs and the timing phase in about a minute on one core.
        return cls(device, steps or CPU_STEPS, batch=16, length=32, d_model=64, layers=1, read_every=10,
                   timing_rounds=5, timing_steps=8, seeds=2)


@dataclass
class RunResult:
    scenario: str
    recipe: str
    seed: int
    final_loss: float  # fp32 evaluation on held-out batches
    train_loss: float  # mean training loss of the last 10% of steps (NaN if any of them was NaN)
    train_ms: float  # wall time per training step, over the training run
    skipped_steps: int
    policy: str
    step_ms: float = math.nan  # median of the round-robin step-time phase
    overhead_ms: float = math.nan  # median over rounds of (step time - the same steps without the scaler/controller)
    events: List[dict] = field(default_factory=list)
    step_times: List[float] = field(default_factory=list)  # ms per step, one per timing round
    overheads: List[float] = field(default_factory=list)  # ms per step, one per timing round (not for fp32)
    losses: List[float] = field(default_factory=list)  # training loss per step
    scales: List[float] = field(default_factory=list)  # loss scale per step (none without loss scaling)
    skipped_at: List[int] = field(default_factory=list)  # steps whose update was skipped


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def _model(cfg: Config, corpus: MarkovCorpus, scenario: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    planted = cfg.planted if scenario == "planted" else 0.0
    return TinyLM(vocab=corpus.vocab, d_model=cfg.d_model, layers=cfg.layers, context=cfg.length,
                  planted=planted).to(cfg.device)


def _optimizer(model: nn.Module, cfg: Config):
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, fused=cfg.device == "cuda")


def _lm_loss(model, tokens, vocab):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))


class _Loop:
    """One recipe's training step, so that training and the overhead timing share it."""

    def __init__(self, recipe: str, model, opt, cfg: Config, corpus, scenario: str, sample):
        self.recipe, self.model, self.opt, self.cfg, self.vocab = recipe, model, opt, cfg, corpus.vocab
        self.amp = self.scaler = None
        if recipe == "torch_amp":
            self.scaler = torch.amp.GradScaler(cfg.device)
            # torch AMP's usual dtype: fp16 on CUDA; bf16 on the CPU, where fp16 matmuls are emulated and slow
            # (the planted scenario is about fp16 overflow, so it uses fp16 everywhere).
            self.dtype = torch.float16 if cfg.device == "cuda" or scenario == "planted" else torch.bfloat16
        elif recipe == "adaptive":
            from ..controller import AdaptiveMixedPrecision

            policy = FORCED_FP16 if scenario == "planted" else "auto"
            self.amp = AdaptiveMixedPrecision(model, opt, policy=policy, sample_inputs=sample[:, :-1],
                                              loss_fn=None, read_every=cfg.read_every, progress=False)

    def enter(self) -> None:
        """Set the process-wide TF32 switches this recipe trains with (the controller's policy decides
        for adaptive_amp; fp32 and torch AMP keep torch's default, off), so runs do not leak into
        each other."""
        if self.cfg.device == "cuda":
            tf32 = bool(self.amp.policy.tf32) if self.amp is not None else False
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32

    def step(self, tokens, *, bare: bool = False) -> torch.Tensor:
        """One training step; `bare` runs the same precision without the scaler/controller."""
        cfg, model, opt = self.cfg, self.model, self.opt
        if self.recipe == "fp32":
            loss = _lm_loss(model, tokens, self.vocab)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
        elif self.recipe == "torch_amp" or bare:
            dtype = self.dtype if self.recipe == "torch_amp" else self.amp.policy.compute_dtype
            with torch.autocast(cfg.device, dtype=dtype, enabled=dtype != torch.float32):
                loss = _lm_loss(model, tokens, self.vocab)
            if bare:
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                opt.step()
            else:
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                self.scaler.step(opt)
                self.scaler.update()
        else:
            with self.amp.autocast():
                loss = _lm_loss(model, tokens, self.vocab)
            self.amp.backward(loss)
            self.amp.step(max_grad_norm=cfg.max_grad_norm)
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def skipped(self, init_scale: float, scales: List[float]) -> int:
        if self.amp is not None:
            return int(sum(self.amp.monitor.history()["found_inf"]))
        if self.scaler is None:
            return 0
        return len(torch_skips(init_scale, scales))


def torch_skips(init_scale: float, scales: List[float]) -> List[int]:
    """The steps torch.amp.GradScaler skipped, from its scale after each step (it does not count them): those
    whose scale went down, and those that end at a scale of 0, where halving stops showing (after about 150
    overflowing steps in a row) and every step is skipped: a zero-scaled gradient unscales to NaN."""
    prev = [init_scale] + scales[:-1]
    return [i for i, (a, b) in enumerate(zip(prev, scales)) if b < a or b == 0]


def _time_steps(loop: _Loop, data, start: int, n: int, bare: bool) -> float:
    _sync(loop.cfg.device)
    t0 = time.perf_counter()
    for i in range(n):
        loop.step(data[(start + i) % len(data)], bare=bare)
    _sync(loop.cfg.device)
    return (time.perf_counter() - t0) / n * 1e3


def run(cfg: Config, scenario: str, recipe: str, seed: int, corpus: MarkovCorpus, data, held_out,
        progress: bool = True, report_dir: Optional[str] = None):
    """Train one (scenario, recipe, seed) and evaluate it; returns (RunResult, the loop for timing)."""
    model = _model(cfg, corpus, scenario, seed)
    opt = _optimizer(model, cfg)
    loop = _Loop(recipe, model, opt, cfg, corpus, scenario, data[0])
    loop.enter()
    init_scale = loop.scaler.get_scale() if loop.scaler is not None else math.nan
    warm = min(10, cfg.steps // 10)
    losses, scales = [], []
    bar = progress_bar(cfg.steps, f"{scenario}/{recipe}", unit="step", enabled=progress, text=True)
    t0 = 0.0
    for step in range(cfg.steps):
        if step == warm:
            _sync(cfg.device)
            t0 = time.perf_counter()
        losses.append(loop.step(data[step]))
        if loop.scaler is not None:
            scales.append(loop.scaler._get_scale_async().detach().clone())
        bar.update()
    _sync(cfg.device)
    train_ms = (time.perf_counter() - t0) / max(1, cfg.steps - warm) * 1e3
    bar.close()
    losses_h = torch.stack(losses).float().cpu().tolist()
    scales_h = torch.stack(scales).float().cpu().tolist() if scales else []
    tail = losses_h[-max(1, cfg.steps // 10):]
    model.eval()
    with torch.no_grad():
        final = statistics.fmean(_lm_loss(model, t, corpus.vocab).item() for t in held_out)
    model.train()
    result = RunResult(scenario, recipe, seed, final_loss=final, train_loss=statistics.fmean(tail),
                       train_ms=train_ms, skipped_steps=loop.skipped(init_scale, scales_h),
                       policy=str(loop.amp.policy) if loop.amp else ("float32" if recipe == "fp32" else
                                                                      f"autocast {dtype_name(loop.dtype)} + GradScaler"),
                       losses=losses_h, scales=scales_h)
    if loop.scaler is not None:
        result.skipped_at = torch_skips(init_scale, scales_h)
    if loop.amp is not None:
        history = loop.amp.monitor.history()
        result.skipped_at = [step for step, found in zip(history["step"], history["found_inf"]) if found]
        if any(s == s for s in history["scale"]):  # the controller scaled the loss (fp16 policies)
            result.scales = [float(s) for s in history["scale"]]
        result.events = [e.to_dict() for e in loop.amp.events]
        if report_dir is not None:
            _save_report(loop.amp, report_dir)
    return result, loop


def time_round_robin(pairs, cfg: Config, data, progress: bool = True) -> None:
    """Step times of trained runs, measured in rounds that visit every run in turn.

    A small model's step is bound by the host; the host's speed drifts over
    minutes, so timing each run during its own training would compare runs
    made under different conditions. Here every run does ``timing_steps``
    steps per round, with and without its scaler/controller, for
    ``timing_rounds`` rounds, and the medians are kept: all runs see the
    same conditions.
    """
    if cfg.timing_rounds == 0:
        return
    bar = progress_bar(cfg.timing_rounds * len(pairs), "step-time rounds", unit="run", enabled=progress, text=True)
    start = cfg.steps
    for _ in range(cfg.timing_rounds):
        for result, loop in pairs:
            loop.enter()
            with_it = _time_steps(loop, data, start, cfg.timing_steps, bare=False)
            result.step_times.append(with_it)
            if result.recipe != "fp32":
                # Paired within the round, so a drift of the host's speed between rounds cancels.
                result.overheads.append(with_it - _time_steps(loop, data, start, cfg.timing_steps, bare=True))
            bar.update()
    bar.close()
    for result, _ in pairs:
        result.step_ms = statistics.median(result.step_times)
        if result.overheads:
            result.overhead_ms = statistics.median(result.overheads)


def spread(values: List[float]) -> float:
    """Half the interquartile range (half the full range for fewer than 4 values); NaN for fewer than 2."""
    values = [v for v in values if v == v]
    if len(values) < 2:
        return math.nan
    if len(values) < 4:
        return (max(values) - min(values)) / 2
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / 2


def compare_times(ours: List[float], theirs: List[float], what: str) -> tuple:
    """(sentence, verdict) for two samples of step times: verdict is "faster", "same" or "slower".

    "same" (no measurable difference) when the medians differ by less than the sum of the two spreads,
    so the verdict cannot flip on timing noise alone.
    """
    a, b = statistics.median(ours), statistics.median(theirs)
    sa, sb = spread(ours), spread(theirs)
    numbers = (f"{a:.2f} ms against {b:.2f} ms per step (medians of {len(ours)} and {len(theirs)} timings, "
               f"spreads +-{sa:.2f} and +-{sb:.2f} ms)")
    if not (sa == sa and sb == sb):
        return f"{numbers}: too few timings to tell a difference", "same"
    if abs(a - b) <= sa + sb:
        return (f"{numbers}: the {abs(a - b):.2f} ms between them ({abs(a / b - 1):.0%}) is within the timing "
                f"noise (+-{sa + sb:.2f} ms): no measurable difference"), "same"
    return f"{numbers}: {a / b:.2f}x {what}'s time", "faster" if a < b else "slower"


def overhead_words(overheads: List[float]) -> str:
    """The cost of a scaler/controller per step, from its paired timings (with it minus without it): a number
    only where it stands out of the timing noise; a difference inside the noise is said so, not printed as a
    (possibly negative) cost."""
    values = [v for v in overheads if v == v]
    if not values:
        return "-"
    m, s = statistics.median(values), spread(values)
    if s == s and m > s:
        return f"{m:.2f}+-{s:.2f}"
    if s != s:  # one timing: no spread to judge it by
        return f"{m:.2f}" if m > 0 else "none measured"
    if m < -s:  # the steps without it ran measurably slower: the host's drift, not a gain
        return f"none measured (+-{s:.2f})"
    return f"within noise (+-{s:.2f})"


def _save_report(amp, directory: str) -> None:
    try:
        amp.report(directory=directory)
    except ImportError as exc:  # report.py missing would be a bug; matplotlib missing only skips plots
        print(f"  report not written: {exc}", file=sys.stderr)


_LABELS = {"fp32": "fp32", "torch_amp": "torch AMP", "adaptive": "adaptive_amp"}


def plot_recipes(results: List[RunResult], directory: str) -> List[str]:
    """recipes_<scenario>.png per scenario: loss, loss scale, skipped steps (seed 0's run) and step time
    (the timing rounds of every seed) of each recipe side by side. Nothing without matplotlib."""
    from ..report import plot_recipes as draw

    written = []
    for scenario in dict.fromkeys(r.scenario for r in results):
        runs, notes = {}, []
        for recipe in RECIPES:
            rs = [r for r in results if r.scenario == scenario and r.recipe == recipe]
            if rs:
                first = min(rs, key=lambda r: r.seed)
                runs[_LABELS[recipe]] = {"losses": first.losses, "scales": first.scales,
                                         "skipped_at": first.skipped_at,
                                         "step_times": [t for r in rs for t in r.step_times]}
                notes.append(f"{_LABELS[recipe]}: {first.policy}")
        path = os.path.join(directory, f"recipes_{scenario}.png")
        try:
            written.append(draw(runs, path, title=f"demo, {scenario} scenario: the recipes side by side "
                                                  f"(curves: seed 0; step times: every seed)", notes=notes))
        except ImportError as exc:
            print(f"  {path} not written: {exc}", file=sys.stderr)
            break
    return written


def _with_spread(value: float, values: List[float]) -> str:
    s = spread(values)
    return f"{value:.2f}" if s != s else f"{value:.2f}+-{s:.2f}"


def _table(results: List[RunResult]) -> str:
    from ..report import comparison_table

    rows = []
    for r in results:
        steps = len(r.losses)
        rows.append({"scenario": r.scenario, "recipe": r.recipe, "seed": r.seed,
                     "final_loss": f"{r.final_loss:.4f}", "train_loss": f"{r.train_loss:.4f}",
                     "ms_per_step": _with_spread(r.step_ms, r.step_times) if r.step_times else "-",
                     "overhead_ms": overhead_words(r.overheads),
                     "skipped": f"{r.skipped_steps}/{steps}" if steps else r.skipped_steps, "policy": r.policy})
    return comparison_table(rows, ["scenario", "recipe", "seed", "final_loss", "train_loss", "ms_per_step",
                                   "overhead_ms", "skipped", "policy"])


TABLE_LEGEND = ("final_loss: fp32 evaluation of held-out batches; train_loss: mean of the last tenth of the training "
                "steps; ms_per_step: median +- half the interquartile range of the timing rounds run after "
                "training (every run in turn); overhead_ms: the same steps with the scaler/controller minus "
                "without it, a number only where it stands out of the timing noise; skipped: steps whose update "
                "was skipped, of the steps trained")


def _steps(word: str, n: float) -> str:
    n = round(n, 1)
    return f"{n:g} {word}" + ("" if n == 1 else "s")


def verdicts(results: List[RunResult], device: Optional[str] = None) -> List[str]:
    """The demo's findings as sentences with their numbers; an acceptance check ends with PASS or FAIL
    (`device`: "cpu" adds a note on what CPU step times mean)."""
    lines = []
    by = {}
    for r in results:
        by.setdefault((r.scenario, r.recipe), []).append(r)
    mean = lambda rs, attr: statistics.fmean(getattr(r, attr) for r in rs)  # noqa: E731
    if ("planted", "adaptive") in by:
        ours = by["planted", "adaptive"]
        promoted = list(dict.fromkeys(e["layer"] for r in ours for e in r.events
                                      if e.get("kind") == "promote" and e.get("layer")))
        skipped, steps = mean(ours, "skipped_steps"), max(len(r.losses) for r in ours)
        if promoted:
            first = min(e["step"] for r in ours for e in r.events if e.get("kind") == "promote")
            repaired = (f"adaptive_amp repaired the planted overflow at step {first} ({', '.join(promoted)} now "
                        f"run{'s' if len(promoted) == 1 else ''} in float32) and skipped {_steps('step', skipped)} "
                        f"of {steps}")
        else:
            repaired = f"adaptive_amp promoted no layer and skipped {_steps('step', skipped)} of {steps}"
        if ("planted", "fp32") in by:
            loss, fp32 = mean(ours, "final_loss"), mean(by["planted", "fp32"], "final_loss")
            ok = loss <= 1.05 * fp32
            lines.append(f"planted: {repaired}; its final loss {loss:.4f} is {abs(loss / fp32 - 1):.1%} "
                         f"{'above' if loss > fp32 else 'below'} fp32's {fp32:.4f} (target: at most 5% above): "
                         + ("PASS" if ok else "FAIL"))
        else:
            lines.append(f"planted: {repaired}.")
        if ("planted", "torch_amp") in by:
            t = by["planted", "torch_amp"]
            t_skipped, t_steps = mean(t, "skipped_steps"), max(len(r.losses) for r in t)
            if t_steps and t_skipped == t_steps:
                lines.append(f"planted: torch's AMP skipped every one of its {t_steps} steps, so the model never "
                             f"trained (final loss {mean(t, 'final_loss'):.4f}).")
            else:
                lines.append(f"planted: torch's AMP skipped {_steps('step', t_skipped)} of {t_steps} "
                             f"(final loss {mean(t, 'final_loss'):.4f}).")
    if ("ordinary", "adaptive") in by and ("ordinary", "torch_amp") in by:
        ours, torch_amp = by["ordinary", "adaptive"], by["ordinary", "torch_amp"]
        losses = [r.final_loss for r in torch_amp]
        spread_ = max(losses) - min(losses) if len(losses) > 1 else math.nan
        a, b = mean(ours, "final_loss"), mean(torch_amp, "final_loss")
        diff = abs(a - b)
        head = (f"ordinary: final loss {a:.4f} (adaptive_amp) against {b:.4f} (torch AMP), "
                f"mean{'s' if len(losses) > 1 else ''} of {len(losses)} seed{'s' if len(losses) > 1 else ''}")
        if spread_ == spread_:
            within = diff <= spread_
            lines.append(f"{head}: the difference {diff:.4f} is {'within' if within else 'larger than'} torch AMP's "
                         f"seed-to-seed spread of {spread_:.4f}: " + ("PASS" if within else "FAIL"))
        else:
            lines.append(f"{head}: one seed gives no seed-to-seed spread to judge the difference {diff:.4f} by.")
        s_ours, s_torch = mean(ours, "skipped_steps"), mean(torch_amp, "skipped_steps")
        none = s_ours == 0 == s_torch
        if none:
            lines.append("ordinary: neither adaptive_amp nor torch AMP skipped a step.")
        else:
            lines.append(f"ordinary: adaptive_amp skipped {_steps('step', s_ours)} and torch AMP "
                         f"{_steps('step', s_torch)} (means over seeds): " + ("PASS" if s_ours < s_torch else "FAIL"))
        if none and all(r.policy.startswith("autocast float16") for r in torch_amp):
            # torch's scaler starts at 2^16 and doubles every 2000 steps without overflow; it skips only once it
            # passes the model's ceiling (about 2^21 for the GPU configuration on an H100: after about 10000
            # steps).
            lines.append("ordinary: torch AMP skips a step each time its scale grows past what the model's "
                         "gradients allow; see it with a longer run (--steps 14000).")
        ours_t = [t for r in ours for t in r.step_times]
        torch_t = [t for r in torch_amp for t in r.step_times]
        if ours_t and torch_t:
            sentence, verdict = compare_times(ours_t, torch_t, "torch AMP")
            lines.append(f"ordinary: step time, adaptive_amp against torch AMP: {sentence}: "
                         + ("FAIL (measurably slower)" if verdict == "slower" else "PASS"))
        cost = [o for r in ours for o in r.overheads]
        if cost:
            words = overhead_words(cost)
            if "+-" in words and not words.startswith("within"):
                m = statistics.median(cost)
                lines.append(f"ordinary: the controller itself costs {m:.2f} ms per step (spread +-{spread(cost):.2f}"
                             f" ms), measured as the same steps with and without it.")
            else:
                lines.append("ordinary: the controller's own cost is too small to measure here: the same steps "
                             "with and without it differ by less than the timing noise"
                             + (f" (+-{spread(cost):.2f} ms)." if spread(cost) == spread(cost) else "."))
    if device == "cpu" and any(r.step_times for r in results):
        lines.append("note: on the CPU, autocast to bf16 casts every matmul's inputs and the matmuls of a model this "
                     "small gain nothing from bf16, so fp32 can be the fastest recipe here; the step times show the "
                     "recipes' overheads, not what mixed precision saves on a GPU.")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptive_amp demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when a GPU is available, else cpu (a smaller configuration)")
    parser.add_argument("--full", action="store_true",
                        help="on the CPU, the GPU's run lengths: 2000 steps, 3 seeds, 7 timing rounds of 30 steps "
                             "(minutes instead of about one; the losses get nearer the floor and the spreads firmer)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps per run (default 2000 GPU, {CPU_STEPS} CPU, 2000 CPU with --full)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds per recipe of the ordinary scenario (run-to-run spread; default 3 GPU, 2 CPU, "
                             "3 CPU with --full)")
    parser.add_argument("--scenarios", default="ordinary,planted",
                        help="comma-separated (default both): ordinary (TinyLM as it is) and planted (a layer whose "
                             "fp16 outputs overflow)")
    parser.add_argument("--recipes", default=",".join(RECIPES),
                        help="comma-separated (default all): fp32; torch_amp (autocast + torch.amp.GradScaler); "
                             "adaptive (adaptive_amp.AdaptiveMixedPrecision)")
    parser.add_argument("--out", default="adaptive_amp_demo",
                        help="directory for demo.txt, demo.json, recipes_*.png and the reports (default %(default)s)")
    parser.add_argument("--timing-rounds", type=int, default=None,
                        help="rounds of the round-robin step-time phase (default 7 GPU, 5 CPU; 0 skips it)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (one line per finished run only)")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU; use --device cpu")
    # (0 would otherwise fall back to the default silently)
    for flag, value in (("--steps", args.steps), ("--seeds", args.seeds)):
        if value is not None and value < 1:
            parser.error(f"{flag} is {value}; pass at least 1")
    cfg = Config.for_device(device, args.steps, full=args.full)
    if args.timing_rounds is not None:
        if args.timing_rounds < 0:
            parser.error("--timing-rounds must be >= 0")
        cfg.timing_rounds = args.timing_rounds
    seeds = args.seeds or cfg.seeds
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not scenarios:
        parser.error(f"--scenarios {args.scenarios!r}: name at least one (ordinary, planted)")
    for s in scenarios:
        if s not in ("ordinary", "planted"):
            parser.error(f"--scenarios: unknown scenario {s!r} (ordinary, planted)")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        parser.error(f"--recipes {args.recipes!r}: name at least one ({', '.join(RECIPES)})")
    for r in recipes:
        if r not in RECIPES:
            parser.error(f"--recipes: unknown recipe {r!r} ({', '.join(RECIPES)})")
    os.makedirs(args.out, exist_ok=True)
    threads = torch.get_num_threads()
    if device == "cpu":
        # TinyLM's matmuls are too small to share between threads: one thread is as fast on an idle machine and,
        # on a busy one, does not stall waiting for a second that another process holds (ten times slower).
        torch.set_num_threads(1)
    try:
        return _demo(args, device, cfg, seeds, scenarios, recipes)
    finally:
        torch.set_num_threads(threads)


def _demo(args, device, cfg, seeds, scenarios, recipes) -> int:
    corpus = MarkovCorpus(device=device)
    gen = torch.Generator(device=device).manual_seed(1234)
    data = corpus.batch((cfg.steps + cfg.timing_steps) * cfg.batch, cfg.length + 1, gen)
    data = list(data.split(cfg.batch))
    held_out = list(corpus.batch(8 * cfg.batch, cfg.length + 1, gen).split(cfg.batch))
    print(f"adaptive_amp demo on {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")
          + f": TinyLM d_model={cfg.d_model} layers={cfg.layers}, {cfg.steps} steps of {cfg.batch}x{cfg.length} "
            f"tokens; loss floor (entropy rate) {corpus.entropy:.3f}", flush=True)
    results: List[RunResult] = []
    for scenario in scenarios:
        pairs = []
        for recipe in (r for r in RECIPES if r in recipes):
            for seed in range(seeds if scenario == "ordinary" and recipe != "fp32" else 1):
                report_dir = os.path.join(args.out, f"report_{scenario}") if recipe == "adaptive" and seed == 0 else None
                r, loop = run(cfg, scenario, recipe, seed, corpus, data, held_out, progress=not args.no_progress,
                              report_dir=report_dir)
                pairs.append((r, loop))
                print(f"  {scenario:8s} {recipe:9s} seed {seed}: final loss {r.final_loss:.4f}, "
                      f"{r.skipped_steps} of {cfg.steps} steps skipped", flush=True)
                for e in r.events:
                    if e["kind"] in ("promote", "switch_compute", "demote", "diagnose"):
                        print(f"      step {e['step']}: {e['kind']}: {e['message']}", flush=True)
        time_round_robin(pairs, cfg, data, progress=not args.no_progress)
        for r, loop in pairs:
            if loop.amp is not None:
                loop.amp.remove()
        results.extend(r for r, _ in pairs)
    table = _table(results)
    checks = verdicts(results, device)
    text = table + "\n\n" + textwrap.fill(TABLE_LEGEND, 118) + "\n\n" + "\n".join(checks)
    print()
    print(text)
    with open(os.path.join(args.out, "demo.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "demo.json"), "w") as f:
        json.dump({"config": asdict(cfg), "results": [asdict(r) for r in results], "checks": checks}, f, indent=2)
    plots = plot_recipes(results, args.out)
    print(f"\nwritten: {args.out}/demo.txt, demo.json, "
          + (", ".join(os.path.basename(p) for p in plots) + " (the recipes side by side), " if plots else "")
          + "and the adaptive runs' reports (report_*/)")
    return 0
