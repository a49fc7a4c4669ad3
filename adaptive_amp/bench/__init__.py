"""Benchmarks, the suites of ``python -m adaptive_amp bench`` (:mod:`.cli`): the kernels (:mod:`.kernels`),
GradScaler overhead (:mod:`.scaler`), the fused optimizers (:mod:`.optim`), end to end (:mod:`.e2e`),
tuning (:mod:`.tuning`), scale (:mod:`.scale`), the zoo at real size (:mod:`.zoo`) and multi-GPU
(:mod:`.multi_gpu`, :mod:`.multi_gpu_integrations`). They need torch; timings need a CUDA GPU (the CPU
variants check that everything runs).
"""

from .cli import main
from .kernels import SUITES, Row, gpt2_small_shapes, many_small_shapes

__all__ = ["Row", "SUITES", "gpt2_small_shapes", "main", "many_small_shapes"]
