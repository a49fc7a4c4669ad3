"""GPU evidence for issue 21 (measured policy selection), scaled to fit one short GPU session.

Per model and mode (eager / compiled) it runs, in one process:

1. ``tune``: the A/B trials (table, JSON, PNG under --out);
2. the chosen recipe (applied by ``AdaptiveMixedPrecision(policy="tune")``'s
   own code path, tune.AppliedRecipe) and torch's bf16 autocast with fp32
   AdamW, each for ``--train-steps`` steps from the same initial weights on
   the same batches: tokens/s, peak memory, the final loss (mean of the last
   10%);
3. every runnable candidate alone for ``--alone-steps`` steps (throughput);
4. with ``--budget``: the tuning under that memory budget;
5. with ``--oom-fraction``: a real out-of-memory at run time
   (``torch.cuda.set_per_process_memory_fraction``) under
   ``AdaptiveMixedPrecision(memory_guard=MemoryGuard())``: the run must move to a
   lighter recipe and keep training.

The issue asks for 2000 training steps per run and a few hundred steps per
candidate; the defaults here are 100 and 20 so that the default plan (GPT-2
medium eager with a 20 GiB budget and a real OOM at 30% of the GPU's memory,
Llama 1.1B eager, GPT-2 medium compiled) fits about 8 minutes on one
H100/H200 (say so when quoting the numbers); no run starts after
--max-minutes.

Usage (one GPU)::

    python bench/tune_evidence.py --out bench/results/tune                       # the default plan
    python bench/tune_evidence.py --models gpt2-medium,llama-1b --modes compiled --max-minutes 9
    python bench/tune_evidence.py --tiny --device cpu                            # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from adaptive_amp import zoo  # noqa: E402
from adaptive_amp.recipes import AppliedRecipe  # noqa: E402
from adaptive_amp.report import _jsonable  # noqa: E402
from adaptive_amp.policy import AdaptivePrecisionSelector  # noqa: E402
from adaptive_amp.tune import Snapshot  # noqa: E402

tune = AdaptivePrecisionSelector().tune


def build(name: str, tiny: bool, device):
    """(ZooModel, batch_size, seq_len). llama-1b: TinyLlama's shape (1.1B parameters), random weights."""
    if tiny:
        return zoo.build("gpt2" if name.startswith("gpt2") else "llama", "tiny", seed=0, device=device), 4, 16
    if name == "gpt2-medium":
        return zoo.build("gpt2", "medium", seed=0, device=device), 8, 1024
    if name == "llama-1b":
        import transformers as tf

        from adaptive_amp.zoo.model import ZooModel, causal_lm_batches, next_token_loss

        config = tf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                max_position_embeddings=2048, attention_dropout=0.0, use_cache=False,
                                tie_word_embeddings=False)
        with torch.device(device):
            torch.manual_seed(0)
            model = tf.LlamaForCausalLM(config)
        model.train()
        return ZooModel("llama", "1b", model, causal_lm_batches(32000, 1024), ("input_ids",), next_token_loss, 1024,
                        config), 4, 1024
    raise SystemExit(f"unknown model {name!r}: gpt2-medium or llama-1b")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train(zm, model, opt, batches, steps, device, recipe=None):
    """`steps` steps of `recipe` (None: torch bf16 autocast, fp32 weights); tokens/s, peak memory, losses."""
    tokens = batches[0]["input_ids"].numel()
    applied = AppliedRecipe(recipe, model, opt) if recipe is not None else None
    scaler = applied.scaler if applied else None
    step_opt = applied.optimizer if applied else opt
    losses = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warm = min(5, steps // 5)
    start = None
    try:
        for k in range(steps):
            if k == warm:
                sync(device)
                start = time.perf_counter()
            ctx = applied.autocast() if applied else torch.autocast(device.type, dtype=torch.bfloat16)
            with ctx:
                loss = zm.loss(model, batches[k % len(batches)])
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(step_opt)
                scaler.update()
            else:
                loss.backward()
                step_opt.step()
            step_opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().float())
        sync(device)
        seconds = time.perf_counter() - start
    finally:
        if applied:
            applied.undo()
    values = [float(v) for v in torch.stack(losses).cpu()]
    tail = max(1, len(values) // 10)
    return {"steps": steps, "tokens_per_s": tokens * (steps - warm) / seconds,
            "ms_per_step": 1e3 * seconds / (steps - warm),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
            "final_loss": sum(values[-tail:]) / tail, "first_loss": values[0], "losses": values}


def oom_run(zm, batches, device, fraction, steps):
    """A real OOM at run time: the memory guard must move lighter and keep training."""
    from adaptive_amp import AdaptiveMixedPrecision
    from adaptive_amp.pressure import MemoryGuard

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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="with --modes: every model in every mode (default: the plan "
                                                  "below)")
    p.add_argument("--modes", default="eager")
    p.add_argument("--max-minutes", type=float, default=8.0,
                   help="start no new run after this many minutes (what ran is in evidence.json)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny zoo models (a CPU smoke run of this script)")
    p.add_argument("--tune-steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timed-steps", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=100)
    p.add_argument("--alone-steps", type=int, default=20)
    p.add_argument("--compiled-candidates", default="fp32,bf16,bf16-pure",
                   help="compiling each candidate takes long: fewer for the compiled mode")
    p.add_argument("--budget", default=None)
    p.add_argument("--oom-fraction", type=float, default=None)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--out", default="bench/results/tune")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "args": vars(args), "runs": []}
    if args.models:
        plan = [(m, mode, args.budget, args.oom_fraction) for m in args.models.split(",")
                for mode in args.modes.split(",")]
    else:  # the default plan: the budget and OOM targets on GPT-2 medium, eager
        plan = [("gpt2-medium", "eager", args.budget or "20GiB", args.oom_fraction or 0.3),
                ("llama-1b", "eager", None, None), ("gpt2-medium", "compiled", None, None)]
    started = time.perf_counter()
    for name, mode, budget, oom_fraction in plan:
        if time.perf_counter() - started > 60 * args.max_minutes:
            print(f"== {name} {mode}: skipped, past --max-minutes {args.max_minutes}", flush=True)
            results["runs"].append({"model": name, "mode": mode, "skipped": "past --max-minutes"})
            continue
        t0 = time.perf_counter()
        print(f"== {name} {mode} ({time.strftime('%H:%M:%S')})", flush=True)
        torch._dynamo.reset()
        zm, bs, seq = build(name, args.tiny, device)
        batches = [zm.make_batch(bs, seed=i, device=device, seq_len=seq) for i in range(8)]
        model = torch.compile(zm.model) if mode == "compiled" else zm.model
        opt = torch.optim.AdamW(zm.model.parameters(), lr=args.lr)
        cands = args.compiled_candidates.split(",") if mode == "compiled" else None
        snap = Snapshot(zm.model, [opt])  # every run below starts from the same weights and state
        run = {"model": name, "mode": mode, "parameters": zm.num_parameters(), "tokens_per_step": bs * seq}
        res = tune(model, opt, batches, zm.loss, candidates=cands, steps=args.tune_steps, rounds=args.rounds,
                   timed_steps=args.timed_steps, progress=lambda m: print(m, flush=True))
        print(res.table(), flush=True)
        res.save(os.path.join(args.out, f"{name}-{mode}"))
        run["tune"] = res.to_dict()
        snap.restore()
        run["tuned"] = train(zm, model, opt, batches, args.train_steps, device, res.recipe)
        snap.restore()
        run["torch_bf16_autocast"] = train(zm, model, opt, batches, args.train_steps, device, None)
        alone = {}
        recipes = {r.name: r for r in AdaptivePrecisionSelector().candidates(res_caps(device), None, cands)[0]}
        for t in res.trials:
            if t.error is None and t.fits and t.name in recipes:
                snap.restore()
                r = train(zm, model, opt, batches, args.alone_steps, device, recipes[t.name])
                alone[t.name] = {k: r[k] for k in ("tokens_per_s", "ms_per_step", "peak_gib", "final_loss")}
        run["alone"] = alone
        if budget:
            snap.restore()
            b = tune(model, opt, batches, zm.loss, candidates=cands, steps=args.tune_steps, rounds=1,
                     timed_steps=args.timed_steps, memory_budget=budget)
            print(b.table(), flush=True)
            b.save(os.path.join(args.out, f"{name}-{mode}-budget"))
            run["budget"] = b.to_dict()
            snap.restore()
            run["budget_trained"] = train(zm, model, opt, batches, args.train_steps, device, b.recipe)
        if oom_fraction and device.type == "cuda" and mode == "eager":
            snap.restore()
            oom = run["oom"] = oom_run(zm, batches, device, oom_fraction, 30)
            if "error" in oom:
                print(f"== {name} {mode}: out of memory at {oom_fraction:.0%} of the GPU not survived: "
                      f"{oom['error']}", flush=True)
            else:
                moves = ", ".join(e["data"].get("move", "?") for e in oom["events"]) or "none (it fit)"
                print(f"== {name} {mode}: out of memory at {oom_fraction:.0%} of the GPU: moves {moves}; "
                      f"{len(oom['losses'])} steps, loss {oom['losses'][0]:.3f} -> {oom['losses'][-1]:.3f}, "
                      f"policy {oom['policy']}", flush=True)
        run["seconds"] = time.perf_counter() - t0
        tuned, ref = run["tuned"], run["torch_bf16_autocast"]
        agreeing = [t.name for t in res.trials if t.agrees and t.fits and t.name in alone]
        best = max((alone[n]["tokens_per_s"] for n in agreeing), default=None)
        run["targets"] = {
            "tuned_vs_best_agreeing_alone": tuned["tokens_per_s"] / best if best else None,
            "tuned_vs_torch_bf16_autocast": tuned["tokens_per_s"] / ref["tokens_per_s"],
            "final_loss_diff_vs_torch_bf16": tuned["final_loss"] - ref["final_loss"],
            "tuning_fraction_of_10k_steps": res.seconds / (10000 * tuned["ms_per_step"] / 1e3)}
        print(f"== {name} {mode} targets: " + json.dumps(_jsonable(run["targets"])), flush=True)
        print(f"== {name} {mode}: tuned {res.recipe.name} {tuned['tokens_per_s']:.0f} tok/s, "
              f"{tuned['peak_gib']} GiB, loss {tuned['final_loss']:.4f} | torch bf16 autocast "
              f"{ref['tokens_per_s']:.0f} tok/s, {ref['peak_gib']} GiB, loss {ref['final_loss']:.4f} | alone "
              + ", ".join(f"{k} {v['tokens_per_s']:.0f}" for k, v in alone.items())
              + f" | tuning {res.seconds:.1f} s, all {run['seconds']:.0f} s", flush=True)
        results["runs"].append(run)
        with open(os.path.join(args.out, "evidence.json"), "w") as f:
            json.dump(_jsonable(results), f, indent=1)
        del model, opt, zm, batches, snap
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


def res_caps(device):
    from adaptive_amp.hardware import HardwareDetector

    return HardwareDetector().detect(device)


if __name__ == "__main__":
    sys.exit(main())
