"""``python -m adaptive_amp bench``: every benchmark of the project, as suites of one command.

The kernel suites (gpt2, many, sround, optim, --stats, --scaler) time, side by side in one run, our op, torch's equivalent, the pure-torch reference and the
device's ceiling (a large copy for read+write ops, a reduction for read-only ones), and prints a table, the
ratios to torch and, on a GPU, the project's targets. GPU times come from CUDA events (medians; "eager"
includes host overhead, "graph" is the device time of CUDA-graph replay); CPU times from the host clock
(medians, with the interquartile range: a gap inside it is reported as no measurable difference). CPU
results check that everything runs; performance claims are GPU figures.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

from .e2e import DEFAULT_MODELS as E2E_DEFAULT_MODELS, MODELS as E2E_MODELS, RECIPES as E2E_RECIPES
from .kernels import (SUITES, format_table, sround_cpu, sround_gpu, sround_summary, speedups, stats_cpu, stats_gpu,
                      stats_summary, unscale_cpu, unscale_gpu)

_EPILOG = """suites (--suites, comma-separated; default gpt2,many):
  gpt2    fused unscale + inf check on GPT-2 small's 148 gradients (124M fp32 values), against torch's kernel
  many    the same on 2000 tensors of 4096 fp32 values (launch-bound)
  sround  stochastic rounding of fp32 to bf16, fp16, e4m3, e5m2 (256M values on a GPU, 16M on the CPU),
          against a pure-torch rounding and the device's copy bandwidth
  optim   fused SR AdamW / SGD steps on the GPT-2-small parameter set, against torch's fused AdamW (GPU only)
  e2e     the zoo's GPT-2 small/medium and Llama trained under torch's recipes and ours, eager and compiled:
          tokens/s, peak memory, final loss, the controller against its plain loop; the drop-in check
--stats adds tensor_stats on the gpt2/many sets; --scaler and --lm measure GradScaler against torch.amp.GradScaler
(GPU; --scaler also on the CPU).

suites with options of their own (python -m adaptive_amp bench SUITE --help):
  tune          policy="tune" trained for real against torch's bf16 autocast: tokens/s, peak memory, final
                loss against torch's seed spread, the tuning's cost
  scale         a Llama-3-8B-shaped model (or --layers N of it) compiled on one GPU: torch bf16 autocast,
                torchao float8 and ours, each at the largest batch that fits: tokens/s, memory, loss
  zoo           the zoo trained at real size under fp32, torch AMP and ours: recovery from planted fp16
                overflows (--suite recovery) and no false alarms in ordinary training (--suite alarms)
  multi-gpu     GradScaler under DDP and FSDP2 against torch's scalers (parity, skips, overhead); launch with
                torchrun --standalone --nproc_per_node=2 -m adaptive_amp bench multi-gpu --out DIR
  multi-gpu-integrations
                the collective controller and the Lightning/Accelerate integrations under DDP and FSDP2: the
                same decisions on every rank, resume, no hang; launched like multi-gpu

examples:
  python -m adaptive_amp bench                                  # gpt2 + many on the GPU (or the CPU)
  python -m adaptive_amp bench --suites gpt2,many,sround,optim --stats --json out.json
  python -m adaptive_amp bench --device cpu --suites many --reps 9
  python -m adaptive_amp bench --no-unscale --scaler --scaler-frozen 0 0.3 --json scaler.json   # fine-tuning
  python -m adaptive_amp bench --device cpu --no-unscale --scaler --scaler-frozen 0 0.3          # host cost
"""


def _verdict(compared: str, lines) -> None:
    print(f"compared: {compared}")
    print("\n".join(f"verdict: {line}" for line in lines))


#: suites with options of their own: name -> module (in this package) with main(argv) -> exit status
COMMANDS = {"tune": "tuning", "scale": "scale", "zoo": "zoo", "multi-gpu": "multi_gpu",
            "multi-gpu-integrations": "multi_gpu_integrations"}


def _run_command(name, argv):
    import importlib

    return importlib.import_module(f".{COMMANDS[name]}", __package__).main(list(argv))


def main(argv=None):
    """Runs the suites of `argv`: the rows of the kernel suites, or a suite command's exit status."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return _run_command(argv[0], argv[1:])
    # "--suites tune --help" is the tune suite's help, not this parser's: find the suite before -h is read.
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--suites", default="")
    named, rest = early.parse_known_args(argv)
    if named.suites in COMMANDS:
        return _run_command(named.suites, rest)
    parser = argparse.ArgumentParser(prog="python -m adaptive_amp bench", description=__doc__.split("\n\n")[1],
                                     epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to time: cuda (default when torch sees a GPU; 'cuda:1' for another) or cpu")
    parser.add_argument("--suites", default="gpt2,many",
                        help="comma-separated, from " + ", ".join([*SUITES, "sround", "optim", "e2e"]) +
                             " (default gpt2,many); or one of " + ", ".join(COMMANDS) + " alone, with its "
                             "own options after it")
    parser.add_argument("--e2e-models", default=None,
                        help=f"e2e: comma-separated of {','.join(E2E_MODELS)} (GPU default: "
                             f"{','.join(E2E_DEFAULT_MODELS)}; CPU: gpt2-small, built tiny)")
    parser.add_argument("--e2e-recipes", default=None,
                        help=f"e2e: comma-separated of {','.join(E2E_RECIPES)} (default: all)")
    parser.add_argument("--e2e-modes", default="eager,compiled", help="e2e: eager, compiled or both")
    parser.add_argument("--e2e-steps", type=int, default=None, help="e2e: timed steps per loop (GPU 60, CPU 4)")
    parser.add_argument("--e2e-rounds", type=int, default=None,
                        help="e2e: rounds the timed steps are split into, controller and plain loop alternating "
                             "(GPU 6, CPU 2); the ratio is of the rounds' medians")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per row after warm-up, reported as the median "
                             "(default 50 on a GPU; on the CPU 7 for unscale, 5 for sround and stats)")
    parser.add_argument("--json", metavar="PATH", help="also write every row (and the device, torch version) as JSON")
    parser.add_argument("--cpu", action="store_true", help="on a GPU, also time the CPU variants of the unscale suites")
    parser.add_argument("--scaler", action="store_true",
                        help="GradScaler's per-step overhead against torch.amp.GradScaler's on the same sets (GPU); "
                             "with --device cpu, the host cost of unscale_+step+update on small tensors")
    parser.add_argument("--scaler-frozen", type=float, metavar="FRACTIONS", nargs="+", default=[0.0],
                        help="with --scaler: fractions of the parameter tensors to freeze (requires_grad=False, "
                             "grad None, still in the optimizer), one table row set each (default 0)")
    parser.add_argument("--lm", type=int, metavar="STEPS", default=0,
                        help="train the demo LM in fp16 for STEPS steps per scaler mode: skipped steps, loss (GPU)")
    parser.add_argument("--no-unscale", action="store_true", help="skip the unscale suites (gpt2, many)")
    parser.add_argument("--stats", action="store_true",
                        help="the tensor_stats suite on the same sets (ours, a torch loop, _foreach_norm, read ceiling)")
    args, rest = parser.parse_known_args(argv)
    _check(parser, args)
    suites = [s for s in args.suites.split(",") if s]
    commands = [s for s in suites if s in COMMANDS]
    if commands:
        if len(suites) > 1:
            parser.error(f"--suites {args.suites}: {commands[0]} runs alone (python -m adaptive_amp bench "
                         f"{commands[0]} [options])")
        return _run_command(commands[0], rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    sround = "sround" in suites  # the stochastic-rounding suite; the others are unscale suites
    optim_suite = "optim" in suites  # the fused-optimizer suite (GPU)
    e2e_suite = "e2e" in suites  # end to end: the zoo's models under torch's recipes and ours
    suites = [s for s in suites if s not in ("sround", "optim", "e2e")]
    cuda = args.device.startswith("cuda")
    cpu_reps = {"reps": args.reps} if args.reps else {}
    gpu_reps = args.reps or 50
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    rows = []
    if not args.no_unscale and suites:
        if cuda:
            rows += unscale_gpu(suites, device=args.device, reps=gpu_reps)
        if args.cpu or not cuda:
            rows += unscale_cpu(suites, **cpu_reps)
        print(format_table(rows))
        _verdict("adaptive_amp's fused unscale + inf check (plain, with statistics, check-only) against torch's "
                 "_amp_foreach_non_finite_check_and_unscale_; our time over torch's, below 1 is faster",
                 speedups(rows))
        report["rows"] = [asdict(r) for r in rows]
    if args.scaler and cuda:
        from .scaler import format_overhead, scaler_overhead_gpu

        overhead = [row for frozen in args.scaler_frozen for row in scaler_overhead_gpu(suites, frozen=frozen)]
        print(format_overhead(overhead))
        report["scaler_overhead"] = [dict(asdict(r), torch_overhead=r.torch_overhead, ours_overhead=r.ours_overhead)
                                     for r in overhead]
    if args.scaler and not cuda:
        from .scaler import format_calls, scaler_calls_cpu

        calls = [scaler_calls_cpu(frozen) for frozen in args.scaler_frozen]
        print(format_calls(calls))
        report["scaler_calls_cpu"] = [asdict(r) for r in calls]
    if args.lm and cuda:
        from .scaler import format_lm, lm_modes_gpu

        results = lm_modes_gpu(steps=args.lm)
        print(format_lm(results))
        report["lm"] = [{"scaler": name, "seed": seed, "skipped_steps": r.skipped_steps, "final_loss": r.final_loss,
                         "seconds": r.seconds, "entropy_floor": r.entropy_floor}
                        for (name, seed), r in results.items()]
    if sround:
        sround_rows = sround_gpu(device=args.device, reps=gpu_reps) if cuda else sround_cpu(**cpu_reps)
        print(format_table(sround_rows))
        _verdict("adaptive_amp.stochastic_round against torch's round-to-nearest .to(dtype) and a pure-torch "
                 "stochastic rounding (eager and compiled); our time over theirs", sround_summary(sround_rows))
        report["sround"] = [asdict(r) for r in sround_rows]
        rows += sround_rows
    if optim_suite:
        if cuda:
            from .optim import format_optim, optim_gpu

            optim_rows = optim_gpu(device=args.device, reps=gpu_reps)
            print(format_optim(optim_rows))
            report["optim"] = [asdict(r) for r in optim_rows]
            rows += optim_rows
        else:
            print("optim suite: needs a CUDA GPU (the CPU step is covered by tests/test_optim.py)")
    if args.stats:
        stats_suites = suites or list(SUITES)
        stats_rows = stats_gpu(stats_suites, device=args.device, reps=gpu_reps) if cuda else stats_cpu(stats_suites, **cpu_reps)
        print(format_table(stats_rows))
        _verdict("adaptive_amp.tensor_stats (one launch for every tensor) against a per-tensor torch loop of the "
                 "same statistics and torch._foreach_norm", stats_summary(stats_rows))
        report["stats"] = [asdict(r) for r in stats_rows]
        rows += stats_rows
    if e2e_suite:
        from .e2e import RECIPES, format_e2e, run_e2e, to_json

        split = lambda text: [t for t in text.split(",") if t] if text else None  # noqa: E731
        result = run_e2e(models=split(args.e2e_models), recipes=split(args.e2e_recipes) or RECIPES,
                         modes=split(args.e2e_modes), steps=args.e2e_steps, rounds=args.e2e_rounds,
                         device=args.device.split(":")[0])
        print(format_e2e(result))
        report["e2e"] = to_json(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return rows


def _check(parser: argparse.ArgumentParser, args) -> None:
    """Every value before any suite runs: a bad one is a usage error naming its option (exit status 2)."""
    from .. import _cliargs

    _cliargs.device(parser, args.device)
    known = [*SUITES, "sround", "optim", "e2e", *COMMANDS]
    unknown = [s for s in args.suites.split(",") if s and s not in known]
    if unknown:
        parser.error(f"--suites: unknown suite(s) {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    for flag, text, choices in (("--e2e-models", args.e2e_models, E2E_MODELS),
                                ("--e2e-recipes", args.e2e_recipes, E2E_RECIPES),
                                ("--e2e-modes", args.e2e_modes, ("eager", "compiled"))):
        names = [t for t in (text or "").split(",") if t]
        if text is not None and not names:
            parser.error(f"{flag} {text!r}: name at least one of {', '.join(choices)}")
        unknown = [t for t in names if t not in choices]
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}")
    _cliargs.at_least(parser, args.reps, 1, "--reps")
    _cliargs.at_least(parser, args.e2e_steps, 1, "--e2e-steps")
    _cliargs.at_least(parser, args.e2e_rounds, 1, "--e2e-rounds")
    _cliargs.at_least(parser, args.lm, 0, "--lm")
    if not all(0.0 <= f < 1.0 for f in args.scaler_frozen):
        parser.error("--scaler-frozen: each fraction must be in [0, 1)")


if __name__ == "__main__":
    main()
