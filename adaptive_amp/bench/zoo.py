"""``python -m adaptive_amp bench zoo``: the zoo at real size under fp32, torch AMP and AdaptiveMixedPrecision.

    python -m adaptive_amp bench zoo --suite recovery [--only gpt2-small,llama-small] [--modes eager,compiled]
        [--steps 150] [--budget-s 540] [--out DIR]
    python -m adaptive_amp bench zoo --suite alarms [--only gpt2,llama,bert,t5,vit,resnet] [--dtypes fp16,bf16]
        [--steps 2000] [--batch N] [--seq-len N] [--budget-s 540] [--out DIR]

Every run trains a fresh model of the zoo (random weights from seed 0) on the
zoo's learnable synthetic batches (``make_batch(batch, seed=step)``) through
adaptive_amp.zoo.train, the loop the CPU tests check; the final loss is the
fp32 loss on a held-out batch.

**recovery** (the claim: recovery in at most 10 steps, final loss within 5% of
fp32's): GPT-2 small with an overflow planted in a transformers Conv1D
(block 5's attention c_proj: its weights scaled so that its fp32 output
reaches 1e6; fp16's max is 65504) and the zoo's Llama small (125M) with two
chained overflowing layers (block 5's up_proj planted; down_proj, which it
feeds, overflows in turn once up_proj computes in fp32). Each is trained
``--steps`` steps in fp32 (TF32), torch AMP (fp16 autocast +
torch.amp.GradScaler) and AdaptiveMixedPrecision with compute forced to fp16
and no islands given (policy ``params=float32,compute=float16``: it must find
the layers itself), eager and compiled. Per run: lost (skipped) steps,
recovery steps (first skipped step to the first step that stepped after it),
final loss and its ratio to fp32's (same mode; the eager fp32 run where the
compiled one did not run), the controller's decisions. An adaptive run PASSes
when recovery <= 10 steps, lost steps <= 10, final loss <= 1.05x fp32's and its
first promotion names the planted layer; torch AMP is shown side by side.
8 sequences of 512 tokens a step, AdamW at 6e-4 (GPT-2 small's rate), no
clipping (as the CPU test of the same scenario; ``--max-grad-norm``), and a
10-step linear warm-up: transformer training starts with one, and it is what
makes a recovery cheap in a real run, since the steps an overflow costs at
the start are the ones with the smallest rate (without it they are the steps
that move the loss most, and "within 5% of fp32" would measure the schedule).

**alarms** (the claim: no anomaly event in ordinary training): every zoo family
(gpt2, llama, bert, t5, vit, resnet), nothing planted, ``--steps`` steps under
AdaptiveMixedPrecision in fp16 (``params=float32,compute=float16``: our
dynamic loss scaling) and in bf16 (``params=float32,compute=bfloat16``), eager,
with the controller's defaults (reads every 50 steps, per-layer statistics every
200; the monitor's default detectors); AdamW at 3e-4, a linear warm-up
over the first 5% of the steps, clipping at 1.0. The "small" configurations at a small
workload (token models 8 sequences of 128 tokens, ViT 8 images of 224 pixels,
the ResNet 32 images of 64 pixels), so that twelve runs of 2000 steps take
about ten minutes on one H200. Per run: anomaly events (adaptive_amp.monitor.KINDS) per 1000
steps, by kind, and policy changes (promote, switch_compute, ...: false
actions); PASS when there are none.

Common: runs go in order of importance; no run starts after ``--budget-s``
seconds, nor one that would end after it judging by the runs already done
(both reported as "not run"). DIR/zoo_training_<suite>.json and .txt are
rewritten after every run (a crash keeps what came before). ``--tiny-cpu``: the
tiny models on the CPU, a few steps (tests/test_bench_zoo.py).
Exit status 0 when every run that ran passed (torch AMP and fp32 rows have no
verdict).

Expected time on one H200 (estimates, not measured): recovery about 5.5
minutes (eager runs ~10 s each; compiled ones 35-70 s, mostly compilation),
alarms about 5-6 minutes (12 runs of 20-35 s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

from .. import zoo
from ..monitor import KINDS
from ..report import POLICY_EVENT_KINDS
from ..zoo import train as zoo_train

#: recovery: name -> (family, size, the planted layer and the layers it makes overflow, in order)
RECOVERY = {
    "gpt2-small": ("gpt2", "small", ("transformer.h.5.attn.c_proj",)),
    "llama-small": ("llama", "small", ("model.layers.5.mlp.up_proj", "model.layers.5.mlp.down_proj")),
}
_TINY_RECOVERY = {"gpt2": ("transformer.h.1.attn.c_proj",),
                  "llama": ("model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj")}
PLANT_AMAX = 1e6  # the planted layer's fp32 output amax (fp16's max is 65504)
ALARM_FAMILIES = ("gpt2", "llama", "bert", "t5", "vit", "resnet")
#: alarms: family -> batch size at the small workload (token models: --seq-len tokens per sequence)
ALARM_BATCH = {"gpt2": 8, "llama": 8, "bert": 8, "t5": 8, "vit": 8, "resnet": 32}
ALARM_SEQ_LEN = 128
ALARM_MAX_GRAD_NORM = 1.0  # alarms: ordinary training clips
DTYPES = {"fp16": "params=float32,compute=float16", "bf16": "params=float32,compute=bfloat16"}
_TOKEN_FAMILIES = ("gpt2", "llama", "bert", "t5")


def _log(start, msg):
    print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True)


def _free(device):
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak(device):
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


def _fp32_amax(zm, layers, batch):
    """{layer: {"input": amax, "output": amax}} in fp32 on `batch`, for each of `layers`: the chain the planted
    layer starts (a layer overflows in fp16 when either is beyond 65504; its input overflows in autocast's
    cast to fp16)."""
    mods = dict(zm.model.named_modules())
    seen = {}

    def amax(x):
        t = x if isinstance(x, torch.Tensor) else x[0]
        return float(t.detach().float().abs().max())

    def hook(name):
        def h(mod, args, kwargs, out):
            inp = args[0] if args else next(iter(kwargs.values()))
            seen[name] = {"input": amax(inp), "output": amax(out)}
        return h

    handles = [mods[n].register_forward_hook(hook(n), with_kwargs=True) for n in layers]
    try:
        with torch.no_grad():
            zm.model(**zm.inputs(batch))
    finally:
        for h in handles:
            h.remove()
    return seen


def _progress(start, label, steps):
    """A progress line after the first step (which compiles, when compiled) and every fifth of the run."""
    t0 = time.perf_counter()

    def report(i, loss):
        _log(start, f"{label}: step {i + 1}/{steps} loss {loss:.4f} ({time.perf_counter() - t0:.1f} s in this run)")
    return report, max(1, steps // 5)


# ---------------------------------------------------------------- recovery
def recovery_plan(names, modes):
    """(config, mode, recipe) in order of importance: every eager run, then the compiled adaptive runs, then the
    compiled fp32 references and torch AMP."""
    plan = [(n, "eager", r) for n in names for r in ("fp32", "adaptive", "torch-fp16")] if "eager" in modes else []
    if "compiled" in modes:
        plan += [(n, "compiled", r) for r in ("adaptive", "fp32", "torch-fp16") for n in names]
    return plan


def run_recovery(name, mode, recipe, args, device, start):
    family, size, chain = RECOVERY[name]
    if args.tiny_cpu:
        size, chain = "tiny", _TINY_RECOVERY[family]
    torch._dynamo.reset()
    t0 = time.perf_counter()
    zm = zoo.build(family, size, seed=0, device=device)
    seq_len = args.seq_len if family in _TOKEN_FAMILIES else None
    plant_batch = zm.make_batch(2, seed=999, device=device, seq_len=seq_len)
    zoo.plant_overflow(zm, chain[0], plant_batch, amax=PLANT_AMAX)
    chain_amax = _fp32_amax(zm, chain, plant_batch)
    report, every = _progress(start, f"recovery {name} {mode} {recipe}", args.steps)
    run = zoo_train.train(zm, recipe, args.steps, batch=args.batch or 8, seq_len=seq_len, lr=args.lr,
                          warmup=args.warmup, max_grad_norm=args.max_grad_norm,
                          compile_model=mode == "compiled", policy=zoo_train.FP16, eval_batch=args.eval_batch,
                          progress=report, progress_every=every)
    row = {"suite": "recovery", "config": name, "size": size, "mode": mode, "recipe": recipe, "steps": args.steps,
           "batch": args.batch or 8, "seq_len": seq_len or zm.seq_len, "lr": args.lr, "warmup": args.warmup,
           "max_grad_norm": args.max_grad_norm, "planted": chain[0], "chain_fp32_amax": chain_amax, "lost_steps": run.lost_steps,
           "recovery_steps": run.recovery_steps, "recovered": run.recovered,
           "first_skipped": run.stepped.index(False) if run.lost_steps else None,
           "skipped_at": [i for i, s in enumerate(run.stepped) if not s][:30],
           "final_loss": run.final_loss, "first_loss": run.losses[0],
           "losses_every_10": run.losses[::10] + [run.losses[-1]],
           "first_step_s": round(run.first_step_s, 4), "step_ms": round(run.step_ms, 2)}
    if run.amp is not None:
        amp = run.amp
        amp.report(plots=False)  # reads the last, partial window
        promotes = [e for e in amp.events if e.kind == "promote"]
        row["decisions"] = [(e.step, e.kind, e.data.get("layers", e.layer)) for e in amp.events
                            if e.kind in POLICY_EVENT_KINDS]
        row["policy_end"] = str(amp.policy)
        row["planted_promoted"] = bool(promotes) and chain[0] in promotes[0].data.get("layers", [promotes[0].layer])
        row["anomalies"] = sorted({e.kind for e in amp.events if e.kind in KINDS})
        amp.remove()
    row["peak_mem_GiB"] = _peak(device)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    del run, zm
    _free(device)
    return row


def fill_verdicts(rows):
    """Ratios to the fp32 run of the same configuration (same mode, else eager) and the adaptive runs'
    checks; recomputed over all rows after every run."""
    fp32 = {(r["config"], r["mode"]): r["final_loss"] for r in rows
            if r.get("recipe") == "fp32" and "final_loss" in r}
    for r in rows:
        if "final_loss" not in r or r["recipe"] == "fp32":
            continue
        ref_mode = r["mode"] if (r["config"], r["mode"]) in fp32 else "eager"
        ref = fp32.get((r["config"], ref_mode))
        r["fp32_final_loss"], r["fp32_mode"] = ref, ref_mode if ref is not None else None
        r["ratio_to_fp32"] = round(r["final_loss"] / ref, 4) if ref else None
        if r["recipe"] == "adaptive":
            checks = {"recovery<=10": r["recovery_steps"] <= 10, "lost<=10": r["lost_steps"] <= 10,
                      "loss<=1.05xfp32": (r["ratio_to_fp32"] is not None and math.isfinite(r["final_loss"])
                                          and r["ratio_to_fp32"] <= 1.05),
                      "planted_promoted": r["planted_promoted"]}
            r["checks"], r["ok"] = checks, all(checks.values())


def _unfinished_line(head, r):
    """A table line for a run that did not start (budget) or stopped with an error."""
    if r.get("not_run"):
        return f"{head} {'-':7} not run: {r['not_run']}"
    return f"{head} {'FAIL':7} error: {r['error']}"


def recovery_table(rows):
    lines = [f"{'config':12} {'mode':8} {'recipe':10} {'verdict':7} {'lost':>4} {'recov':>5} {'final':>8} "
             f"{'fp32':>8} {'ratio':>6} {'1st s':>6} {'ms/st':>6}  decisions / failed checks"]
    for r in rows:
        head = f"{r['config']:12} {r['mode']:8} {r['recipe']:10}"
        if r.get("not_run") or "error" in r:
            lines.append(_unfinished_line(head, r))
            continue
        verdict = ("PASS" if r["ok"] else "FAIL") if "ok" in r else ""
        ref = r.get("fp32_final_loss")
        fp32 = f"{ref:8.4f} {r['ratio_to_fp32']:6.3f}" if ref is not None else f"{'':8} {'':6}"
        recov = f"{r['recovery_steps']:5d}" if r["recovered"] else f"{'never':>5}"
        tail = ""
        if r["recipe"] == "adaptive":
            failed = [k for k, v in r.get("checks", {}).items() if not v]
            tail = f"{r['decisions']}" + (f" / FAILED {','.join(failed)}" if failed else "")
        lines.append(f"{head} {verdict:7} {r['lost_steps']:4d} {recov} {r['final_loss']:8.4f} {fp32} "
                     f"{r['first_step_s']:6.1f} {r['step_ms']:6.1f}  {tail}")
    return "\n".join(lines)


# ---------------------------------------------------------------- alarms
def alarms_plan(families, dtypes, modes):
    return [(f, m, d) for m in modes for f in families for d in dtypes]


def run_alarms(family, mode, dtype, args, device, start):
    torch._dynamo.reset()
    t0 = time.perf_counter()
    zm = zoo.build(family, "tiny" if args.tiny_cpu else "small", seed=0, device=device)
    seq_len = (args.seq_len or ALARM_SEQ_LEN) if family in _TOKEN_FAMILIES else None
    if args.tiny_cpu and family in _TOKEN_FAMILIES:
        seq_len = args.seq_len or None  # the tiny configuration's own length
    batch = args.batch or (4 if args.tiny_cpu else ALARM_BATCH[family])
    report, every = _progress(start, f"alarms {family} {dtype} {mode}", args.steps)
    warmup = args.warmup
    run = zoo_train.train(zm, "adaptive", args.steps, batch=batch, seq_len=seq_len, lr=args.lr, warmup=warmup,
                          max_grad_norm=args.max_grad_norm, compile_model=mode == "compiled", policy=DTYPES[dtype],
                          eval_batch=args.eval_batch, progress=report, progress_every=every)
    amp = run.amp
    amp.report(plots=False)  # reads the last, partial window
    anomalies = [e for e in amp.events if e.kind in KINDS]
    actions = [e for e in amp.events if e.kind in POLICY_EVENT_KINDS]
    by_kind = {}
    for e in anomalies:
        by_kind[e.kind] = by_kind.get(e.kind, 0) + 1
    k = min(50, len(run.losses))
    row = {"suite": "alarms", "family": family, "size": zm.size, "mode": mode, "dtype": dtype,
           "steps": args.steps, "batch": batch, "seq_len": seq_len or zm.seq_len, "lr": args.lr, "warmup": warmup,
           "max_grad_norm": args.max_grad_norm,
           "read_every": amp.monitor.read_every, "policy_start": amp.policy_history[0][1],
           "policy_end": str(amp.policy), "anomalies": len(anomalies),
           "per_1000_steps": round(1000 * len(anomalies) / args.steps, 2), "by_kind": by_kind,
           "events": [str(e) for e in anomalies[:20]], "false_actions": [str(e) for e in actions],
           "skipped_steps": run.lost_steps, "first_loss": run.losses[0],
           "loss_first_10": statistics.fmean(run.losses[:10]), f"loss_last_{k}": statistics.fmean(run.losses[-k:]),
           "losses_every_50": run.losses[::50] + [run.losses[-1]], "final_loss": run.final_loss,
           "first_step_s": round(run.first_step_s, 4), "step_ms": round(run.step_ms, 2)}
    row["ok"] = not anomalies and not actions and math.isfinite(run.final_loss)
    amp.remove()
    row["peak_mem_GiB"] = _peak(device)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    del run, zm, amp
    _free(device)
    return row


def alarms_table(rows):
    lines = [f"{'family':7} {'dtype':5} {'mode':8} {'verdict':7} {'events':>6} {'/1000':>6} {'actions':>7} "
             f"{'skipped':>7} {'loss 1st10':>10} {'last':>8} {'ms/st':>6} {'wall':>6}  by kind / events"]
    for r in rows:
        head = f"{r['family']:7} {r['dtype']:5} {r['mode']:8}"
        if r.get("not_run") or "error" in r:
            lines.append(_unfinished_line(head, r))
            continue
        last = next(v for key, v in r.items() if key.startswith("loss_last_"))
        lines.append(f"{head} {'PASS' if r['ok'] else 'FAIL':7} {r['anomalies']:6d} {r['per_1000_steps']:6.2f} "
                     f"{len(r['false_actions']):7d} {r['skipped_steps']:7d} {r['loss_first_10']:10.4f} "
                     f"{last:8.4f} {r['step_ms']:6.1f} {r['wall_s']:6.1f}  "
                     f"{r['by_kind'] or '-'}{' / ' + '; '.join(r['events'][:3]) if r['events'] else ''}"
                     f"{' / ' + '; '.join(r['false_actions'][:3]) if r['false_actions'] else ''}")
    return "\n".join(lines)


def verdict(suite, rows) -> str:
    """What the rows show, in a sentence or two."""
    ran = [r for r in rows if not r.get("not_run") and "error" not in r]
    failed = [r for r in rows if r.get("ok") is False]
    skipped = len(rows) - len(ran) - len([r for r in rows if "error" in r])
    tail = f" ({skipped} run(s) not started: budget)" if skipped else ""
    if suite == "recovery":
        ours = [r for r in ran if r.get("recipe") == "adaptive"]
        torch_lost = [r["lost_steps"] for r in ran if r.get("recipe") == "torch-fp16"]
        if not ours:
            return "verdict: no adaptive run finished" + tail
        head = (f"verdict: AdaptiveMixedPrecision recovered from the planted overflow in every run "
                f"(within {max(r['recovery_steps'] for r in ours)} steps, {max(r['lost_steps'] for r in ours)} steps "
                f"lost, final loss at most "
                f"{max(r['ratio_to_fp32'] or 0 for r in ours):.3f}x fp32's)" if not failed else
                "verdict: FAILED: " + "; ".join(f"{r.get('config')} {r.get('mode')}: "
                                                + ",".join(k for k, v in r.get("checks", {}).items() if not v)
                                                for r in failed))
        if torch_lost:
            head += f"; torch AMP lost {min(torch_lost)} to {max(torch_lost)} steps of the same runs"
        return head + tail
    events = sum(r.get("anomalies", 0) for r in ran)
    actions = sum(len(r.get("false_actions", [])) for r in ran)
    steps = sum(r.get("steps", 0) for r in ran)
    return (f"verdict: {len(ran)} ordinary runs, {steps} steps: {events} anomaly event(s) and {actions} policy "
            f"change(s) ({'none, as expected' if not (events or actions) else 'each one a false alarm'})" + tail)


# ---------------------------------------------------------------- driver
def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m adaptive_amp bench zoo", description=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", required=True, choices=("recovery", "alarms"),
                   help="recovery: planted fp16 overflows; alarms: ordinary training, no event expected")
    p.add_argument("--out", default="bench_out/zoo", help="folder for zoo_training_<suite>.json and .txt")
    p.add_argument("--only", default=None, help="recovery: configurations (gpt2-small,llama-small); "
                   "alarms: families (gpt2,llama,bert,t5,vit,resnet); comma-separated")
    p.add_argument("--modes", default=None, help="eager,compiled (recovery's default) or eager (alarms')")
    p.add_argument("--dtypes", default="fp16,bf16", help="alarms: fp16 and/or bf16")
    p.add_argument("--steps", type=int, default=None, help="recovery 150, alarms 2000 (tiny CPU: 8 and 30)")
    p.add_argument("--batch", type=int, default=None, help="sequences or images per step (recovery 8; alarms: "
                   "per family, see ALARM_BATCH)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (recovery 512; alarms 128)")
    p.add_argument("--lr", type=float, default=None, help="AdamW's learning rate (recovery 6e-4, alarms 3e-4; "
                   "tiny CPU 3e-3)")
    p.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (recovery 10, alarms 5%% of "
                   "--steps)")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip at this norm (0: no clipping; recovery "
                   f"default: none, alarms: {ALARM_MAX_GRAD_NORM:g})")
    p.add_argument("--eval-batch", type=int, default=None, help="held-out batch size (16; tiny CPU 64)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no run after this many seconds, nor one "
                   "that would end after them judging by the runs done")
    p.add_argument("--tiny-cpu", action="store_true", help="smoke run: tiny models on the CPU, a few steps")
    args = p.parse_args(argv)
    recovery = args.suite == "recovery"
    device = "cpu" if args.tiny_cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench zoo needs a CUDA GPU (or --tiny-cpu for a smoke run)")
    args.steps = args.steps or ((8 if recovery else 30) if args.tiny_cpu else (150 if recovery else 2000))
    args.lr = args.lr or (3e-3 if args.tiny_cpu else (6e-4 if recovery else 3e-4))
    args.eval_batch = args.eval_batch or (64 if args.tiny_cpu else 16)
    # Resolved here, so that the report's settings say what the runs did (None: no clipping).
    if args.warmup is None:
        args.warmup = 10 if recovery else max(1, round(0.05 * args.steps))
    if args.max_grad_norm is None:
        args.max_grad_norm = None if recovery else ALARM_MAX_GRAD_NORM
    args.max_grad_norm = args.max_grad_norm or None
    if recovery and not args.tiny_cpu:
        args.seq_len = args.seq_len or 512
    known = RECOVERY if recovery else ALARM_FAMILIES
    names = [n.strip() for n in (args.only or ",".join(known)).split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--only: unknown {'configuration' if recovery else 'family'} {unknown}; choose from "
                         f"{', '.join(known)}")
    modes = [m.strip() for m in (args.modes or ("eager,compiled" if recovery else "eager")).split(",") if m.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if set(modes) - {"eager", "compiled"} or set(dtypes) - set(DTYPES):
        raise SystemExit(f"--modes takes eager,compiled and --dtypes fp16,bf16; got {modes} and {dtypes}")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 reference is "fp32 (TF32)"
        torch.backends.cudnn.allow_tf32 = True
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    report = {"suite": args.suite, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    results = []
    plan = recovery_plan(names, modes) if recovery else alarms_plan(names, dtypes, modes)
    table = recovery_table if recovery else alarms_table
    stem = os.path.join(args.out, f"zoo_training_{args.suite}")

    def save():
        if recovery:
            fill_verdicts(results)
        report["results"], report["elapsed_s"] = results, round(time.perf_counter() - start, 1)
        if not recovery:
            done = [r for r in results if "anomalies" in r]
            report["summary"] = {"runs": len(done), "anomalies": sum(r["anomalies"] for r in done),
                                 "steps": sum(r["steps"] for r in done),
                                 "false_actions": sum(len(r["false_actions"]) for r in done)}
        with open(stem + ".json", "w") as f:
            json.dump(report, f, indent=1)
        text = table(results)
        with open(stem + ".txt", "w") as f:
            f.write(f"{args.suite}: {report['device']}, torch {report['torch']}, {args.steps} steps, "
                    f"{report['elapsed_s']} s\n{text}\n")
        return text

    _log(start, f"{args.suite}: {len(plan)} runs on {report['device']}, {args.steps} steps each, budget "
         f"{args.budget_s:g} s")
    for item in plan:
        key = dict(zip(("config", "mode", "recipe") if recovery else ("family", "mode", "dtype"), item))
        elapsed = time.perf_counter() - start
        similar = [r["wall_s"] for r in results if r.get("mode") == key["mode"] and "wall_s" in r]
        same = [r["wall_s"] for r in results if "wall_s" in r and r.get("mode") == key["mode"]
                and r.get("config", r.get("family")) == item[0]]
        expect = max(same) if same else (statistics.median(similar) if similar else 0.0)
        if elapsed > args.budget_s or elapsed + expect > args.budget_s:
            why = (f"budget {args.budget_s:g} s spent" if elapsed > args.budget_s else
                   f"would end after the {args.budget_s:g} s budget (~{expect:.0f} s, {elapsed:.0f} s gone)")
            results.append({"suite": args.suite, **key, "not_run": why})
            _log(start, f"{' '.join(item)}: not run: {why}")
            save()
            continue
        _log(start, f"{' '.join(item)}: start")
        try:
            r = (run_recovery if recovery else run_alarms)(*item, args, device, start)
        except Exception as exc:  # keep going: the table says which run failed and why
            traceback.print_exc()
            r = {"suite": args.suite, **key, "ok": False, "error": repr(exc)[:300]}
            _free(device)
        results.append(r)
        save()
        _log(start, table([r]).splitlines()[-1])
    text = save()
    print(text, flush=True)
    print(verdict(args.suite, results), flush=True)
    return 0 if all(r.get("ok", True) for r in results if not r.get("not_run")) else 1


if __name__ == "__main__":
    sys.exit(main())
