"""The zoo at real size on one GPU, eager and compiled, under AdaptiveMixedPrecision (issue 17 items 1-3).

    python bench/zoo_gpu.py [--out DIR] [--only gpt2-small,llama-small] [--modes eager,compiled]
        [--steps 12] [--budget-s 170] [--backend inductor]

Runs, in this order (the most important first, so a budget cut leaves the rest):
gpt2-small, llama-small (125M), gpt2-medium, bert-small, t5-small, vit-small,
resnet-small; each eager, then compiled (``torch.compile``; every other
configuration compiled before the controller wraps it, the others after).

Every run: a fresh model with random weights on the GPU, ``policy="auto"`` with
``sample_inputs`` (the analysis runs, on the compiled model when compiled),
``read_every=4`` and ``stats_every=4``, ``--steps`` steps of AdamW. GPT-2 and Llama get an overflow
planted in one layer (its weights scaled so that its fp32 output reaches 1e6)
and compute forced to fp16 with no islands, so promotion must find the layer;
the others train in the selected policy (bf16 on an H100/H200). Checks, each
PASS or FAIL in the table and the JSON:

* analysis: every layer (adaptive_amp.layers) analyzed or listed as skipped;
* names: statistics rows name layers as the eager model does (no ``_orig_mod.``),
  at least 90% of the layers;
* stats_steps: activation statistics at every statistics step (0, 4, 8, ...);
* planted: the first promotion names the planted layer (GPT-2: a Conv1D);
* graph_breaks (compiled): none;
* graphs (compiled): at most two per distinct policy (statistics steps and the others);
* finite: the last loss is finite.

Also, for gpt2-small eager: the cost of the persistent statistics hooks on a
step without statistics (hooks present but inactive vs removed), median of
--steps timed steps each.

Writes DIR/zoo_gpu.json and DIR/zoo_gpu.txt (after every run, so a crash keeps
what came before). Exit status 0 when every run that started passed its checks.
Expected time on one H100: about 3 minutes with the defaults (compiles
dominate; runs that would start after --budget-s are reported as not run).
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
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from adaptive_amp import zoo  # noqa: E402
from adaptive_amp.collect import hooks_guarded  # noqa: E402
from adaptive_amp.controller import AdaptiveMixedPrecision  # noqa: E402
from adaptive_amp.layers import find_layers  # noqa: E402

#: name -> (family, size, batch size, planted layer or None)
CONFIGS = {
    "gpt2-small": ("gpt2", "small", 8, "transformer.h.5.attn.c_proj"),
    "llama-small": ("llama", "small", 8, "model.layers.5.mlp.down_proj"),
    "gpt2-medium": ("gpt2", "medium", 8, "transformer.h.11.attn.c_proj"),
    "bert-small": ("bert", "small", 8, None),
    "t5-small": ("t5", "small", 8, None),
    "vit-small": ("vit", "small", 16, None),
    "resnet-small": ("resnet", "small", 64, None),
}
READ_EVERY = 4
_TINY_PLANTED = {"gpt2": "transformer.h.1.attn.c_proj", "llama": "model.layers.1.mlp.down_proj"}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_one(name, mode, order, steps, backend, device, tiny=False):
    family, size, batch_size, planted = CONFIGS[name]
    if tiny:  # the CPU smoke run of this script (tests/test_zoo_gpu_script.py)
        size, batch_size, planted = "tiny", 2, planted and _TINY_PLANTED[family]
    torch._dynamo.reset()
    counters.clear()
    if device == "cuda":  # this run's peak alone: before, the first run's included the hook-cost run's
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    zm = zoo.build(family, size, seed=0, device=device)
    layers = [n for n, _ in find_layers(zm.model)]
    if planted:
        zoo.plant_overflow(zm, planted, zm.make_batch(2, seed=999, device=device), amax=1e6)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-4, fused=True)
    short = None if family in ("vit", "resnet") else min(64, zm.seq_len)
    sample = zm.make_batch(1, seed=998, device=device, seq_len=short)
    model = torch.compile(zm.model, backend=backend) if mode == "compiled" and order == "before" else zm.model
    overrides = {"compute_dtype": "float16", "islands": ()} if planted else None
    amp = AdaptiveMixedPrecision(model, opt, policy="auto", sample_inputs=zm.inputs(sample),
                                 loss_fn=zm.output_loss(sample), overrides=overrides, read_every=READ_EVERY,
                                 stats_every=READ_EVERY, progress=False)
    if mode == "compiled" and order == "after":
        model = torch.compile(zm.model, backend=backend)
    losses, graphs_after = [], []
    for i in range(steps):
        with amp.autocast():
            loss = zm.loss(model, zm.make_batch(batch_size, seed=i, device=device))
        amp.backward(loss)
        amp.step(max_grad_norm=1.0)
        amp.zero_grad()
        losses.append(loss.detach())
        graphs_after.append(counters["stats"]["unique_graphs"])
    amp.events.extend(amp.monitor.read())
    _sync(device)
    wall = time.perf_counter() - t0
    losses = [float(x) for x in losses]

    checks = {}
    analyzed = {r.name for r in amp.analysis.results}
    checks["analysis"] = analyzed | set(amp.analysis.skipped) == set(layers)
    rows = {r["name"] for ls in amp.monitor.layer_stats if ls.kind == "activation" for r in ls.rows}
    checks["names"] = (not any("_orig_mod" in n for n in rows) and rows <= set(layers)
                       and len(rows | set(amp.adjuster.islands)) >= 0.9 * len(layers))
    stats_steps = sorted({ls.step for ls in amp.monitor.layer_stats if ls.kind == "activation"})
    checks["stats_steps"] = set(range(0, steps, READ_EVERY)) <= set(stats_steps)
    promotes = [e for e in amp.events if e.kind == "promote"]
    if planted:
        checks["planted"] = bool(promotes) and planted in promotes[0].data.get("layers", [promotes[0].layer])
    if mode == "compiled":
        checks["graph_breaks"] = sum(counters["graph_break"].values()) == 0
        checks["graphs"] = graphs_after[-1] <= 2 * len({p for _, p in amp.policy_history})
    checks["finite"] = math.isfinite(losses[-1])
    found = amp.monitor.history()["found_inf"]
    result = {
        "config": name, "mode": mode, "order": order if mode == "compiled" else None,
        "ok": all(checks.values()), "checks": checks, "wall_s": round(wall, 1),
        "params_M": round(zm.num_parameters() / 1e6, 1), "layers": len(layers), "analyzed": len(analyzed),
        "policy_start": amp.policy_history[0][1], "policy_end": str(amp.policy),
        "decisions": [(e.step, e.kind, e.layer) for e in amp.events
                      if e.kind in ("promote", "demote", "switch_compute", "diagnose")],
        "skipped_steps": int(sum(found)), "stats_steps": stats_steps, "graphs_after_step": graphs_after,
        "graph_breaks": dict(counters["graph_break"]), "losses": losses,
        # on only if a controller of this process missed a statistics step (adaptive_amp/collect.py)
        "hook_guards": hooks_guarded(),
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
    }
    amp.remove()
    del amp, model, zm, opt
    return result


def hook_cost(steps, device):
    """gpt2-small eager, bf16, no statistics steps: step time with the inactive statistics hooks, and with
    them removed (ms, medians)."""
    zm = zoo.build("gpt2", "small", seed=0, device=device)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-4, fused=True)
    amp = AdaptiveMixedPrecision(zm.model, opt, policy="params=float32,compute=bfloat16", layer_stats=False,
                                 progress=False)
    batch = zm.make_batch(8, seed=0, device=device)
    out = {}
    for label in ("hooks", "no_hooks", "hooks_again"):
        if label == "no_hooks":
            hooks = amp._collector
            amp._collector = type(hooks)([])  # an empty collector: the same code path, no hooks on the model
            hooks.remove()
        if label == "hooks_again":
            amp._collector = type(amp._collector)(find_layers(zm.model), root=zm.model)
        times = []
        for i in range(steps + 3):
            _sync(device)
            t = time.perf_counter()
            with amp.autocast():
                loss = zm.loss(zm.model, batch)
            amp.backward(loss)
            amp.step()
            amp.zero_grad()
            _sync(device)
            if i >= 3:
                times.append(1e3 * (time.perf_counter() - t))
        out[label + "_ms"] = round(statistics.median(times), 3)
    out["layers"] = len(find_layers(zm.model))
    out["overhead_pct"] = round(100 * (min(out["hooks_ms"], out["hooks_again_ms"]) / out["no_hooks_ms"] - 1), 2)
    amp.remove()
    return out


def table(results):
    lines = [f"{'config':14} {'mode':9} {'order':6} {'ok':4} {'wall_s':>6} {'graphs':>6} {'skipped':>7}  "
             "failed checks / decisions"]
    for r in results:
        if r.get("not_run"):
            lines.append(f"{r['config']:14} {r['mode']:9} {'':6} {'-':4} not run: {r['not_run']}")
            continue
        if "error" in r:
            lines.append(f"{r['config']:14} {r['mode']:9} {str(r.get('order') or ''):6} FAIL error: {r['error']}")
            continue
        failed = [k for k, v in r["checks"].items() if not v]
        graphs = r["graphs_after_step"][-1] if r["mode"] == "compiled" else ""
        lines.append(f"{r['config']:14} {r['mode']:9} {str(r['order'] or ''):6} {'PASS' if r['ok'] else 'FAIL':4} "
                     f"{r['wall_s']:6.1f} {graphs!s:>6} {r['skipped_steps']:7d}  "
                     f"{','.join(failed) or '-'} / {r['decisions']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="zoo_gpu_out")
    p.add_argument("--only", default=",".join(CONFIGS), help="configurations, comma-separated")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--budget-s", type=float, default=170.0, help="start no run after this many seconds")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--no-hook-cost", action="store_true")
    p.add_argument("--tiny-cpu", action="store_true", help="smoke run: tiny models on the CPU")
    args = p.parse_args(argv)
    device = "cpu" if args.tiny_cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/zoo_gpu.py needs a CUDA GPU (or --tiny-cpu for a smoke run)")
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    results, report = [], {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           "torch": torch.__version__,
                           "steps": args.steps, "backend": args.backend}
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--only: unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")

    def save():
        report["results"] = results
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        with open(os.path.join(args.out, "zoo_gpu.json"), "w") as f:
            json.dump(report, f, indent=1)
        text = table(results)
        if "hook_cost" in report:
            text += f"\nstatistics hooks, gpt2-small eager, steps without statistics: {report['hook_cost']}"
        with open(os.path.join(args.out, "zoo_gpu.txt"), "w") as f:
            f.write(f"{report['device']}, torch {report['torch']}, {args.steps} steps, backend {args.backend}, "
                    f"{report['elapsed_s']} s\n{text}\n")
        return text

    if not args.no_hook_cost:
        report["hook_cost"] = hook_cost(args.steps, device)
        print("hook cost:", report["hook_cost"], flush=True)
    for i, name in enumerate(names):
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            order = "before" if i % 2 == 0 else "after"
            if time.perf_counter() - start > args.budget_s:
                results.append({"config": name, "mode": mode, "not_run": f"budget {args.budget_s:g} s spent"})
                continue
            try:
                r = run_one(name, mode, order, args.steps, args.backend, device, tiny=args.tiny_cpu)
            except Exception as exc:  # keep going: the table says which run failed and why
                traceback.print_exc()
                r = {"config": name, "mode": mode, "order": order, "ok": False, "error": repr(exc)[:300]}
            results.append(r)
            print(table([r]).splitlines()[-1], flush=True)
            save()
    print(save())
    return 0 if all(r.get("ok", True) for r in results if not r.get("not_run")) else 1


if __name__ == "__main__":
    sys.exit(main())
