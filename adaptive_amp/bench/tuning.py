"""``python -m adaptive_amp bench tune``: ``policy="tune"`` against torch's bf16 autocast, trained for real.

For each model and mode (eager / compiled), in one process on one GPU, in this order (--parts picks; a run
that would not end before --max-seconds is skipped and says so; OUT/evidence.json is rewritten after every run):

1. ``cost``: with --cost-shape BxL (eager): a tuning at that shape and the chosen recipe timed there: the
   tuning's cost as a fraction of 10,000 full-size steps. First, so that it pays the process's first-tuning
   costs, as a user's tuning does;
2. ``tuned``: ``AdaptiveMixedPrecision(model, AdamW, policy="tune", tune=dict(batches=..., ...))`` (its
   trials on 8 batches, the A/B table and plot saved), then ``--train-steps`` steps of ``amp.train_step``
   on fresh batches (seed 0's stream): tokens/s, peak memory, the losses. Compiled mode: this model's
   compiled runs start from empty compile caches, as a process's first run does;
3. ``cold`` (compiled mode): the tuned run's choice through the controller without the tuning (a
   one-candidate screen, nothing compiled), in a new process with empty compile caches, ``--cold-steps``
   steps: the one-time seconds (the compiles, mostly) of the run the user makes anyway;
4. ``torch``: torch's bf16 autocast with fp32 AdamW (compiled too in compiled mode), from the same weights
   on the same batches;
5. ``alone``: every candidate that ran and fit in the tuning, alone (a plain loop of its recipe) for
   ``--alone-steps`` steps: the throughput the tuned choice is compared with;
6. ``seeds``: for every other seed s in ``--seeds`` (the model initialized with seed s, batches from stream
   s), torch's run and the tuned choice's (seed 0's choice, or --choice, as a one-candidate tuning): the
   seed spread of the final loss. Losses do not depend on the machine, so this part may run in another
   process (--spread-seeds names its seeds, to share them out among processes or GPUs).

The final loss is the mean of the last 10% of the steps' training losses (every batch is new, so it is not
memorized). The verdict compares the tuned run with torch's (tokens/s, the final loss against torch's seed
spread, and for each seed how soon each run reached the loss both reach, at its steady step time: a run a
little behind at equal steps may get there sooner) and with the best candidate that agreed in the tuning, run
alone, and gives the tuning's cost against the targets: the whole tuning at most 3% of 10,000 steps at the
chosen recipe's steady step time, and the tuned run at least 0.99x torch's bf16 autocast's steady tokens/s on
the same batches (compiled mode: both compiled).
A compiled tuning screens the candidates eagerly and compiles only its finalists' blocks (its compile seconds
are reported); the chosen recipe's own compile, which the user's compiled run makes anyway, happens in the tuned
run's first step. With the cold part, the compiled cost counts that compile once: the tuning, plus the tuned
run's one-time seconds (beyond its steps at the steady rate), less those of the same recipe's run without
tuning, started cold: what tuning adds to the time before steady training. (Run one model per process for
this figure: a process's later compiles find its compile workers and imports warm.)
--budget and --oom-fraction add the memory runs (a tuning under a budget, then training the choice; a real
out-of-memory at run time).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from .. import AdaptiveMixedPrecision, zoo
from ..compile_cache import describe_graphs
from .e2e import MODELS as E2E_MODELS
from ..policy import AdaptivePrecisionSelector
from ..recipes import AppliedRecipe
from ..report import _jsonable, plot_recipes
from ..tune import Snapshot

#: --models name -> (zoo family, zoo size): the e2e bench's names for these sizes
MODELS = {name: E2E_MODELS[name] for name in ("gpt2-small", "gpt2-medium", "gpt2-large", "llama-1b")}

#: The targets the verdict judges: the whole tuning at most this share of a 10,000-step run of the chosen recipe
#: (its steady step time; a compiled run's own compile of the chosen recipe, which it makes anyway, is not in
#: the tuning), and the tuned run at least this fraction of torch's bf16 autocast's tokens/s (never a loss).
COST_TARGET, NEVER_A_LOSS = 0.03, 0.99


def build(name: str, tiny: bool, device, seed: int = 0):
    """A ZooModel: gpt2-small, gpt2-medium, gpt2-large, or llama-1b (the zoo's Llama "large": TinyLlama's shape,
    1.1B parameters);
    random weights."""
    if tiny:
        return zoo.build("gpt2" if name.startswith("gpt2") else "llama", "tiny", seed=seed, device=device)
    if name in MODELS:
        return zoo.build(*MODELS[name], seed=seed, device=device)
    raise SystemExit(f"unknown model {name!r}: one of {', '.join(MODELS)}")


def stream(zm, batch: int, seq: int, n: int, seed: int, device):
    """Seed `seed`'s n batches, made before any timing (every step trains on a new one)."""
    return [zm.make_batch(batch, seed=seed * 1_000_003 + i, device=device, seq_len=seq) for i in range(n)]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def final_loss(losses: list) -> float:
    """A run's final loss: the mean of the last 10% of its training losses (every batch is new)."""
    tail = max(1, len(losses) // 10)
    return sum(losses[-tail:]) / tail


def timed_loop(step, batches, steps, device, tokens, deadline=None):
    """`steps` calls of step(batch) -> detached loss; the first 10% (at most 20) are warm-up, not timed.
    tokens_per_s: over all timed steps (one-time costs included: a compiled controller's statistics graph, an
    event's diagnosis); steady_tokens_per_s: the median over ten windows (marked with CUDA events, no sync),
    which leaves them out. With `deadline` (a time.perf_counter() value), no window starts after it: "steps"
    then says how many ran and "stopped_early" is True."""
    cuda = device.type == "cuda"
    if cuda:
        sync(device)
        torch.cuda.reset_peak_memory_stats()
    warm = min(20, max(1, steps // 10))
    window = max(1, (steps - warm) // 10)

    def mark():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()
    losses, start, marks, done = [], None, [], steps
    began, first_step_s = time.perf_counter(), None
    for k in range(steps):
        if deadline is not None and k > warm and (k - warm) % window == 0 and time.perf_counter() > deadline:
            done = k
            break
        if k == warm:
            sync(device)
            start = time.perf_counter()
        if k == 1:  # the first step: a compiled run's compile
            sync(device)
            first_step_s = time.perf_counter() - began
        if k >= warm and (k - warm) % window == 0:
            marks.append(mark())
        losses.append(step(batches[k % len(batches)]).detach().float())
    marks.append(mark())
    sync(device)
    ended = time.perf_counter()
    seconds = ended - start
    spans = [(a.elapsed_time(b) / 1e3 if cuda else b - a) for a, b in zip(marks, marks[1:])]
    full = [s for i, s in enumerate(spans) if warm + (i + 1) * window <= done]  # whole windows only
    steady = sorted(full)[len(full) // 2] / window if full else seconds / (done - warm)
    values = [float(v) for v in torch.stack(losses).cpu()]
    return {"steps": done, "stopped_early": done < steps, "tokens_per_s": tokens * (done - warm) / seconds,
            "ms_per_step": 1e3 * seconds / (done - warm), "steady_tokens_per_s": tokens / steady,
            "steady_ms_per_step": 1e3 * steady, "window_ms_per_step": [1e3 * s / window for s in full],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "final_loss": final_loss(values), "first_loss": values[0], "losses": values,
            "first_step_seconds": first_step_s,
            # What the run cost beyond its steps at the steady rate: a compiled run's compile and the like.
            "one_time_seconds": max(0.0, ended - began - done * steady)}


def plain_step(zm, model, opt, device, autocast_dtype=torch.bfloat16):
    """One plain step, ``step(batch) -> loss``: forward under torch's autocast (none with autocast_dtype=None),
    backward, the optimizer's step, gradients cleared."""
    def step(batch):
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = zm.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def torch_bf16(zm, model, opt, batches, steps, device):
    """torch's bf16 autocast with the user's fp32 optimizer: the baseline."""
    return timed_loop(plain_step(zm, model, opt, device), batches, steps, device,
                      batches[0]["input_ids"].numel())


def recipe_alone(zm, model, opt, batches, steps, device, recipe):
    """A candidate alone: a plain loop of its recipe (what the tuning measured, for longer)."""
    applied = AppliedRecipe(recipe, model, opt)
    try:
        return timed_loop(lambda b: applied.train_step(lambda: zm.loss(model, b)), batches, steps, device,
                          batches[0]["input_ids"].numel())
    finally:
        applied.undo()


def tuned(zm, model, opt, tune_batches, batches, steps, device, tune_options, out_dir=None):
    """policy="tune" through the controller, then its own train_step for `steps` steps. The controller gets a copy
    of `opt` (its hyperparameters and state): a recipe with bf16 weights or moments converts the optimizer it is
    given in place, and the torch and alone runs after this one reuse `opt` as torch's."""
    own = type(opt)(zm.model.parameters())
    own.load_state_dict(copy.deepcopy(opt.state_dict()))  # (its groups' hyperparameters too; no tensor shared)
    t0 = time.perf_counter()
    amp = AdaptiveMixedPrecision(model, own, policy="tune", progress=False,
                                 tune=dict(batches=tune_batches, loss_fn=zm.loss, **tune_options))
    setup_s = time.perf_counter() - t0
    try:
        print(amp.tuning.table(), flush=True)
        if out_dir:
            amp.tuning.save(out_dir)
        r = timed_loop(lambda b: amp.train_step(lambda: zm.loss(model, b)), batches, steps, device,
                       batches[0]["input_ids"].numel())
        r.update(chosen=amp.tuning.recipe.name, policy=str(amp.policy), setup_seconds=setup_s,
                 tuning_seconds=amp.tuning.seconds, tuning_compile_seconds=amp.tuning.compile_seconds,
                 tuning=amp.tuning.to_dict(),
                 events=[e.to_dict() for e in amp.events])
        return r
    finally:
        amp.remove()


def oom_run(zm, batches, device, fraction, steps):
    """A real OOM at run time: the memory guard must move lighter and keep training."""
    from ..pressure import MemoryGuard

    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-4)
        amp = AdaptiveMixedPrecision(zm.model, opt, policy="params=float32,compute=bfloat16", progress=False,
                                     memory_guard=MemoryGuard(check_every=5))
        losses = []
        for k in range(steps):
            losses.append(float(amp.train_step(lambda b=batches[k % len(batches)]: zm.loss(zm.model, b))))
        return {"fraction": fraction, "losses": losses, "policy": str(amp.policy),
                "events": [e.to_dict() for e in amp.events if e.kind.startswith("memory")]}
    except torch.OutOfMemoryError as exc:
        return {"fraction": fraction, "error": str(exc)[:500]}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def time_to_common_loss(tuned: dict, ref: dict) -> dict:
    """How soon two runs on the same batches reach the loss both reach: the higher of their final losses. A run
    reaches a loss at the first step where the mean of its losses over the last 10% of its steps (as
    :func:`final_loss` takes them) is at or below it; its seconds are its steps at its steady step time. A run
    a little behind at equal steps may still get there sooner, being faster."""
    target = max(tuned["final_loss"], ref["final_loss"])
    out = {"loss": target}
    for name, r in (("tuned", tuned), ("torch", ref)):
        losses = r["losses"]
        window = max(1, len(losses) // 10)
        # (At the latest its last step, where that mean is its final loss; a final loss computed apart, as a
        # sharded run's mean over ranks, may differ in its last bits.)
        steps = next((i + 1 for i in range(window - 1, len(losses))
                      if sum(losses[i + 1 - window:i + 1]) / window <= target), len(losses))
        out[f"{name}_steps"] = steps
        out[f"{name}_seconds"] = steps * r["steady_ms_per_step"] / 1e3
    out["tuned_sooner"] = out["torch_seconds"] / out["tuned_seconds"]
    return out


def targets(run: dict) -> dict:
    """The comparisons from what ran (left out where a part did not run)."""
    out = {}
    t, ref = run.get("tuned", {}).get(0), run.get("torch_bf16", {}).get(0)
    alone, trials = run.get("alone", {}), (t or {}).get("tuning", {}).get("trials", [])
    agreeing = [x["name"] for x in trials if x.get("agrees") and x.get("fits") and x["name"] in alone]
    best = max(agreeing, key=lambda n: alone[n]["tokens_per_s"], default=None)
    if t and best:
        out["best_agreeing_alone"] = best
        out["tuned_vs_best_agreeing_alone"] = t["tokens_per_s"] / alone[best]["tokens_per_s"]
        out["tuned_vs_best_agreeing_alone_steady"] = t["steady_tokens_per_s"] / alone[best]["steady_tokens_per_s"]
        if t["chosen"] in alone:  # the choice itself: did tuning pick the best?
            out["choice_alone_vs_best_agreeing_alone"] = \
                alone[t["chosen"]]["tokens_per_s"] / alone[best]["tokens_per_s"]
    if t and ref:
        out["tuned_vs_torch_bf16"] = t["tokens_per_s"] / ref["tokens_per_s"]
        out["tuned_vs_torch_bf16_steady"] = t["steady_tokens_per_s"] / ref["steady_tokens_per_s"]
        out["final_loss_tuned_minus_torch_seed0"] = t["final_loss"] - ref["final_loss"]
        out["tuning_fraction_of_10k_steps"] = t["setup_seconds"] / (10000 * t["ms_per_step"] / 1e3)
        # The targets: the share of 10,000 steps at the chosen recipe's steady step time, and never a loss.
        share = t["setup_seconds"] / (10000 * t["steady_ms_per_step"] / 1e3)
        out["tuning_fraction_of_10k_steps_steady"] = share
        out["tuning_compile_seconds"] = t.get("tuning_compile_seconds", 0.0)
        cold = run.get("cold")
        if cold and cold["chosen"] == t["chosen"] and t.get("one_time_seconds") is not None:
            # Compiled: what tuning adds to the time before steady training, the compile the user makes anyway
            # counted once: the tuning, plus the tuned run's one-time seconds (its compiles, warm with the
            # tuning's kernels), less those of the same recipe's run without tuning, started cold.
            extra = t["setup_seconds"] + t["one_time_seconds"] - cold["one_time_seconds"]
            out["seconds_beyond_untuned_cold_start"] = extra
            share = extra / (10000 * t["steady_ms_per_step"] / 1e3)
            out["tuning_fraction_of_10k_steps_compile_once"] = share
        out["cost_within_target"] = share <= COST_TARGET
        out["never_a_loss"] = out["tuned_vs_torch_bf16_steady"] >= NEVER_A_LOSS
    torch_losses = [r["final_loss"] for r in run.get("torch_bf16", {}).values()]
    if len(torch_losses) > 1:
        lo, hi = min(torch_losses), max(torch_losses)
        out["torch_seed_range"] = [lo, hi]
        tuned_losses = [r["final_loss"] for r in run.get("tuned", {}).values()]
        # Within the seed spread: the tuned runs' mean differs from torch's mean by no more than torch's own
        # seeds differ from each other.
        diff = sum(tuned_losses) / len(tuned_losses) - sum(torch_losses) / len(torch_losses)
        out["mean_final_loss_tuned_minus_torch"] = diff
        out["loss_within_seed_spread"] = abs(diff) <= hi - lo
        out["loss_not_worse_than_seed_spread"] = diff <= hi - lo  # a lower loss is no failure
    both = [s for s in run.get("tuned", {}) if s in run.get("torch_bf16", {})]
    if both:
        out["time_to_common_loss"] = {s: time_to_common_loss(run["tuned"][s], run["torch_bf16"][s]) for s in both}
    cost = run.get("cost")
    if cost and "fraction_of_10k_steps" in cost:
        out["tuning_fraction_of_10k_steps_at_cost_shape"] = cost["fraction_of_10k_steps"]
    return out


def verdict(run: dict) -> list:
    """The comparisons of :func:`targets` as sentences."""
    t, name = run.get("targets", {}), f"{run['model']} {run['mode']} ({run['shape']} tokens a step)"
    tuned0 = run.get("tuned", {}).get(0, {})
    lines = []
    if "tuned_vs_torch_bf16" in t:
        ratio = t["tuned_vs_torch_bf16_steady"]
        lines.append(f"{name}: the tuning chose {tuned0['chosen']}; it trained at {ratio:.2f}x the tokens/s of "
                     f"torch's bf16 autocast ({'faster' if ratio >= 1.01 else 'slower' if ratio <= 0.99 else 'the same speed'}"
                     f"), the tuning took {tuned0['setup_seconds']:.1f} s, "
                     f"{100 * t['tuning_fraction_of_10k_steps']:.2f}% of 10,000 such steps.")
    if "cost_within_target" in t:
        tuning = tuned0.get("tuning", {})
        timing, graphs = tuning.get("timing") or "", describe_graphs(tuning.get("inductor_graphs"))
        graphs = f"; {graphs}" if graphs else ""
        lines.append(f"{name}: tuning {tuned0['setup_seconds']:.1f} s ({t['tuning_compile_seconds']:.1f} s of it "
                     f"compiling{graphs}) is {100 * t['tuning_fraction_of_10k_steps_steady']:.2f}% of 10,000 steps "
                     f"at the chosen recipe's {tuned0['steady_ms_per_step']:.2f} ms"
                     + ("" if "tuning_fraction_of_10k_steps_compile_once" in t else
                        f": {'within' if t['cost_within_target'] else 'over'} the {COST_TARGET:.0%} target")
                     + f"; its steady "
                     f"tokens/s {t['tuned_vs_torch_bf16_steady']:.3f}x torch's bf16 autocast "
                     f"{'(compiled) ' if run['mode'] == 'compiled' else ''}on the same batches: "
                     f"{'meets' if t['never_a_loss'] else 'misses'} the {NEVER_A_LOSS}x never-a-loss target."
                     + (f" Timing: {timing}." if timing else ""))
    if "tuning_fraction_of_10k_steps_compile_once" in t:
        cold = run["cold"]
        lines.append(f"{name}: counting the compile the user makes anyway once: tuning {tuned0['setup_seconds']:.1f} s "
                     f"+ the tuned run's one-time {tuned0['one_time_seconds']:.1f} s (first step "
                     f"{tuned0['first_step_seconds']:.1f} s) - {cold['chosen']}'s without tuning, in a fresh process, "
                     f"{cold['one_time_seconds']:.1f} s (first step {cold['first_step_seconds']:.1f} s) = "
                     f"{t['seconds_beyond_untuned_cold_start']:.1f} s, "
                     f"{100 * t['tuning_fraction_of_10k_steps_compile_once']:.2f}% of 10,000 steps: "
                     f"{'within' if t['cost_within_target'] else 'over'} the {COST_TARGET:.0%} target.")
    if "best_agreeing_alone" in t:
        lines.append(f"{name}: against the fastest candidate that agreed with fp32, {t['best_agreeing_alone']}, run "
                     f"alone: {t['tuned_vs_best_agreeing_alone_steady']:.2f}x its tokens/s.")
    if "loss_within_seed_spread" in t:
        lo, hi = t["torch_seed_range"]
        lines.append(f"{name}: final loss {'inside' if t['loss_within_seed_spread'] else 'outside'} torch's seed "
                     f"spread (mean difference {t['mean_final_loss_tuned_minus_torch']:+.4f}, torch's seeds "
                     f"{lo:.4f} .. {hi:.4f}).")
    elif "final_loss_tuned_minus_torch_seed0" in t:
        lines.append(f"{name}: final loss {t['final_loss_tuned_minus_torch_seed0']:+.4f} against torch's (one seed: "
                     "no spread to judge it by; --seeds 2 or more).")
    for seed, c in t.get("time_to_common_loss", {}).items():
        lines.append(f"{name}, seed {seed}: to the loss both runs reach ({c['loss']:.4f}), the tuned run took "
                     f"{c['tuned_steps']} steps, {c['tuned_seconds']:.1f} s at its steady rate, torch "
                     f"{c['torch_steps']} steps, {c['torch_seconds']:.1f} s: {c['tuned_sooner']:.2f}x as fast.")
    if "tuning_fraction_of_10k_steps_at_cost_shape" in t:
        lines.append(f"{name}: tuning at {run['cost']['shape']} cost "
                     f"{100 * t['tuning_fraction_of_10k_steps_at_cost_shape']:.2f}% of 10,000 steps there.")
    for what in run.get("skipped", []):
        lines.append(f"{name}: {what} did not run (not enough of --max-seconds left).")
    return lines


def plot_losses(run: dict, path: str) -> None:
    """Every tuned and torch run side by side (report.plot_recipes: losses, step times over the windows)."""
    runs = {f"{'torch bf16' if kind == 'torch_bf16' else r['chosen']} s{seed}":
            {"losses": r["losses"], "step_times": r.get("window_ms_per_step", [])}
            for kind in ("torch_bf16", "tuned") for seed, r in run.get(kind, {}).items()}
    try:
        plot_recipes(runs, path, title=f"{run['model']} {run['mode']}, {run['shape']} tokens a step: torch's bf16 "
                     "autocast and the tuned recipe, by seed (s0, s1, ...)")
    except ImportError:  # no matplotlib: the JSON has the losses
        pass


class Evidence:
    def __init__(self, args, device):
        self.args, self.device = args, device
        self.started = time.perf_counter()
        self.path = os.path.join(args.out, "evidence.json")
        self.data = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                         time.gmtime()),
                     "runs": []}

    def may_start(self, what: str, run: dict, estimate: float = 0.0) -> bool:
        """Whether `what`, expected to take `estimate` seconds, ends before --max-seconds."""
        left = self.args.max_seconds - (time.perf_counter() - self.started)
        if self.args.deadline:
            left = min(left, self.args.deadline - time.time())
        if left > estimate:
            print(f"-- {run['model']} {run['mode']}: {what} ({time.strftime('%H:%M:%S')}, {left:.0f} s left, "
                  f"about {estimate:.0f} s needed)", flush=True)
            self.began = time.perf_counter()
            return True
        run.setdefault("skipped", []).append(what)
        print(f"-- {run['model']} {run['mode']}: {what} skipped: about {estimate:.0f} s needed, {left:.0f} s left "
              "before --max-seconds", flush=True)
        return False

    def took(self, run: dict, what: str) -> float:
        """Seconds since the last may_start, recorded in run["seconds"][what]."""
        run.setdefault("seconds", {})[what] = t = time.perf_counter() - self.began
        return t

    def write(self, run: dict) -> None:
        run["targets"] = targets(run)
        with open(self.path, "w") as f:
            json.dump(_jsonable(self.data), f, indent=1)


def cold_choice(name: str, choice: str, args) -> dict:
    """The recipe `choice` through the controller without the tuning (a one-candidate screen: eager, nothing
    compiled), compiled, as a user's run starts: in a new process with empty compile caches, --cold-steps steps.
    Its one-time seconds (the compiles, mostly) are what the tuned run's are compared with, so that the compile
    the user makes anyway counts once."""
    with tempfile.TemporaryDirectory(prefix="adaptive_amp_cold_") as tmp:
        out = os.path.join(tmp, "out")
        cmd = [sys.executable, "-m", "adaptive_amp", "bench", "tune", "--models", name, "--modes", "compiled",
               "--parts", "tuned", "--compiled-candidates", choice, "--seeds", "1",
               "--train-steps", str(args.cold_steps), "--tune-steps", str(args.tune_steps), "--batch",
               str(args.batch), "--seq", str(args.seq), "--lr", str(args.lr), "--device", args.device,
               "--compile-backend", args.compile_backend, "--out", out] + (["--tiny"] if args.tiny else [])
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"))
        env.pop("TRITON_CACHE_DIR", None)  # (inductor's then lies under its cache directory)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the run without tuning failed ({' '.join(cmd)}):\n"
                               + (done.stdout + done.stderr)[-2000:])
        with open(os.path.join(out, "evidence.json")) as f:
            r = json.load(f)["runs"][0]["tuned"]["0"]
    return {k: r[k] for k in ("chosen", "setup_seconds", "first_step_seconds", "one_time_seconds",
                              "steady_ms_per_step", "steps")}


def _fresh_compile_cache():
    """A context of empty compile caches for this process's compiled runs (torch's inductor, and triton's beneath
    it)."""
    import torch._inductor.utils as inductor_utils

    return (getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache)()


def evidence(name, mode, args, device, ev: Evidence):
    """One model in one mode: the parts of the module docstring. With the cold part (compiled mode), its
    compiled runs start from empty compile caches, as torch's run in a fresh process does."""
    fresh = mode == "compiled" and "cold" in args.parts
    with _fresh_compile_cache() if fresh else contextlib.nullcontext():
        _evidence(name, mode, args, device, ev)


def _evidence(name, mode, args, device, ev: Evidence):
    torch._dynamo.reset()
    zm = build(name, args.tiny, device)
    bs, seq = (4, 16) if args.tiny else (args.batch, args.seq)
    model = torch.compile(zm.model, backend=args.compile_backend) if mode == "compiled" else zm.model
    opt = torch.optim.AdamW(zm.model.parameters(), lr=args.lr)
    cands = args.compiled_candidates.split(",") if mode == "compiled" else None
    options = dict(candidates=cands, steps=args.tune_steps, timed_steps=args.timed_steps,
                   rounds=args.compiled_rounds if mode == "compiled" else args.rounds,
                   progress=lambda m: print(m, flush=True))
    run = {"model": name, "mode": mode, "parameters": zm.num_parameters(), "shape": f"{bs}x{seq}",
           "tokens_per_step": bs * seq, "lr": args.lr, "tuned": {}, "torch_bf16": {}, "alone": {}}
    ev.data["runs"].append(run)
    seeds = list(range(args.seeds))
    streams = {0: stream(zm, bs, seq, args.train_steps, 0, device)}
    snaps = {0: Snapshot(zm.model, [opt])}
    out_dir = os.path.join(args.out, f"{name}-{mode}")

    def reseed(s):
        """The model's weights of seed s (in place: a compiled model keeps its graphs), optimizer state empty."""
        if s not in snaps:
            # First the model as built: a tuned run that chose bf16 weights leaves them in bf16 (the controller
            # gives them back as they are), and loading seed s into them would keep them there.
            snaps[0].restore()
            other = build(name, args.tiny, device, seed=s)
            zm.model.load_state_dict(other.model.state_dict())
            del other
            opt.state.clear()
            streams[s] = stream(zm, bs, seq, args.train_steps, s, device)
            snaps[s] = Snapshot(zm.model, [opt])
        snaps[s].restore()

    parts = args.parts
    # First, so that it pays the process's first-tuning costs as a user's tuning does.
    if args.cost_shape and mode == "eager" and "cost" in parts and ev.may_start(f"tuning cost at {args.cost_shape}", run, 60):
        cb, cl = (int(v) for v in args.cost_shape.lower().split("x"))
        big = stream(zm, cb, cl, 8, 0, device)
        res = AdaptivePrecisionSelector().tune(model, opt, big, zm.loss, **options)
        print(res.table(), flush=True)
        res.save(os.path.join(args.out, f"{name}-{mode}-{cb}x{cl}"))
        snaps[0].restore()
        r = recipe_alone(zm, model, opt, big, 40, device, res.recipe)
        run["cost"] = {"shape": args.cost_shape, "chosen": res.recipe.name, "tuning_seconds": res.seconds,
                       "phase_seconds": res.phase_seconds, "ms_per_step": r["ms_per_step"],
                       "fraction_of_10k_steps": res.seconds / (10000 * r["ms_per_step"] / 1e3),
                       "tuning": res.to_dict()}
        ev.took(run, "cost")
        ev.write(run)
        snaps[0].restore()
        # Pinned host memory is cached: the next tuning should pay for its own, as this one did.
        getattr(torch._C, "_host_emptyCache", lambda: None)()
    if "tuned" in parts and ev.may_start("tuned, seed 0", run):
        run["tuned"][0] = tuned(zm, model, opt, streams[0][:8], streams[0], args.train_steps, device, options,
                                out_dir)
        ev.took(run, "tuned 0")
        ev.write(run)
    choice = run["tuned"].get(0, {}).get("chosen") or args.choice
    if mode == "compiled" and "cold" in parts and choice and \
            ev.may_start(f"{choice} without tuning, in a fresh process", run,
                         run["tuned"].get(0, {}).get("one_time_seconds") or 60):
        if device.type == "cuda":
            torch.cuda.empty_cache()  # (this process's cached blocks, for the other process)
        run["cold"] = cold_choice(name, choice, args)
        ev.took(run, "cold")
        ev.write(run)
    # Estimates for the runs below, from the ones before: a compiled run first compiles its recipe again.
    recompile = 0.0
    if mode == "compiled" and 0 in run["tuned"]:
        # (The tuned run's first step compiled the whole model; the tuning compiles blocks at most.)
        recompile = run["tuned"][0].get("first_step_seconds") or 0.0

    def train_estimate():  # a 2000-step run takes about what the last torch run took
        return max((v for k, v in run.get("seconds", {}).items() if k.startswith("torch")), default=0.0)

    def torch_run(s):
        if ev.may_start(f"torch bf16 autocast, seed {s}", run, train_estimate()):
            reseed(s)
            run["torch_bf16"][s] = torch_bf16(zm, model, opt, streams[s], args.train_steps, device)
            ev.took(run, f"torch {s}")
            ev.write(run)
    if "torch" in parts:
        torch_run(0)
    trials = run["tuned"].get(0, {}).get("tuning", {}).get("trials", [])
    recipes = {r.name: r for r in AdaptivePrecisionSelector().candidates(_caps(device), None, cands)[0]}
    for t in trials if "alone" in parts else ():
        if t.get("error") is None and t.get("fits") and t["name"] in recipes and \
                ev.may_start(f"{t['name']} alone", run,
                                     recompile + train_estimate() * args.alone_steps / args.train_steps):
            reseed(0)
            r = recipe_alone(zm, model, opt, streams[0], args.alone_steps, device, recipes[t["name"]])
            run["alone"][t["name"]] = {k: r[k] for k in ("tokens_per_s", "ms_per_step", "steady_tokens_per_s",
                                                         "steady_ms_per_step", "peak_gib", "final_loss")}
            ev.took(run, f"alone {t['name']}")
            ev.write(run)
    spread = args.spread_seeds if args.spread_seeds is not None else seeds[1:]
    for s in spread if "seeds" in parts else ():  # the loss's seed spread (no timing compared across seeds)
        torch_run(s)
        if choice and ev.may_start(f"tuned ({choice}), seed {s}", run, recompile + train_estimate()):
            reseed(s)
            run["tuned"][s] = tuned(zm, model, opt, streams[s][:8], streams[s], args.train_steps, device,
                                    dict(options, candidates=[choice]))
            ev.took(run, f"tuned {s}")
            ev.write(run)
    if args.budget and ev.may_start(f"tuned under a {args.budget} budget", run,
                                    run.get("seconds", {}).get("tuned 0", 0.0)):
        reseed(0)
        run["budget"] = tuned(zm, model, opt, streams[0][:8], streams[0], args.train_steps, device,
                              dict(options, memory_budget=args.budget), out_dir + "-budget")
        ev.took(run, "budget")
        ev.write(run)
    if args.oom_fraction and device.type == "cuda" and mode == "eager" and \
            ev.may_start(f"out of memory at {args.oom_fraction:.0%}", run, 30):
        reseed(0)
        run["oom"] = oom_run(zm, streams[0], device, args.oom_fraction, 30)
        ev.took(run, "oom")
        ev.write(run)
    snaps[0].restore()
    ev.write(run)
    plot_losses(run, os.path.join(args.out, f"{name}-{mode}-losses.png"))
    for kind in ("tuned", "torch_bf16"):
        for s, r in run[kind].items():
            print(f"== {name} {mode} {kind} seed {s}: {r.get('chosen', '')} {r['tokens_per_s']:.0f} tok/s, "
                  f"{r['ms_per_step']:.2f} ms/step, {r['peak_gib']} GiB, final loss {r['final_loss']:.4f}", flush=True)
    for n, r in run["alone"].items():
        print(f"== {name} {mode} alone {n}: {r['tokens_per_s']:.0f} tok/s, {r['peak_gib']} GiB", flush=True)
    print("\n".join(verdict(run)), flush=True)


def _seed_list(text: str):
    try:
        seeds = [int(v) for v in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of seeds (integers >= 0)")
    return seeds


PARTS = ("cost", "tuned", "cold", "torch", "alone", "seeds")


def _parts(text: str) -> set:
    """--parts: names from PARTS, or "none" (only the --budget and --oom-fraction runs)."""
    names = [n.strip() for n in text.split(",")]
    if names == ["none"]:
        return set()
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(map(repr, unknown))}: not a part; choose from "
                                         f"{', '.join(PARTS)} (comma-separated), or none")
    return set(names)


def _caps(device):
    from ..hardware import HardwareDetector

    return HardwareDetector().detect(device)


_EPILOG = """examples (one GPU each; a 2000-step run of GPT-2 medium takes minutes):
  python -m adaptive_amp bench tune --models gpt2-medium --modes eager --batch 4 --seq 512 --cost-shape 8x1024
  python -m adaptive_amp bench tune --models llama-1b --modes compiled --batch 4 --seq 256 --max-seconds 500
  python -m adaptive_amp bench tune --tiny --device cpu --train-steps 20 --alone-steps 5   # CPU smoke run
  python -m adaptive_amp bench tune --tiny --device cpu --modes compiled --compile-backend aot_eager --parts tuned
"""


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m adaptive_amp bench tune", description=__doc__.split("\n", 1)[1],
                                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2-medium", help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--modes", default="eager", help="eager, compiled, or both comma-separated")
    p.add_argument("--batch", type=int, default=8, help="sequences a step")
    p.add_argument("--seq", type=int, default=1024, help="tokens a sequence")
    p.add_argument("--train-steps", type=int, default=2000, help="training steps of the tuned and torch runs")
    p.add_argument("--seeds", type=int, default=2, help="torch bf16 runs (and tuned, when time is left) per seed")
    p.add_argument("--spread-seeds", default=None, type=_seed_list, metavar="S,S,...",
                   help="the seeds of the seeds part (default 1 .. --seeds - 1)")
    p.add_argument("--alone-steps", type=int, default=200, help="steps of each candidate run alone")
    p.add_argument("--parts", default="cost,tuned,cold,torch,alone,seeds", type=_parts,
                   help="what to run, in this order: cost (with --cost-shape), tuned (seed 0), cold (compiled: the "
                        "choice without tuning, in a fresh process), torch (seed 0), alone, seeds (torch, then "
                        "tuned, for every other seed); none: only the --budget and --oom-fraction runs")
    p.add_argument("--cold-steps", type=int, default=100,
                   help="steps of the choice's compiled run without tuning in a fresh process (the cold part)")
    p.add_argument("--choice", default=None, help="the tuned recipe for --parts seeds without tuned (seed 0's)")
    p.add_argument("--cost-shape", default=None, help="BxL: also tune at this shape to measure the tuning's cost")
    p.add_argument("--max-seconds", type=float, default=520.0,
                   help="start no new run after this many seconds (what ran is in evidence.json)")
    p.add_argument("--deadline", type=float, default=None,
                   help="a Unix time: start no run that would end after it (several processes, one call)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny zoo models, 4x16 tokens (a CPU smoke run)")
    p.add_argument("--tune-steps", type=int, default=6, help="the tuning's trial steps per candidate")
    p.add_argument("--rounds", type=int, default=2, help="the tuning's timing rounds (eager)")
    p.add_argument("--compiled-rounds", type=int, default=1,
                   help="compiled: the finalists' compiled timing runs this many times --timed-steps steps after "
                        "its compile (the candidates are screened eagerly, and only the finalists' blocks compile)")
    p.add_argument("--timed-steps", type=int, default=3, help="the tuning's timed steps per round")
    p.add_argument("--compiled-candidates", default="fp32,bf16,bf16-weights,bf16-pure",
                   help="the compiled mode's candidates (each costs an eager screen; only the finalists compile "
                        "their blocks)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile's backend for the compiled mode (aot_eager: a CPU smoke run in seconds)")
    p.add_argument("--budget", default=None, help="also tune under this memory budget (e.g. 20GiB) and train the choice")
    p.add_argument("--oom-fraction", type=float, default=None,
                   help="also train under torch.cuda.set_per_process_memory_fraction(F) with a MemoryGuard")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--out", default="bench_out/tune", help="folder for evidence.json, the tables and the plots")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    ev = Evidence(args, device)
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            evidence(name, mode, args, device, ev)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
