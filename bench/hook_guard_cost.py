"""What dynamo's hook guards cost a compiled model's call on this host (issue 21's wall-clock gap).

Until 2026-11-27 the first ActivationCollector turned them on for the process
(``torch._dynamo.config.skip_nnmodule_hook_guards = False``): every graph traced from then on checked each
module's hook dictionaries at every call, a cost a training loop without a controller does not pay. This
script measured it; a collector now turns them on only after a statistics step that a graph without its hooks
skipped (adaptive_amp/collect.py). They are host work whose cost grows with the modules, not with the widths,
so a Llama with the 1.1B's 22 layers at tiny widths on the CPU measures it for the 1.1B on the same host.

    python bench/hook_guard_cost.py [--layers 22] [--backend inductor] [--json PATH]

One compiled forward (training mode, with autograd; --inference: eval mode under no_grad) is timed in rounds,
with the guards off and on in turn (dynamo reset between), several times; the medians and their difference are
printed. On this project's 2-core CPU machine (2026-11-27, a virtual machine, noisy) a training forward of the
22-layer Llama (293 modules) paid +0.64 ms with the guards (eager backend, 10 turns) and +0.62 ms (inductor, 4
turns), an inference forward +0.42 ms (inductor, 3 turns); each of the 19 turns' differences was positive
(0.01 to 2.7 ms). bench/results/session17/cpu_hook_guards/ has them. On the CPU of an H200 host (4 cores of
nvidia-h200-x4, torch 2.11, 2026-11-27, bench/results/session18/): +0.66 ms (inductor, 2 turns), 2.6% of the
compiled 1.1B Llama's 25 ms step (seventeenth session).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch


def build(layers: int):
    """The zoo's 1.1B Llama (its heads and key/value heads) with `layers` layers at tiny widths, and a batch."""
    import transformers

    from adaptive_amp.zoo.hf import LLAMA_SIZES

    shape = {k: v for k, v in LLAMA_SIZES["large"].items() if k != "seq_len"}
    shape.update(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, vocab_size=128,
                 max_position_embeddings=64)
    cfg = transformers.LlamaConfig(**shape, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train(), torch.randint(0, 128, (1, 16))


def time_calls(model, ids, guards: bool, backend: str, rounds: int, calls: int, inference: bool = False):
    """ms a compiled forward call, per round, traced with the hook guards on or off (`inference`: in eval mode
    under no_grad; else in training mode with autograd, as a training step calls it)."""
    from torch._dynamo import config

    torch._dynamo.reset()
    saved = config.skip_nnmodule_hook_guards
    config.skip_nnmodule_hook_guards = not guards
    model.train(not inference)
    try:
        with torch.no_grad() if inference else contextlib.nullcontext():
            forward = torch.compile(model, backend=backend)
            for _ in range(3):  # tracing and compiling are not the call
                forward(input_ids=ids).logits.sum()
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(calls):
                    forward(input_ids=ids).logits.sum()
                times.append((time.perf_counter() - t0) / calls * 1e3)
        return times
    finally:
        config.skip_nnmodule_hook_guards = saved
        torch._dynamo.reset()


def measure(layers: int = 22, backend: str = "inductor", rounds: int = 15, calls: int = 50, repeats: int = 2,
            inference: bool = False):
    model, ids = build(layers)
    times = {"off": [], "on": []}
    for _ in range(repeats):  # in turn, so that drift hits both
        for state in ("off", "on"):
            times[state] += time_calls(model, ids, state == "on", backend, rounds, calls, inference)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"layers": layers, "modules": sum(1 for _ in model.modules()), "backend": backend, "inference": inference,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "guards_off_ms": off, "guards_on_ms": on, "guards_us_a_call": (on - off) * 1e3,
            "round_ms": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=22, help="decoder layers (the 1.1B Llama has 22)")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=50, help="forward calls a round")
    p.add_argument("--repeats", type=int, default=2, help="times each state is timed, in turn")
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (the guards are one thread)")
    p.add_argument("--inference", action="store_true", help="eval mode under no_grad (default: a training forward)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for name in ("layers", "rounds", "calls", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    res = measure(args.layers, args.backend, args.rounds, args.calls, args.repeats, args.inference)
    print(f"{res['modules']} modules ({res['layers']} layers), {res['backend']}: a compiled forward call takes "
          f"{res['guards_off_ms']:.3f} ms without the hook guards and {res['guards_on_ms']:.3f} ms with them: "
          f"{res['guards_us_a_call']:+.0f} us a call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
