"""``python -m adaptive_amp bench``: the kernel, scaler and optimizer suites from the command line."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

from .kernels import (SUITES, format_table, sround_cpu, sround_gpu, sround_summary, speedups, stats_cpu, stats_gpu,
                      stats_summary, unscale_cpu, unscale_gpu)

def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m adaptive_amp bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--suites", default="gpt2,many",
                        help="comma-separated: " + ",".join(SUITES) + ",sround,optim,e2e")
    parser.add_argument("--e2e-models", default=None,
                        help="e2e: comma-separated of gpt2-small,gpt2-medium,llama-small (GPU default: all; "
                             "CPU: gpt2-small, built tiny)")
    parser.add_argument("--e2e-recipes", default=None,
                        help="e2e: comma-separated of fp32,torch-fp16,torch-bf16,auto,fp16,bf16-pure (default: all)")
    parser.add_argument("--e2e-modes", default="eager,compiled", help="e2e: eager, compiled or both")
    parser.add_argument("--e2e-steps", type=int, default=None, help="e2e: timed steps per loop (GPU 60, CPU 4)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--cpu", action="store_true", help="also time the CPU variants")
    parser.add_argument("--scaler", action="store_true",
                        help="GradScaler per-step overhead against torch's on the same sets (GPU)")
    parser.add_argument("--lm", type=int, metavar="STEPS", default=0,
                        help="train the demo LM in fp16 for STEPS steps per scaler mode (GPU)")
    parser.add_argument("--no-unscale", action="store_true", help="skip the unscale kernel suites")
    parser.add_argument("--stats", action="store_true",
                        help="the tensor_stats suite on the same sets (ours, a torch loop, _foreach_norm, read ceiling)")
    args = parser.parse_args(argv)
    suites = [s for s in args.suites.split(",") if s]
    sround = "sround" in suites  # the stochastic-rounding suite; the others are unscale suites
    optim_suite = "optim" in suites  # the fused-optimizer suite (GPU)
    e2e_suite = "e2e" in suites  # end to end: the zoo's models under torch's recipes and ours
    suites = [s for s in suites if s not in ("sround", "optim", "e2e")]
    cuda = args.device.startswith("cuda")
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    rows = []
    if not args.no_unscale and suites:
        if cuda:
            rows += unscale_gpu(suites, device=args.device, reps=args.reps)
        if args.cpu or not cuda:
            rows += unscale_cpu(suites)
        print(format_table(rows))
        print("\n".join(speedups(rows)))
        report["rows"] = [asdict(r) for r in rows]
    if args.scaler and cuda:
        from .scaler import format_overhead, scaler_overhead_gpu

        overhead = scaler_overhead_gpu(suites)
        print(format_overhead(overhead))
        report["scaler_overhead"] = [dict(asdict(r), torch_overhead=r.torch_overhead, ours_overhead=r.ours_overhead)
                                     for r in overhead]
    if args.lm and cuda:
        from .scaler import format_lm, lm_modes_gpu

        results = lm_modes_gpu(steps=args.lm)
        print(format_lm(results))
        report["lm"] = [{"scaler": name, "seed": seed, "skipped_steps": r.skipped_steps, "final_loss": r.final_loss,
                         "seconds": r.seconds, "entropy_floor": r.entropy_floor}
                        for (name, seed), r in results.items()]
    if sround:
        sround_rows = sround_gpu(device=args.device, reps=args.reps) if cuda else sround_cpu()
        print(format_table(sround_rows))
        print("\n".join(sround_summary(sround_rows)))
        report["sround"] = [asdict(r) for r in sround_rows]
        rows += sround_rows
    if optim_suite:
        if cuda:
            from .optim import format_optim, optim_gpu

            optim_rows = optim_gpu(device=args.device, reps=args.reps)
            print(format_optim(optim_rows))
            report["optim"] = [asdict(r) for r in optim_rows]
            rows += optim_rows
        else:
            print("optim suite: needs a CUDA GPU (the CPU step is covered by tests/test_optim.py)")
    if args.stats:
        stats_suites = suites or list(SUITES)
        stats_rows = stats_gpu(stats_suites, device=args.device, reps=args.reps) if cuda else stats_cpu(stats_suites)
        print(format_table(stats_rows))
        print("\n".join(stats_summary(stats_rows)))
        report["stats"] = [asdict(r) for r in stats_rows]
        rows += stats_rows
    if e2e_suite:
        from .e2e import RECIPES, format_e2e, run_e2e, to_json

        split = lambda text: [t for t in text.split(",") if t] if text else None  # noqa: E731
        result = run_e2e(models=split(args.e2e_models), recipes=split(args.e2e_recipes) or RECIPES,
                         modes=split(args.e2e_modes), steps=args.e2e_steps, device=args.device.split(":")[0])
        print(format_e2e(result))
        report["e2e"] = to_json(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
