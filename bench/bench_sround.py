"""Benchmark of stochastic rounding (fp32 -> bf16, fp16, fp8 e4m3fn, fp8 e5m2); see adaptive_amp/bench.py.

    python bench/bench_sround.py --json sround.json

Times, in one run on one GPU: ours, `.to(dtype)`, the pure-torch reference
eager and under torch.compile, and the device copy ceiling (256M elements).
"""

import sys

from adaptive_amp.bench import main

if __name__ == "__main__":
    main(["--suites", "sround", *sys.argv[1:]])
