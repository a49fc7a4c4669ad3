"""Command line: ``python -m adaptive_amp info | analyze | demo | bench | tune``."""

from __future__ import annotations

import argparse
import json
import sys


def _build_info() -> dict:
    import adaptive_amp

    info = adaptive_amp.build_info()
    info["cuda_available"] = adaptive_amp.cuda_available()
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        info["torch"] = None
    return info


def _info(args) -> int:
    info = _build_info()
    if info["torch"] is None:  # the kernels work on numpy without torch; the policy layer needs it
        if args.json:
            print(json.dumps({"build": info, "hardware": None, "policy": None}, indent=2))
        else:
            print("build:\n" + _indent(_key_values(info)))
            print("\nhardware and policy: need torch (pip install torch)")
        return 0
    from .hardware import HardwareDetector
    from .policy import AdaptivePrecisionSelector

    # The CUDA device when there is one, else the CPU (detect()'s default).
    caps = HardwareDetector().detect(measure=args.measure)
    policy = AdaptivePrecisionSelector().select(None, caps)
    if args.json:
        print(json.dumps({"build": info, "hardware": caps.to_dict(),
                          "policy": {"string": str(policy), **policy.to_dict()}}, indent=2))
        return 0
    print("hardware:\n" + _indent(str(caps)))
    print("\nbuild:\n" + _indent(_key_values(info)))
    print(f"\npolicy: {policy}")
    print("\n".join(f"  - {why}" for why in policy.reasons))
    return 0


def _key_values(d: dict) -> str:
    width = max((len(k) for k in d), default=0) + 1
    return "\n".join(f"{k + ':':<{width}} {v}" for k, v in d.items())


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _demo_model(batch: int, length: int, device):
    """The demo's TinyLM on a batch of its Markov corpus, with the next-token loss."""
    import torch
    from torch import nn

    from .demo import MarkovCorpus, TinyLM

    torch.manual_seed(0)
    corpus = MarkovCorpus()
    model = TinyLM(vocab=corpus.vocab)
    tokens = corpus.batch(batch, length + 1, torch.Generator().manual_seed(1)).to(device)
    targets = tokens[:, 1:]

    def loss_fn(logits):
        return nn.functional.cross_entropy(logits.float().reshape(-1, corpus.vocab), targets.reshape(-1))

    return model, tokens[:, :-1], loss_fn


def _to_device(value, device):
    if hasattr(value, "to") and hasattr(value, "device"):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _candidates(text: str, parser: argparse.ArgumentParser) -> list:
    from .stats import format_name

    names = [c.strip() for c in text.split(",") if c.strip()]  # spellings: adaptive_amp.names
    if not names:
        parser.error(f"--candidates {text!r}: name at least one format")
    try:
        return [format_name(n) for n in names]
    except ValueError as exc:
        parser.error(f"--candidates {text!r}: {exc}")


def _analyze(args, parser: argparse.ArgumentParser) -> int:
    import torch

    from . import _cliargs
    from .analysis import PrecisionAnalyzer

    # Every value is checked before the model is built (a bad one is a usage error, not a traceback).
    device = _cliargs.device(parser, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    _cliargs.at_least(parser, args.batch, 1, "--batch", "sequences")
    _cliargs.at_least(parser, args.length, 1, "--length", "tokens")
    _cliargs.positive(parser, args.threshold, "--threshold", "a relative error of the model's output")
    _cliargs.at_least(parser, args.fp8_margin, 0, "--fp8-margin", "powers of two")
    kwargs = {"candidates": _candidates(args.candidates, parser)} if args.candidates is not None else {}
    factory = (_cliargs.factory(parser, args.model, "(model, sample_inputs) or (model, sample_inputs, loss_fn)")
               if args.model else None)
    if factory is not None:
        made = factory()
        if not isinstance(made, tuple) or len(made) not in (2, 3):
            parser.error(f"--model {args.model!r}: the factory returned {type(made).__name__}; "
                         "return (model, sample_inputs) or (model, sample_inputs, loss_fn)")
        model, inputs, loss_fn = (*made, None)[:3]
    else:
        model, inputs, loss_fn = _demo_model(args.batch, args.length, device)
    model = model.to(device)
    inputs = _to_device(inputs, device)
    analyzer = PrecisionAnalyzer(**kwargs, error_threshold=args.threshold, progress=not args.no_progress,
                                 fp8_margin=args.fp8_margin)
    analysis = analyzer.analyze(model, inputs, loss_fn=loss_fn)
    print(analysis.table())
    for fmt in analysis.candidates:
        risky = analysis.risky_layers(fmt)
        print(f"risky in {fmt}: " + (", ".join(name for name, _ in risky) if risky else "none"))
    if args.json:
        with open(args.json, "w") as f:
            f.write(analysis.to_json() + "\n")
        print(f"wrote {args.json}")
    return 0


def _demo(rest) -> int:
    from . import demo

    run = getattr(demo, "main", None)
    if run is None:
        print("python -m adaptive_amp demo: this copy's adaptive_amp.demo has no main(argv) yet "
              "(the demo's training entry point); update adaptive_amp, or use adaptive_amp.demo.train_lm "
              "from Python", file=sys.stderr)
        return 2
    result = run(rest)
    return result if isinstance(result, int) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptive_amp")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="the device, how this copy was built, and the policy it would choose")
    info.add_argument("--json", action="store_true", help="print everything as JSON")
    info.add_argument("--measure", action="store_true", help="also measure matmul throughput per dtype")
    analyze = sub.add_parser("analyze", help="which layers of a model tolerate fp16, bf16 or fp8")
    analyze.add_argument("--model", metavar="MODULE:FACTORY",
                         help="a function returning (model, sample_inputs) or (model, sample_inputs, loss_fn); "
                              "default: the demo's TinyLM on its Markov corpus")
    analyze.add_argument("--device", help="default: cuda when available, else cpu")
    analyze.add_argument("--json", metavar="PATH", help="also write the analysis as JSON")
    analyze.add_argument("--candidates", help="formats, comma-separated (default float16,bfloat16,float8_e4m3fn)")
    analyze.add_argument("--threshold", type=float, default=None,
                         help="model-output relative error above which a layer is risky, for every format "
                              "(default: 0.02 for fp16/bf16, 0.1 for e4m3, 0.2 for e5m2)")
    analyze.add_argument("--fp8-margin", type=int, default=0, help="fp8 scaling margin in powers of two")
    analyze.add_argument("--batch", type=int, default=8, help="demo model: sequences in the sample batch")
    analyze.add_argument("--length", type=int, default=64, help="demo model: tokens per sequence")
    analyze.add_argument("--no-progress", action="store_true", help="no progress bar")
    sub.add_parser("demo", help="train the demo LM (see --help after demo)", add_help=False)
    sub.add_parser("bench", help="benchmarks: kernels, scaler, optimizer, end to end, tune, scale, zoo, multi-GPU "
                                 "(see --help after bench)", add_help=False)
    sub.add_parser("tune", help="A/B of precision recipes on a model (see --help after tune)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command in ("info", "analyze") and rest:
        parser.error(f"{args.command}: unrecognized arguments: {' '.join(rest)}")
    if args.command == "info":
        return _info(args)
    if args.command == "analyze":
        return _analyze(args, analyze)
    if args.command == "demo":
        return _demo(rest)
    if args.command == "bench":
        from . import bench

        result = bench.main(rest)
        return result if isinstance(result, int) else 0
    if args.command == "tune":
        from .tune_cli import main as tune_main

        return tune_main(rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
