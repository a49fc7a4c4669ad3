"""EXPERIMENTS (to be removed with csrc/experiments.h once measured): the runtime variant switch, and every
tensor_stats variant meeting the same contract on the GPU (against the CPU kernel)."""
import pytest
import torch

import adaptive_amp
from adaptive_amp import _C
from conftest import assert_stats_match, requires_cuda


@pytest.fixture(autouse=True)
def _restore():
    yield
    _C._set_variant("stats", 0)


def test_switch():
    for v in (1, 0):
        _C._set_variant("AAMP_STATS_VARIANT" if v == 1 else "stats", v)
        assert _C._get_variant("stats") == v
    with pytest.raises(ValueError, match="not in 0..1"):
        _C._set_variant("stats", 2)
    for gone in ("sround_e4m3", "nope"):
        with pytest.raises(ValueError, match="unknown experiment"):
            _C._set_variant(gone, 0)
        with pytest.raises(ValueError, match="unknown experiment"):
            _C._get_variant(gone)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("variant", [0, 1])
def test_stats_variants_match_cpu(variant):
    g = torch.Generator().manual_seed(variant)
    sizes = [1, 5, 16383, 16384, 16385, 3 * 16384 + 7, 300_001]
    ts = [torch.randn(n + 3, generator=g)[i % 3:][:n] * 2.0 ** (i - 3) + 5.0 for i, n in enumerate(sizes)]
    ts[-1][[10, 20, 30]] = torch.tensor([float("nan"), float("inf"), 3e38])
    ts.append(torch.randn(40_000, generator=g).to(torch.bfloat16))
    _C._set_variant("stats", variant)
    for fmt in (None, "float8_e4m3fn"):
        cpu = adaptive_amp.tensor_stats(ts, fmt=fmt).to_dict()
        gpu = adaptive_amp.tensor_stats([t.cuda() for t in ts], fmt=fmt).to_dict()
        again = adaptive_amp.tensor_stats([t.cuda() for t in ts], fmt=fmt).to_dict()
        assert_stats_match(gpu, cpu, f"variant {variant} fmt={fmt}")
        assert str(gpu) == str(again)  # deterministic run to run

