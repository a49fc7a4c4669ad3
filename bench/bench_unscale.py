"""Benchmark of the fused unscale-and-check kernels; see adaptive_amp/bench.py.

    python bench/bench_unscale.py --json unscale.json [--cpu]
"""

from adaptive_amp.bench import main

if __name__ == "__main__":
    main()
