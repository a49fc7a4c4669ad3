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
                                        "bf16-pure+bf16-moments, bf16+fp8, bf16-weights+fp8, "
                                        "bf16-weights+bf16-moments+fp8, bf16-pure+fp8, "
                                        "bf16-pure+bf16-moments+fp8; +ckpt for checkpointing; other spellings: "
                                        "adaptive_amp.names)")
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


def _check(parser: argparse.ArgumentParser, args):
    """Every value before a model is built: a bad one is a usage error naming its option (exit status 2).
    Returns (device, candidates, budget in bytes)."""
    import math

    import torch

    from . import _cliargs, zoo
    from .policy import candidate_names
    from .tune import parse_budget

    device = _cliargs.device(parser, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not args.model:
        family, _, size = args.zoo.partition(":")
        if family not in zoo.FAMILIES:
            parser.error(f"--zoo {args.zoo!r}: unknown family {family!r}; choose one of {', '.join(zoo.FAMILIES)}")
        if size and size not in zoo.sizes(family):
            parser.error(f"--zoo {args.zoo!r}: unknown size {size!r} for {family}; choose one of "
                         f"{', '.join(zoo.sizes(family))}")
    _cliargs.at_least(parser, args.batch_size, 1, "--batch-size", "sequences per batch")
    _cliargs.at_least(parser, args.seq_len, 1, "--seq-len", "tokens per sequence")
    _cliargs.at_least(parser, args.batches, 1, "--batches")
    _cliargs.at_least(parser, args.steps, 2, "--steps", "the loss comparison needs two differences")
    _cliargs.at_least(parser, args.rounds, 1, "--rounds")
    _cliargs.at_least(parser, args.timed_steps, 1, "--timed-steps")
    _cliargs.positive(parser, args.lr, "--lr")
    if not (math.isfinite(args.loss_tolerance) and args.loss_tolerance >= 0):
        parser.error(f"--loss-tolerance is {args.loss_tolerance}; pass a fraction >= 0 (0.01: 1% of the loss)")
    try:
        budget = parse_budget(args.budget)
    except (ValueError, TypeError) as exc:
        parser.error(f"--budget: {exc}")
    candidates = None
    if args.candidates is not None:
        try:
            candidates = candidate_names([c.strip() for c in args.candidates.split(",") if c.strip()])
        except ValueError as exc:
            parser.error(f"--candidates {args.candidates!r}: {exc}")
    return device, candidates, budget


def _load(args, device, parser):
    from . import _cliargs, zoo
    from .zoo.model import ZooModel

    if args.model:
        made = _cliargs.factory(parser, args.model, "a zoo.ZooModel or (model, batches, loss_fn[, optimizer])")()
    else:
        family, _, size = args.zoo.partition(":")
        made = zoo.build(family, size or "tiny", seed=0, device=device)
    if isinstance(made, ZooModel):
        model = made.model.to(device)
        batches = [made.make_batch(args.batch_size, seed=i, device=device, seq_len=args.seq_len)
                   for i in range(args.batches)]
        return model, batches, made.loss, None
    if not isinstance(made, tuple) or len(made) not in (3, 4):
        parser.error(f"--model {args.model!r}: the factory returned {type(made).__name__}; return a "
                     "zoo.ZooModel or (model, batches, loss_fn[, optimizer])")
    model, batches, loss_fn, opt = (*made, None)[:4]
    return model.to(device), list(batches), loss_fn, opt


def main(argv: Optional[List[str]] = None) -> int:
    import sys

    import torch

    from .policy import AdaptivePrecisionSelector
    from .report import _jsonable

    parser = _parser()
    args = parser.parse_args(argv)
    device, candidates, budget = _check(parser, args)
    model, batches, loss_fn, opt = _load(args, device, parser)
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.compile:
        model = torch.compile(model)
    try:
        result = AdaptivePrecisionSelector().tune(model, opt, batches, loss_fn, candidates=candidates,
                                                  steps=args.steps, rounds=args.rounds, timed_steps=args.timed_steps,
                                                  memory_budget=budget, loss_tolerance=args.loss_tolerance)
    except ValueError as exc:  # what the factory's model, batches or optimizer cannot do
        parser.error(str(exc))
    except RuntimeError as exc:
        if not str(exc).startswith("tune:"):
            raise
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)  # no candidate could be chosen: the trials say why
        return 1
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
