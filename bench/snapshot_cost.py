"""What the tuning's snapshot costs: Llama-1.1B-sized fp32 weights (about 5 GB, 156 tensors) copied off the GPU
and back by adaptive_amp.tune.Snapshot (one host block, registered with CUDA), by the same with torch's pinned
allocator (registration off), and by the old way (a pinned allocation and a synchronous copy a tensor). Each
twice, in one process.

Usage: python bench/snapshot_cost.py [--tiny]   (--tiny: a small model, on the CPU when there is no GPU)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from adaptive_amp.tune import Snapshot


def _model(tiny: bool, device: str) -> nn.Module:
    h, f, v, n = (64, 176, 1000, 2) if tiny else (2048, 5632, 32000, 22)  # TinyLlama's shapes
    with torch.device(device):
        mats = [nn.Embedding(v, h)] + [nn.Linear(a, b, bias=False) for _ in range(n)
                                       for a, b in [(h, h)] * 4 + [(h, f), (h, f), (f, h)]]
        return nn.Sequential(*mats, nn.Linear(h, v, bias=False))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    model = _model(args.tiny, dev)
    params = list(model.parameters())
    gb = sum(q.numel() * q.element_size() for q in params) / 1e9
    print(f"{dev}: {len(params)} tensors, {gb:.2f} GB; torch {torch.__version__}")
    empty_host_cache = getattr(torch._C, "_host_emptyCache", lambda: None)

    def timed(label, fn):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        s = time.perf_counter() - t0
        print(f"{label:58s} {s:7.3f} s  {gb / max(s, 1e-9):6.1f} GB/s", flush=True)
        return out

    def no_cudart():
        raise RuntimeError("registration off (this bench)")

    def old_copy():
        return [torch.empty(q.shape, dtype=q.dtype, pin_memory=dev == "cuda").copy_(q.detach()) for q in params]

    real_cudart = torch.cuda.cudart
    try:
        for rep in range(2):
            for way in ("registered", "torch pinned allocator"):
                torch.cuda.cudart = real_cudart if way == "registered" else no_cudart
                snap = timed(f"[{rep}] Snapshot, one block ({way})", lambda: Snapshot(model, [], offload=True))
                assert snap.host.registered == (way == "registered" and dev == "cuda")
                timed(f"[{rep}]   its restore (in place, async)", snap.restore)
                timed(f"[{rep}]   freeing it", lambda: snap.__dict__.clear())
                del snap
                empty_host_cache()
            torch.cuda.cudart = real_cudart
            copies = timed(f"[{rep}] old: a pinned allocation + a sync copy a tensor", old_copy)
            timed(f"[{rep}]   old restore (in place, sync per tensor)",
                  lambda: [q.data.copy_(c) for q, c in zip(params, copies)])
            del copies
            empty_host_cache()
    finally:
        torch.cuda.cudart = real_cudart
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
