"""DynamicPrecisionAdjuster (islands in fp32 under autocast) and PrecisionAnalyzer (per-layer format risk), on CPU."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Tuple

import pytest
import torch
from torch import nn

from adaptive_amp.adjust import DynamicPrecisionAdjuster
from adaptive_amp import tensor_stats
from adaptive_amp.analysis import PrecisionAnalysis, PrecisionAnalyzer, current_scale
from adaptive_amp.demo import TinyLM
from conftest import cuda_param


@dataclass(frozen=True)
class Policy:
    """Stands in for PrecisionPolicy: the two fields the adjuster reads."""

    compute_dtype: torch.dtype
    islands: Tuple[str, ...] = ()


class Recording(nn.Linear):
    """A Linear that records the dtype of its input and of its matmul result."""

    def forward(self, x):
        out = super().forward(x)
        self.seen = (x.dtype, out.dtype)
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Recording(8, 8)
        self.b = Recording(8, 8)
        self.c = Recording(8, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def hooks_and_forwards(model):
    return [(n, dict(m._forward_pre_hooks), dict(m._forward_hooks), "forward" in m.__dict__, type(m))
            for n, m in model.named_modules()]


# ---------------------------------------------------------------- adjuster


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_islands_run_in_fp32_others_in_compute_dtype(device, dtype):
    torch.manual_seed(0)
    model, x = Net().to(device), torch.randn(4, 8, device=device)
    adj = DynamicPrecisionAdjuster(model, Policy(dtype, ("b",)))
    with adj.autocast():
        y = model(x)
    assert model.a.seen == (torch.float32, dtype)
    assert model.b.seen == (torch.float32, torch.float32)  # its input came from a in low precision: cast back up
    assert model.c.seen == (torch.float32, dtype)
    assert y.dtype == dtype
    assert adj.islands == ("b",)


def test_fp32_policy_disables_autocast():
    model = Net()
    adj = DynamicPrecisionAdjuster(model, Policy(torch.float32))
    with adj.autocast():
        model(torch.randn(2, 8))
    assert adj.autocast()._enabled is False  # no point in autocast to fp32
    assert all(m.seen == (torch.float32, torch.float32) for m in (model.a, model.b, model.c))


def test_set_policy_promotes_and_demotes_without_touching_parameters():
    model, x = Net(), torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [p for p in model.parameters()]
    before = [p.detach().clone() for p in params]
    adj = DynamicPrecisionAdjuster(model, Policy(torch.bfloat16, ("a",)))
    adj.set_policy(Policy(torch.bfloat16, ("b", "c")))  # promote b, c; demote a
    with adj.autocast():
        model(x)
    assert model.a.seen[1] == torch.bfloat16
    assert model.b.seen[1] == torch.float32 and model.c.seen[1] == torch.float32
    assert type(model.a) is Recording
    adj.set_policy(Policy(torch.float16, ()))  # switch the format, no islands
    assert adj.autocast().fast_dtype == torch.float16
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert [type(m) for m in (model.a, model.b, model.c)] == [Recording] * 3
    assert [p for p in model.parameters()] == params and opt.param_groups[0]["params"] == params
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_remove_restores_model_exactly():
    model = TinyLM(vocab=16, d_model=32, heads=2, layers=1, context=16)
    tokens = torch.randint(16, (2, 8))
    state = hooks_and_forwards(model)
    with torch.no_grad():
        ref = model(tokens)
    adj = DynamicPrecisionAdjuster(model, Policy(torch.bfloat16, ("ln_f", "lm_head", "blocks.layers.0.norm1")))
    assert hooks_and_forwards(model) != state
    adj.remove()
    assert hooks_and_forwards(model) == state
    assert adj.islands == ()
    with torch.no_grad():
        assert torch.equal(model(tokens), ref)


def test_a_forward_set_on_the_instance_is_refused_before_anything_changed():
    # It would shadow the island's class, which could then not make the layer fp32.
    model = Net()
    own = model.b.forward  # a bound method stored on the instance by someone else (accelerate's hooks, say)
    model.b.forward = own
    adj = DynamicPrecisionAdjuster(model, Policy(torch.bfloat16, ("a",)))
    with pytest.raises(ValueError, match="'b' has a forward set on the instance"):
        adj.set_policy(Policy(torch.bfloat16, ("b",)))
    assert adj.islands == ("a",) and type(model.b) is Recording and model.b.__dict__["forward"] is own


def test_unknown_island_is_an_error():
    with pytest.raises(ValueError, match="nope"):
        DynamicPrecisionAdjuster(Net(), Policy(torch.bfloat16, ("nope",)))
    with pytest.raises(ValueError, match="compute_dtype"):
        DynamicPrecisionAdjuster(Net(), Policy(torch.float64))


def test_tinylm_islands_under_autocast():
    torch.manual_seed(0)
    model = TinyLM(vocab=16, d_model=32, heads=2, layers=1, context=16)
    seen = {}
    adj = DynamicPrecisionAdjuster(model, Policy(torch.bfloat16, ("lm_head",)))
    # Hooks registered after the adjuster see what the island's forward sees.
    model.lm_head.register_forward_hook(lambda m, a, out: seen.update(head=(a[0].dtype, out.dtype)))
    model.blocks.layers[0].linear1.register_forward_hook(lambda m, a, out: seen.update(ff=out.dtype))
    with adj.autocast():
        model(torch.randint(16, (2, 8)))
    assert seen["head"] == (torch.float32, torch.float32)
    assert seen["ff"] == torch.bfloat16


def test_compile_settings_nest_and_restore(monkeypatch):
    """The policy's AOT autograd settings (set and restored as plain config values, once a step): inside a
    user's own patch, nested, and when the autocast they come with raises on entry, what was there before
    comes back."""
    from torch._functorch import config

    from adaptive_amp.adjust import PolicyAutocast, compile_settings

    names = ("backward_pass_autocast", "view_replay_for_aliased_outputs", "enable_autograd_cache")
    names = [n for n in names if hasattr(config, n)]
    if not names:
        pytest.skip("this torch has none of the settings")
    want = {"backward_pass_autocast": "off", "view_replay_for_aliased_outputs": False,
            "enable_autograd_cache": False}
    before = {n: getattr(config, n) for n in names}
    with compile_settings():
        assert {n: getattr(config, n) for n in names} == {n: want[n] for n in names}
        with config.patch({n: before[n] for n in names}):  # the user's own values inside ours
            with compile_settings():
                assert {n: getattr(config, n) for n in names} == {n: want[n] for n in names}
            assert {n: getattr(config, n) for n in names} == before
        assert {n: getattr(config, n) for n in names} == {n: want[n] for n in names}
    assert {n: getattr(config, n) for n in names} == before

    def refuse(self):
        raise RuntimeError("autocast refused")

    monkeypatch.setattr(torch.autocast, "__enter__", refuse)
    with pytest.raises(RuntimeError, match="autocast refused"):
        with PolicyAutocast("cpu", dtype=torch.bfloat16):
            pass
    assert {n: getattr(config, n) for n in names} == before


def test_works_under_torch_compile():
    torch.manual_seed(0)
    torch._dynamo.reset()
    model, x = Net(), torch.randn(4, 8)
    adj = DynamicPrecisionAdjuster(model, Policy(torch.bfloat16, ("b",)))
    # fullgraph: the island wrapper must trace without a graph break. aot_eager keeps the test fast;
    # the dtypes recorded by Recording are replayed from the traced graph.
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), adj.autocast():
        eager = model(x)
        out = compiled(x)
    assert model.a.seen == (torch.float32, torch.bfloat16)
    assert model.b.seen == (torch.float32, torch.float32)  # the island is fp32 inside the compiled graph
    assert out.dtype == eager.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), eager.float(), rtol=2e-2, atol=2e-2)
    # A new policy between steps makes the compiled model retrace.
    adj.set_policy(Policy(torch.bfloat16, ("a", "c")))
    with torch.no_grad(), adj.autocast():
        compiled(x)
    assert model.a.seen[1] == torch.float32 and model.b.seen == (torch.float32, torch.bfloat16)  # a fed b fp32
    assert model.c.seen == (torch.float32, torch.float32)
    adj.remove()
    with torch.no_grad(), adj.autocast():
        compiled(x)
    assert all(m.seen[1] == torch.bfloat16 for m in (model.a, model.b, model.c))
    assert hooks_and_forwards(model) == hooks_and_forwards(Net())


# ---------------------------------------------------------------- analyzer


class Planted(nn.Module):
    """Three branches: ordinary layers, one that overflows fp16, one that cancels catastrophically."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 8)
        self.big = nn.Linear(16, 8)  # weights ~1e3 on inputs ~10: outputs ~1e5 > fp16's 65504
        self.cancel = nn.Linear(16, 8, bias=False)  # rows sum to 0 on inputs ~1000: a difference of near-equals
        with torch.no_grad():
            for lin in (self.hidden, self.out):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / lin.in_features ** 0.5)
                lin.bias.zero_()
            self.big.weight.copy_(1e3 + torch.rand(8, 16, generator=gen))
            self.big.bias.zero_()
            w = torch.randn(8, 16, generator=gen)
            self.cancel.weight.copy_(w - w.mean(dim=1, keepdim=True))

    def forward(self, x):
        ordinary = self.out(torch.relu(self.hidden(x)))
        big = self.big(x.abs() * 10) * 1e-5
        cancel = self.cancel(x + 1000.0)
        return torch.cat([ordinary, big, cancel], dim=-1)


@pytest.fixture(scope="module", params=["cpu", cuda_param()])
def planted(request):
    torch.manual_seed(1)
    model, x = Planted().to(request.param), torch.randn(64, 16).to(request.param)
    analysis = PrecisionAnalyzer().analyze(model, x, loss_fn=lambda y: y.square().mean())
    return model, x, analysis


def test_planted_overflow_flagged_for_fp16_not_bf16(planted):
    _, _, analysis = planted
    fp16 = dict(analysis.risky_layers(torch.float16))
    bf16 = dict(analysis.risky_layers(torch.bfloat16))
    assert "overflow" in fp16["big"]
    assert "big" not in bf16
    r = analysis.result("big", torch.float16)
    assert r.overflow and r.amax > 65504 and math.isinf(r.model_error) and r.sqnr_db == -math.inf
    assert not analysis.result("big", "bfloat16").overflow


def test_planted_cancellation_flagged(planted):
    _, _, analysis = planted
    for fmt in (torch.float16, torch.bfloat16):
        why = dict(analysis.risky_layers(fmt))["cancel"]
        assert "model output error" in why and "overflow" not in why
    assert analysis.result("cancel", "bfloat16").model_error > 0.1


def test_ordinary_layers_not_flagged(planted):
    _, _, analysis = planted
    for fmt in (torch.float16, torch.bfloat16):
        names = [n for n, _ in analysis.risky_layers(fmt)]
        assert "hidden" not in names and "out" not in names
    r = analysis.result("hidden", torch.bfloat16)
    assert 0 < r.layer_error < 0.01 and r.sqnr_db > 40 and not r.overflow
    # fp8 is cast with per-tensor scaling: 'big' (amax 1.8e5, far above e4m3's 448) fits, the ordinary
    # layers lose only e4m3's 3 mantissa bits, and cancellation is still caught.
    fp8 = dict(analysis.risky_layers("float8_e4m3fn"))
    assert set(fp8) == {"cancel"}
    r = analysis.result("big", "float8_e4m3fn")
    assert r.scaled and not r.overflow and r.amax > r.format_max and r.model_error < 0.01
    assert not analysis.result("big", torch.float16).scaled


def test_gradients_and_underflow_measured(planted):
    model, _, analysis = planted
    assert analysis.grad_amax is not None and analysis.grad_amax > 0
    r = analysis.result("hidden", torch.float16)
    assert r.grad_underflow_fraction is not None and 0 <= r.grad_underflow_fraction <= 1
    assert 0 <= r.underflow_fraction <= 1
    assert all(p.grad is None for p in model.parameters())  # the caller's gradients are untouched


def test_underflow_fraction_of_tiny_inputs():
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.full((8, 4), 1e-9)  # below fp16's smallest subnormal (6e-8), fine in bf16
    analysis = PrecisionAnalyzer(candidates=(torch.float16, torch.bfloat16), progress=False).analyze(model, x)
    assert analysis.result("0", torch.float16).underflow_fraction == 1.0
    assert analysis.result("0", torch.bfloat16).underflow_fraction == 0.0
    assert analysis.grad_amax is None


class OneLinear(nn.Module):
    """A bias-free Linear whose model output leaves out the first row (a token the loss ignores)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)) / 4)

    def forward(self, x):
        return self.lin(x)[1:]


# fp8 e4m3 keeps 3 mantissa bits: an ordinary layer's own error in it is a few percent, above the
# default threshold (made for bf16). These tests judge fp8 with a threshold suited to it.
FP8 = dict(candidates=("float8_e4m3fn", torch.bfloat16), error_threshold=0.1, progress=False)


def test_scaled_fp8_keeps_small_activations_a_plain_cast_flushes():
    torch.manual_seed(0)
    model, x = OneLinear(), torch.randn(65, 16) * 1e-4  # all below e4m3's smallest subnormal (2**-9)
    plain = model.lin(x.to(torch.float8_e4m3fn).float())
    assert torch.count_nonzero(plain) == 0  # an unscaled cast would ruin the layer
    assert tensor_stats([x], fmt="float8_e4m3fn").to_dict()["underflow_count"] == [x.numel()]
    analysis = PrecisionAnalyzer(**FP8).analyze(model, x, loss_fn=lambda y: y.sum())
    r = analysis.result("lin", "float8_e4m3fn")
    assert r.scaled and not r.overflow
    assert r.underflow_fraction == 0.0 and r.grad_underflow_fraction == 0.0
    assert 0 < r.model_error < 0.06  # e4m3's rounding, nothing more
    assert analysis.risky_layers("float8_e4m3fn") == []


def test_scaled_fp8_flags_outlier_dominated_activation():
    torch.manual_seed(0)
    model, x = OneLinear(), torch.randn(65, 16)
    x[0, 0] = 3e5  # one outlier sets the scale: ordinary values land in e4m3's subnormals or flush to 0
    analysis = PrecisionAnalyzer(**FP8).analyze(model, x)
    r = analysis.result("lin", "float8_e4m3fn")
    assert r.scaled and not r.overflow and r.amax == pytest.approx(3e5)
    assert r.model_error > 0.2 and r.underflow_fraction > 0.2
    assert "model output error" in dict(analysis.risky_layers("float8_e4m3fn"))["lin"]
    # The same layer without the outlier is fine in fp8, and bf16 does not care either way.
    assert analysis.result("lin", torch.bfloat16).model_error < 0.01
    x[0, 0] = 1.0
    assert PrecisionAnalyzer(**FP8).analyze(model, x).risky_layers("float8_e4m3fn") == []


def test_current_scale():
    t = torch.tensor([0.5, -2.0, float("nan"), float("inf")])
    assert current_scale(t, torch.float8_e4m3fn).item() == 448 / 2  # amax of the finite values
    assert current_scale(t, "float8_e5m2", margin=1).item() == 57344 / 2 / 2
    assert current_scale(torch.zeros(3), "float8_e4m3fn").item() == 1.0  # nothing to scale
    assert current_scale(torch.zeros(0), "float8_e4m3fn").item() == 1.0
    assert current_scale(torch.tensor([1e-44]), "float8_e4m3fn").item() == torch.finfo(torch.float32).max
    with pytest.raises(ValueError, match="fp8_margin"):
        PrecisionAnalyzer(fp8_margin=-1)


def test_fp8_margin_leaves_headroom():
    torch.manual_seed(0)
    model, x = OneLinear(), torch.randn(65, 16)
    plain = PrecisionAnalyzer(**FP8).analyze(model, x).result("lin", "float8_e4m3fn")
    wide = PrecisionAnalyzer(**FP8, fp8_margin=14).analyze(model, x).result("lin", "float8_e4m3fn")
    # 14 bits of headroom push ordinary values into the subnormals: more error, more underflow.
    assert plain.underflow_fraction == 0 and wide.underflow_fraction > 0.05
    assert wide.model_error > 2 * plain.model_error


def test_table_and_json(planted):
    _, _, analysis = planted
    text = analysis.table()
    lines = text.splitlines()
    assert "big" in lines[2] and "float16" in lines[2] and "RISKY" in lines[2]  # worst first
    for name in ("hidden", "out", "big", "cancel"):
        assert name in text
    fp16_rows = analysis.table(torch.float16).splitlines()[2:]
    assert len(fp16_rows) == 4 and all(" float16 " in row for row in fp16_rows)
    data = json.loads(analysis.to_json())
    assert data == analysis.to_dict()
    assert isinstance(data, dict) and len(data["results"]) == 4 * 3
    assert [n for n, _ in data["risky"]["float16"]][0] == "big"
    assert isinstance(analysis, PrecisionAnalysis)


def test_tinylm_analysis_runs_and_restores_modes():
    torch.manual_seed(0)
    model = TinyLM(vocab=16, d_model=32, heads=2, layers=1, context=16).train()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(16, (2, 8))
    analysis = PrecisionAnalyzer(candidates=(torch.bfloat16,), progress=False).analyze(model, tokens)
    names = {r.name for r in analysis.results}
    # MultiheadAttention's out_proj is used through its parent's weights, never called: skipped, not wrong.
    assert {"lm_head", "blocks.layers.0.linear1", "blocks.layers.0.self_attn"} <= names
    assert "blocks.layers.0.self_attn.out_proj" in analysis.skipped
    assert all(m.training for m in model.modules())
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert analysis.risky_layers(torch.bfloat16) == []


def test_error_thresholds_per_format():
    from adaptive_amp.analysis import DEFAULT_ERROR_THRESHOLDS

    assert PrecisionAnalyzer().error_threshold == DEFAULT_ERROR_THRESHOLDS
    assert DEFAULT_ERROR_THRESHOLDS["float8_e4m3fn"] > DEFAULT_ERROR_THRESHOLDS["bfloat16"]
    one = PrecisionAnalyzer(error_threshold=0.3).error_threshold
    assert set(one.values()) == {0.3}
    mixed = PrecisionAnalyzer(error_threshold={torch.bfloat16: 0.05}).error_threshold
    assert mixed["bfloat16"] == 0.05 and mixed["float16"] == DEFAULT_ERROR_THRESHOLDS["float16"]
    for bad in (0, -1.0, {"float16": 0}, {"float16": "x"}):
        with pytest.raises(ValueError, match="error_threshold"):
            PrecisionAnalyzer(error_threshold=bad)
    analysis = PrecisionAnalyzer(candidates=("float16", "float8_e4m3fn"), progress=False).analyze(
        Net(), torch.randn(4, 8))
    assert analysis.threshold("float8_e4m3fn") == DEFAULT_ERROR_THRESHOLDS["float8_e4m3fn"]
    assert analysis.to_dict()["error_threshold"] == {"float16": 0.02, "float8_e4m3fn": 0.1}
