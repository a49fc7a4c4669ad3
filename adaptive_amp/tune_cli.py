"""``python -m adaptive_amp tune``: the A/B of precision recipes on a model, as a table, JSON and a PNG."""

from __future__ import annotations

import argparse
import json
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m adaptive_amp tune",
                                description="Train each candidate precision recipe briefly on the same batches "
                                            "from one snapshot; print the A/B table and the recipe chosen.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="MODULE:FACTORY",
                     help="a function returning a zoo.ZooModel, or (model, batches, loss_fn[, optimizer]) with "
                          "loss_fn(model, batch) -> loss (default optimizer: torch.optim.AdamW)")
    src.add_argument("--zoo", metavar="FAMILY[:SIZE]", default="gpt2:tiny",
                     help="a model of adaptive_amp.zoo (default gpt2:tiny)")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--batch-size", type=int, default=4, help="zoo: sequences per batch")
    p.add_argument("--seq-len", type=int, default=None, help="zoo: tokens per sequence (default: the model's)")
    p.add_argument("--batches", type=int, default=4, help="zoo: distinct batches the trials cycle through")
    p.add_argument("--lr", type=float, default=1e-4, help="the default optimizer's learning rate")
    p.add_argument("--candidates", help="comma-separated names (fp32, bf16, bf16+islands, fp16, fp16+islands, "
                                        "bf16-weights, bf16-weights+islands, bf16-weights+bf16-moments, bf16-pure, "
                                        "bf16-pure+bf16-moments, float8; +ckpt for checkpointing)")
    p.add_argument("--steps", type=int, default=8, help="training steps per trial (loss comparison)")
    p.add_argument("--rounds", type=int, default=3,
                   help="timing rounds: the trials are the first, later ones time only the contenders, interleaved")
    p.add_argument("--timed-steps", type=int, default=3, help="timed steps per candidate and round")
    p.add_argument("--budget", help="memory budget, e.g. 20GiB")
    p.add_argument("--loss-tolerance", type=float, default=0.01,
                   help="largest accepted mean loss increase, relative to the reference loss")
    p.add_argument("--compile", action="store_true", help="torch.compile the model first")
    p.add_argument("--out", metavar="DIR", help="write tune.txt, tune.json and tune.png there")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    return p


def _load_factory(spec: str):
    import importlib

    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise SystemExit(f"--model {spec!r}: expected package.module:factory")
    try:
        factory = getattr(importlib.import_module(module_name), attr, None)
    except ImportError as exc:
        raise SystemExit(f"--model {spec!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?") from None
    if not callable(factory):
        raise SystemExit(f"--model {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def _load(args, device):
    import torch

    from . import zoo
    from .zoo.model import ZooModel

    if args.model:
        made = _load_factory(args.model)()
    else:
        family, _, size = args.zoo.partition(":")
        made = zoo.build(family, size or "tiny", seed=0, device=device)
    if isinstance(made, ZooModel):
        model = made.model.to(device)
        batches = [made.make_batch(args.batch_size, seed=i, device=device, seq_len=args.seq_len)
                   for i in range(args.batches)]
        return model, batches, made.loss, None
    if not isinstance(made, tuple) or len(made) not in (3, 4):
        raise SystemExit(f"--model {args.model!r}: the factory returned {type(made).__name__}; return a "
                         "zoo.ZooModel or (model, batches, loss_fn[, optimizer])")
    model, batches, loss_fn, opt = (*made, None)[:4]
    return model.to(device), list(batches), loss_fn, opt


def main(argv: Optional[List[str]] = None) -> int:
    import torch

    from .policy import AdaptivePrecisionSelector
    from .report import _jsonable

    args = _parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, batches, loss_fn, opt = _load(args, device)
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.compile:
        model = torch.compile(model)
    candidates = [c.strip() for c in args.candidates.split(",") if c.strip()] if args.candidates else None
    try:
        result = AdaptivePrecisionSelector().tune(model, opt, batches, loss_fn, candidates=candidates, steps=args.steps, rounds=args.rounds,
                      timed_steps=args.timed_steps, memory_budget=args.budget, loss_tolerance=args.loss_tolerance)
    except ValueError as exc:
        raise SystemExit(f"python -m adaptive_amp tune: {exc}") from None
    if args.json:
        print(json.dumps(_jsonable(result.to_dict()), indent=2))
    else:
        print(result.table())
        print("\nreasons:\n" + "\n".join("  - " + r for r in result.policy.reasons))
    if args.out:
        written = result.save(args.out)
        if not args.json:
            print("\nwrote " + ", ".join(written.values()))
    return 0
