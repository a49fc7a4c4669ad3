"""Benchmarks: the kernel suites (:mod:`.kernels`), GradScaler overhead (:mod:`.scaler`),
the fused optimizers (:mod:`.optim`), and the command line (:mod:`.cli`,
``python -m adaptive_amp bench``). They need torch; timings need a CUDA GPU
(the CPU variants check that everything runs).
"""

from .cli import main
from .kernels import SUITES, Row, gpt2_small_shapes, many_small_shapes

__all__ = ["Row", "SUITES", "gpt2_small_shapes", "main", "many_small_shapes"]
