"""Does torch.compile change what a model computes? Eager against compiled, one process, one GPU.

For a model of bench/tune_evidence.py (same weights, same batch): the largest difference of the logits (fp32,
and under bf16 autocast), a causality check (changing the last token must not move earlier logits), and every
parameter's gradient under bf16 autocast, eager and compiled, each against the fp32 eager gradient (relative
error, by parameter group). Written to find why compiled Llama trained to a higher loss than eager (issue 21,
tenth session); optionally after --warm-steps of eager bf16 training, away from the initialization.

    python bench/compile_parity.py --model llama-1b --batch 4 --seq 256 --warm-steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tune_evidence import build, stream  # noqa: E402


def group(name: str) -> str:
    for key in ("embed", "lm_head", "wte", "wpe", "norm", "ln_", "attn", "mlp"):
        if key in name:
            return key
    return "other"


def grads(model, fn, zm, batch, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = zm.loss(fn, batch)
    loss.backward()
    return float(loss), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warm-steps", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the zoo's tiny Llama (a CPU smoke run: --device cpu)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import transformers

    dev = torch.device(args.device)
    zm = build(args.model, args.tiny, dev)
    model = zm.model
    report = {"torch": torch.__version__, "transformers": transformers.__version__,
              "attn": getattr(model.config, "_attn_implementation", None), "warm_steps": args.warm_steps}
    batches = stream(zm, args.batch, args.seq, max(1, args.warm_steps) + 1, 7, dev)
    if args.warm_steps:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for b in batches[:args.warm_steps]:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = zm.loss(model, b)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        report["loss_after_warm"] = float(loss)
        del opt
    b = batches[-1]
    compiled = torch.compile(model)
    with torch.no_grad():
        for autocast in (False, True):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                e = model(input_ids=b["input_ids"]).logits.float()
                c = compiled(input_ids=b["input_ids"]).logits.float()
                changed = b["input_ids"].clone()
                changed[:, -1] = (changed[:, -1] + 7) % model.config.vocab_size
                e2 = model(input_ids=changed).logits.float()
                c2 = compiled(input_ids=changed).logits.float()
            key = "bf16" if autocast else "fp32"
            report[f"logits_{key}_max_diff"] = float((e - c).abs().max())
            report[f"logits_{key}_max_abs"] = float(e.abs().max())
            report[f"causal_leak_{key}_eager"] = float((e2[:, :-1] - e[:, :-1]).abs().max())
            report[f"causal_leak_{key}_compiled"] = float((c2[:, :-1] - c[:, :-1]).abs().max())
    ref_loss, ref = grads(model, model, zm, b, False)
    rows = {}
    for label, fn in (("eager_bf16", model), ("compiled_bf16", compiled), ("compiled_fp32", compiled)):
        loss, g = grads(model, fn, zm, b, label.endswith("bf16"))
        report[f"loss_{label}"] = loss
        per = {}
        for n, r in ref.items():
            k = group(n)
            num, den = per.get(k, (0.0, 0.0))
            per[k] = (num + float((g[n] - r).pow(2).sum()), den + float(r.pow(2).sum()))
        rows[label] = {k: (num / den) ** 0.5 if den else None for k, (num, den) in per.items()}
        rows[label]["all"] = (sum(v[0] for v in per.values()) / sum(v[1] for v in per.values())) ** 0.5
    report["loss_fp32_eager"] = ref_loss
    report["grad_rel_error_vs_fp32_eager"] = rows
    text = json.dumps(report, indent=1)
    print(text, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return report


if __name__ == "__main__":
    main()
