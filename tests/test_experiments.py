"""EXPERIMENTS (to be removed with csrc/experiments.h once measured): the runtime variant switch, and every
variant meeting the same contract on the GPU (stats against the CPU kernel; stochastic rounding bitwise)."""
import pytest
import torch

import adaptive_amp
from adaptive_amp import _C
from conftest import assert_stats_match, requires_cuda


@pytest.fixture(autouse=True)
def _restore():
    yield
    _C._set_variant("stats", 0)
    _C._set_variant("sround_e4m3", 0)


def test_switch():
    for name, env in (("stats", "AAMP_STATS_VARIANT"), ("sround_e4m3", "AAMP_SR_E4M3_VARIANT")):
        for v in (2, 1, 0):
            _C._set_variant(env if v == 1 else name, v)
            assert _C._get_variant(name) == v
        with pytest.raises(ValueError, match="not in 0..2"):
            _C._set_variant(name, 3)
    with pytest.raises(ValueError, match="unknown experiment"):
        _C._set_variant("nope", 0)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("variant", [0, 1, 2])
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


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("variant", [1, 2])
def test_sround_e4m3_variants_bitwise(variant):
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(1)) * 2.0 ** torch.randint(-12, 8, (1,))
    x[[0, 5, 77]] = torch.tensor([float("nan"), float("inf"), 1e-30])
    cpu = adaptive_amp.stochastic_round(x, torch.float8_e4m3fn, seed=3, offset=4)
    for shift in (0, 1):
        xs = x.cuda()[shift:]
        _C._set_variant("sround_e4m3", variant)
        got = adaptive_amp.stochastic_round(xs, torch.float8_e4m3fn, seed=3, offset=4).cpu()
        _C._set_variant("sround_e4m3", 0)
        base = adaptive_amp.stochastic_round(xs, torch.float8_e4m3fn, seed=3, offset=4).cpu()
        assert torch.equal(got.view(torch.uint8), base.view(torch.uint8))
        if shift == 0:
            assert torch.equal(got.view(torch.uint8), cpu.view(torch.uint8))
