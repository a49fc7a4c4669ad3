"""Pool bench/tuned_gap.py results: a controller loop's wall time against the plain loop over the round pairs of
several processes or calls (issue 21's 3% target on the host-bound compiled Llama needs hundreds of pairs: the
log ratio of one pair has a standard deviation of about 0.11 on an H200).

    python bench/gap_pool.py bench/results/session17/*/g/gap*.json [--loop tuned] [--baseline alone|plain|LOOP]

Per file and pooled: the round pairs, the geometric mean of the paired ratios with its 95% interval (the mean of
the log ratios plus or minus 1.96 standard errors; with this many pairs a bootstrap gives the same), and the
main thread's CPU time a step, loop minus plain loop, with its standard error. The pool treats every pair as
independent; the spread of the per-file means says whether the processes differ more than that (printed too).
With several files the pool also gives the interval between processes: each file's mean log ratio counts as one
measurement (Student's t with files - 1 degrees of freedom). It is the wider one when the processes differ by more
than their pairs' scatter explains, and with few files it is wide however many pairs each has.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np


def t975(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom (the tuner's own, which refuses
    df <= 0 by name)."""
    from adaptive_amp.tune import t_quantile

    return t_quantile(0.975, df)


def pairs(result: dict, loop: str, baseline: str = "alone"):
    """(log ratios, main-thread CPU ms differences) of `loop`'s rounds against the `baseline` loop's beside them
    ("alone": the plain loop in the controllers' process; "plain": in its own, tuned_gap.py --plain-process)."""
    loops = result.get("loops", {})
    if loop not in loops or baseline not in loops:
        raise ValueError(f"no {loop!r} and {baseline!r} loops in this result (loops: {sorted(loops)})")
    a, b = loops[loop], loops[baseline]
    logs = np.log(np.asarray(a["round_ms"], dtype=np.float64) / np.asarray(b["round_ms"], dtype=np.float64))
    host = np.asarray(a["round_host_cpu_ms"], dtype=np.float64) - np.asarray(b["round_host_cpu_ms"], dtype=np.float64)
    return logs, host


def summary(logs: np.ndarray, host: np.ndarray) -> dict:
    """The geometric mean ratio with its 95% interval, and the host CPU difference with its standard error."""
    n = len(logs)
    se = float(np.std(logs, ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    mean = float(np.mean(logs))
    return {"pairs": n, "ratio": math.exp(mean), "ci95": [math.exp(mean - 1.96 * se), math.exp(mean + 1.96 * se)],
            "log_ratio_sd": float(np.std(logs, ddof=1)) if n > 1 else math.nan,
            "host_ms": float(np.mean(host)),
            "host_ms_se": float(np.std(host, ddof=1) / math.sqrt(n)) if n > 1 else math.nan}


def pool(paths, loop: str = "tuned", baseline: str = "alone") -> dict:
    """{"files": {path: summary}, "pooled": summary, "file_means_sd": sd of the per-file mean log ratios,
    "between_files": the geometric mean of the per-file means with its 95% t interval (None for one file)}."""
    if not paths:
        raise ValueError("paths: give at least one tuned_gap.py JSON result")
    twice = sorted({p for p in paths if list(paths).count(p) > 1})
    if twice:
        raise ValueError(f"paths: {', '.join(twice)} given more than once (its pairs would count twice)")
    files, all_logs, all_host = {}, [], []
    for path in paths:
        with open(path) as f:
            try:
                logs, host = pairs(json.load(f), loop, baseline)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
        files[path] = summary(logs, host)
        all_logs.append(logs)
        all_host.append(host)
    means = np.asarray([float(np.mean(x)) for x in all_logs])
    between = None
    if len(means) > 1:
        half = t975(len(means) - 1) * float(np.std(means, ddof=1)) / math.sqrt(len(means))
        mid = float(np.mean(means))
        between = {"files": len(means), "ratio": math.exp(mid), "ci95": [math.exp(mid - half), math.exp(mid + half)]}
    return {"files": files, "pooled": summary(np.concatenate(all_logs), np.concatenate(all_host)),
            "file_means_sd": float(np.std(means, ddof=1)) if len(means) > 1 else math.nan,
            "between_files": between}


def _line(name: str, s: dict) -> str:
    lo, hi = s["ci95"]
    return (f"{name}: {s['pairs']} pairs, {s['ratio']:.3f} [95% {lo:.3f}, {hi:.3f}], main thread "
            f"{s['host_ms']:+.2f} ms a step (se {s['host_ms_se']:.2f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="tuned_gap.py --json results")
    p.add_argument("--loop", default="tuned", help="the controller loop compared with the plain loop")
    p.add_argument("--baseline", default="alone",
                   help="the loop compared against: the plain loop in the controllers' process (alone, the "
                        "default), in its own (plain: --plain-process), or any other, e.g. tuned-model-plain "
                        "(the plain step on the tuned controller's own model)")
    p.add_argument("--json", default=None, help="also write the pool here")
    args = p.parse_args(argv)
    try:
        res = pool(args.paths, args.loop, args.baseline)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    for path, s in res["files"].items():
        print(_line(path, s))
    print(_line("pooled", res["pooled"]))
    print(f"per-file mean log ratios: sd {res['file_means_sd']:.4f} "
          f"(pooled pairs' sd {res['pooled']['log_ratio_sd']:.3f})")
    if res["between_files"]:
        b = res["between_files"]
        print(f"between processes (each file's mean one measurement): {b['files']} files, {b['ratio']:.3f} "
              f"[95% {b['ci95'][0]:.3f}, {b['ci95'][1]:.3f}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
