"""Benchmark of the fused SR optimizers on the GPT-2-small parameter set; see adaptive_amp/bench/optim.py.

    python bench/bench_optim.py --json optim.json

Times, in one run on one GPU: adaptive_amp.optim.AdamW on bf16 params (fp32
and bf16 moments), torch.optim.AdamW(fused=True) in fp32, a pure-torch SR
AdamW on bf16 params, SGD with momentum both ways, and the device copy ceiling.
"""

import sys

from adaptive_amp.bench import main

if __name__ == "__main__":
    main(["--suites", "optim", *sys.argv[1:]])
