"""What the controller's step runs beyond its plain twin's, op by op (issue 17 item 7: overhead <= 3%).

    python bench/e2e_ops.py [--model gpt2-small] [--recipes bf16-pure,auto,fp16] [--steps 5] [--json PATH]
    python bench/e2e_ops.py --cpu        # the zoo's tiny GPT-2 on the CPU (tests/test_e2e_ops_script.py)

Builds the e2e benchmark's two loops of each recipe (adaptive_amp.bench.e2e.build_loops: the same model,
dtypes, optimizer and clipping; 8 x 512 tokens on the GPU), warms both up, then records with torch.profiler
`--steps` ordinary steps of each loop, one after the other, and one statistics step of each (the controller's
step 50, the plain loop's step at the same count). Per loop and kind of step it reports, per step: device
kernels (launch count and GPU time; on the CPU: aten ops), host-to-device synchronizations
(``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``cudaEventSynchronize`` calls), and wall time; then the
kernels whose count or GPU time differs between the two loops. On a GPU the question it answers is whether
the controller's ordinary step launches anything its twin does not (CPU tests say no: only the per-layer
hooks' Python and a few scalars) and where a difference in step time comes from.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from adaptive_amp import zoo
from adaptive_amp.bench.e2e import MODELS, build_loops
from adaptive_amp.bench.op_profile import profile_steps


def _profile(loop, batches, first: int, n: int, cuda: bool):
    """(per-kernel {name: [count, device us]}, syncs, wall ms) of n steps, per step."""
    return profile_steps(lambda i: loop.step(batches[(first + i) % len(batches)]), n, cuda)


def _diff(plain: dict, ctl: dict, min_us: float = 1.0):
    rows = []
    for name in sorted(set(plain) | set(ctl)):
        (pc, pu), (cc, cu) = plain.get(name, [0, 0.0]), ctl.get(name, [0, 0.0])
        if abs(pc - cc) > 1e-9 or abs(pu - cu) >= min_us:
            rows.append((name, pc, cc, pu, cu))
    return rows


def compare(recipe: str, zm, batches, device: str, steps: int) -> dict:
    cuda = device == "cuda"
    plain, ctl = build_loops(recipe, zm, device, False, batches[0])
    every = ctl.amp.monitor.stats_every
    try:
        for i in range(3):  # warm-up (the controller's step 0 is a statistics step)
            plain.step(batches[i % len(batches)])
            ctl.step(batches[i % len(batches)])
        out = {"recipe": recipe, "policy": str(ctl.amp.policy)}
        for kind in ("ordinary", "statistics"):
            if kind == "statistics":
                while not ctl.amp._stats_due():  # to the next statistics step, both loops alike
                    s = ctl.amp.step_count
                    plain.step(batches[s % len(batches)])
                    ctl.step(batches[s % len(batches)])
                n = 1
            else:
                n = min(steps, every - ctl.amp.step_count % every - 1)  # ordinary steps only
            start = ctl.amp.step_count
            p = _profile(plain, batches, start, n, cuda)
            c = _profile(ctl, batches, start, n, cuda)
            total = lambda k: (sum(v[0] for v in k.values()), sum(v[1] for v in k.values()))  # noqa: E731
            out[kind] = {"steps": n, "plain": {"launches": total(p[0])[0], "device_us": total(p[0])[1],
                                                "syncs": p[1], "wall_ms": p[2]},
                         "controller": {"launches": total(c[0])[0], "device_us": total(c[0])[1],
                                        "syncs": c[1], "wall_ms": c[2]},
                         "differences": _diff(p[0], c[0])}
        return out
    finally:
        ctl.amp.remove()


def format_result(res: dict) -> str:
    lines = []
    for r in res["recipes"]:
        lines.append(f"== {res['model']} eager {r['recipe']} ({r['policy']}), per step")
        for kind in ("ordinary", "statistics"):
            k = r[kind]
            for loop in ("plain", "controller"):
                v = k[loop]
                lines.append(f"  {kind:10} {loop:10} launches {v['launches']:8.1f}  device {v['device_us'] / 1e3:8.3f} ms"
                             f"  syncs {v['syncs']:4.1f}  wall {v['wall_ms']:8.3f} ms (profiled)")
            for name, pc, cc, pu, cu in k["differences"][:25]:
                lines.append(f"    {'differs':10} {name[:70]:70} count {pc:6.1f} -> {cc:6.1f}  "
                             f"device {pu:9.1f} -> {cu:9.1f} us")
            if len(k["differences"]) > 25:
                lines.append(f"    ... {len(k['differences']) - 25} more")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-small", choices=sorted(MODELS))
    p.add_argument("--recipes", default="bf16-pure,auto,fp16")
    p.add_argument("--steps", type=int, default=5, help="ordinary steps profiled per loop")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (GPU 8, CPU 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (GPU 512)")
    p.add_argument("--cpu", action="store_true", help="the tiny model on the CPU (aten ops instead of kernels)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/e2e_ops.py needs a CUDA GPU (or --cpu)")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    family, size = MODELS[args.model]
    zm = zoo.build(family, "tiny" if args.cpu else size, seed=0, device=device)
    seq_len = args.seq_len or (None if args.cpu else 512)
    batches = [zm.make_batch(args.batch or (2 if args.cpu else 8), seed=i, device=device, seq_len=seq_len)
               for i in range(8)]
    res = {"model": args.model if not args.cpu else f"{family}-tiny", "device": device,
           "torch": torch.__version__, "recipes": []}
    for recipe in [r for r in args.recipes.split(",") if r]:
        torch._dynamo.reset()
        res["recipes"].append(compare(recipe, zm, batches, device, args.steps))
    print(format_result(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
