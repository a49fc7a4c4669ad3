"""Where torch's fp16 loss scale tops out on TinyLM, and what it costs in step time.

    python bench/loss_scale_ceiling.py [--steps 800]

For each TinyLM size, trains with autocast fp16 and a torch.amp.GradScaler
whose scale starts high (2^24) and probes every 10 steps, so it hovers just
under the largest scale the model's fp16 gradients allow (the ceiling); the
median log2 scale of each eighth of the run is printed. With torch's defaults
(2^16, doubling every 2000 steps without overflow) a run skips its first step
only after about 2000 * (ceiling - 16) steps: the reason the demo's ordinary
scenario needs a long run to show torch AMP's skipped steps. Step times of
fp32, bf16 and fp16 with default scaling come from short runs of each size.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from adaptive_amp.demo import MarkovCorpus, TinyLM

SIZES = ((128, 2, 64, 32), (256, 4, 128, 32), (512, 6, 256, 32))  # d_model, layers, context, batch


def train(d_model, layers, context, batch, steps, mode, growth_interval=2000, init_scale=2.0**16):
    """(ms per step after 50 warm-up steps, final loss, log2 scale per step or None)."""
    torch.manual_seed(0)
    corpus = MarkovCorpus(device="cuda")
    model = TinyLM(vocab=corpus.vocab, d_model=d_model, layers=layers, context=context,
                   heads=max(4, d_model // 64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, fused=True)
    data = corpus.batch(steps * batch, context + 1, torch.Generator(device="cuda").manual_seed(1))
    fp16 = mode == "fp16"
    scaler = torch.amp.GradScaler("cuda", init_scale=init_scale, growth_interval=growth_interval, enabled=fp16)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mode, torch.float32)
    losses, scales = [], []
    for step in range(steps):
        if step == 50:
            torch.cuda.synchronize()
            start = time.perf_counter()
        tokens = data[step * batch:(step + 1) * batch]
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, corpus.vocab), tokens[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if fp16:
            scales.append(scaler._get_scale_async().detach().clone())
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / (steps - 50) * 1e3
    final = float(torch.stack(losses[-50:]).float().mean())
    return ms, final, (torch.stack(scales).float().log2().cpu() if fp16 else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=800, help="steps of the probing run (default 800)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/loss_scale_ceiling.py needs a CUDA GPU")
    if args.steps < 100:
        sys.exit("--steps must be at least 100")
    print(f"{torch.cuda.get_device_name()}; TinyLM sizes as d_model/layers/context/batch")
    for size in SIZES:
        name = "d{} L{} T{} B{}".format(*size)
        _, _, log2 = train(*size, args.steps, "fp16", growth_interval=10, init_scale=2.0**24)
        w = args.steps // 8
        windows = " ".join(f"{log2[i:i + w].median():.0f}" for i in range(0, w * 8, w))
        print(f"{name}: median log2 scale, probing every 10 steps, by eighths of {args.steps} steps: {windows}")
        times = {mode: train(*size, 300, mode)[0] for mode in ("fp32", "bf16", "fp16")}
        print(f"{name}: ms/step fp32 {times['fp32']:.2f}, bf16 {times['bf16']:.2f}, "
              f"fp16 + default GradScaler {times['fp16']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
