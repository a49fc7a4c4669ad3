"""Why does training with bf16 weights lag torch's bf16 autocast? Four recipes on the same batches (issue 21).

The eleventh session found GPT-2 medium with bf16 weights and our stochastic-rounding AdamW (bf16-pure) leaving
its first loss plateau later than torch's bf16 autocast in every 2000-step run (H200). bf16-pure differs from
autocast in two ways; these recipes separate them:

- ``torch-bf16``: fp32 weights, bf16 autocast, torch's AdamW (the baseline);
- ``bf16-pure``: bf16 weights, no autocast, ``adaptive_amp.optim.AdamW(stochastic_rounding=True)``;
- ``bf16-master``: bf16 weights, no autocast (bf16-pure's compute), fp32 master weights updated by torch's
  AdamW and copied back rounded to nearest (autocast's update precision);
- ``autocast-sr``: fp32 weights under bf16 autocast (autocast's compute), each weight stochastically rounded
  to bf16 after every step (bf16-pure's update precision);
- ``bf16-weights``: the matmul layers' weights in bf16 (``recipes.cast_matmul_weights``: norms, loose
  parameters and buffers stay fp32, embeddings return fp32), under bf16 autocast, with
  ``adaptive_amp.optim.AdamW(stochastic_rounding=True)``: autocast's compute, bf16 weights (the candidate
  the twelfth session built).

What the twelfth session found (H200, bench/RESULTS.md): GPT-2 medium's loss at 1500-2000 steps is set by
when its first plateau ends, which varies from run to run even for torch's recipe on one seed (8.95 and 9.36
eager; 8.71, 9.40 and 10.85 compiled over seeds 0-2), and every bf16 recipe's runs fell inside that spread:
single runs of this model cannot locate a lag. The 1.1B Llama (``--model llama-1b``), whose curve is
reproducible to 0.01, can: compiled, bf16-weights ended below torch's autocast where bf16-pure had ended 1.1%
above it.

If bf16-master keeps up with torch-bf16 and autocast-sr lags, the weights' precision is the cause (the fix:
fp32 master weights); if bf16-master lags too, the bf16 compute (e.g. the residual stream) is.

    python bench/precision_ablation.py --model gpt2-medium --batch 4 --seq 512 --steps 1500
    python bench/precision_ablation.py --tiny --device cpu --steps 20          # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tune_evidence import build, plain_step, stream, timed_loop  # noqa: E402

RECIPES = ("torch-bf16", "bf16-pure", "bf16-master", "autocast-sr", "bf16-weights")


def recipe_step(name: str, zm, model, lr: float, device, compile: bool = False):
    """``step(batch) -> loss`` of one recipe; `model` is a fresh fp32 copy it may cast (and then compile)."""
    from adaptive_amp.optim import AdamW
    from adaptive_amp.recipes import cast_matmul_weights, float32_embeddings

    params = [p for p in model.parameters() if p.requires_grad]
    if name not in RECIPES:
        raise SystemExit(f"unknown recipe {name!r}: one of {', '.join(RECIPES)}")
    if name == "bf16-weights":
        cast_matmul_weights(model, torch.bfloat16)
        float32_embeddings(model)
    elif name in ("bf16-pure", "bf16-master"):
        model.to(torch.bfloat16)
    run = torch.compile(model) if compile else model  # compiled after the casts, as a user would
    if name in ("torch-bf16", "autocast-sr"):
        autocast_step = plain_step(zm, run, torch.optim.AdamW(params, lr=lr), device)
        if name == "torch-bf16":
            return autocast_step

        def step(batch):
            from adaptive_amp import stochastic_round

            loss = autocast_step(batch)
            with torch.no_grad():
                for p in params:
                    p.copy_(stochastic_round(p, torch.bfloat16))
            return loss
        return step
    if name == "bf16-weights":
        return plain_step(zm, run, AdamW(params, lr=lr, stochastic_rounding=True), device)
    if name == "bf16-pure":
        return plain_step(zm, run, AdamW(params, lr=lr, stochastic_rounding=True), device, autocast_dtype=None)
    masters = [p.detach().float().requires_grad_() for p in params]  # bf16-master
    opt = torch.optim.AdamW(masters, lr=lr)

    def step(batch):
        loss = zm.loss(run, batch)
        loss.backward()
        with torch.no_grad():
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
                p.grad = None
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch._foreach_copy_(params, masters)  # round to nearest, as autocast's casts round
        return loss
    return step


def moving_means(losses, every: int, window: int = 100):
    return {i: sum(losses[max(0, i - window):i]) / len(losses[max(0, i - window):i])
            for i in range(every, len(losses) + 1, every)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-medium")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (after the recipe's casts)")
    p.add_argument("--out", default="bench/results/ablation")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    bs, seq = (4, 16) if args.tiny else (args.batch, args.seq)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": {}}
    batches = None
    for name in args.recipes.split(","):
        zm = build(args.model, args.tiny, device, seed=args.seed)
        batches = batches or stream(zm, bs, seq, args.steps, args.seed, device)
        step = recipe_step(name, zm, zm.model, args.lr, device, compile=args.compile)
        t0 = time.perf_counter()
        r = timed_loop(step, batches, args.steps, device, bs * seq)
        r["seconds"] = time.perf_counter() - t0
        r["moving_means"] = moving_means(r["losses"], max(1, args.steps // 10))
        result["runs"][name] = r
        print(f"== {name}: final loss {r['final_loss']:.4f}, {r['ms_per_step']:.1f} ms/step, moving means "
              + " ".join(f"{v:.2f}" for v in r["moving_means"].values()), flush=True)
        with open(os.path.join(args.out, "ablation.json"), "w") as f:
            json.dump(result, f, indent=1)
        del zm, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    try:
        from adaptive_amp.report import plot_recipes

        plot_recipes({n: {"losses": r["losses"], "step_times": r["window_ms_per_step"]}
                      for n, r in result["runs"].items()}, os.path.join(args.out, "ablation.png"),
                     title=f"{args.model}{' compiled' if args.compile else ''}, {bs}x{seq} tokens a step: "
                           "bf16 weights vs autocast, separated")
    except ImportError:  # no matplotlib: the JSON has the losses
        pass
    return result


if __name__ == "__main__":
    main()
