"""Hardware detection, precision policies and the selector's decision table."""

from __future__ import annotations

import dataclasses
import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive_amp.hardware import Capabilities, HardwareDetector
from adaptive_amp.policy import (AdaptivePrecisionSelector, LossScale, PrecisionPolicy, initial_loss_scale,
                                 parse_dtype)

from conftest import requires_cuda


def gpu(name, sm, fp16, bf16, tf32, fp8):
    return Capabilities(device_type="cuda", name=name, compute_capability=sm, total_memory=16 * 2**30,
                        multiprocessors=80, fp16=fp16, bf16=bf16, tf32=tf32, fp8=fp8, index=0)


PASCAL = gpu("Tesla P100", (6, 0), False, False, False, False)
TURING = gpu("Tesla T4", (7, 5), True, False, False, False)
AMPERE = gpu("A100", (8, 0), True, True, True, False)
HOPPER = gpu("H100", (9, 0), True, True, True, True)
CPU_BF16 = Capabilities(device_type="cpu", name="Xeon", total_memory=2**34, multiprocessors=32, bf16=True)
CPU_PLAIN = Capabilities(device_type="cpu", name="old x86", total_memory=2**33, multiprocessors=8)
CPU_FP16_ONLY = Capabilities(device_type="cpu", name="fp16 cpu", multiprocessors=8, fp16=True)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


class FakeAnalysis:
    def __init__(self, risky=None, grad_amax=None):
        self.risky = risky or {}
        if grad_amax is not None:
            self.grad_amax = grad_amax
        self.asked = []

    def risky_layers(self, dtype):
        self.asked.append(dtype)
        return self.risky.get(dtype, [])


def select(caps, **kw):
    return AdaptivePrecisionSelector().select(None, caps, **kw)


def text(policy):
    return "\n".join(policy.reasons)


# ---------------------------------------------------------------------- decision table

@pytest.mark.parametrize("caps, compute, tf32, scaled", [
    (PASCAL, F32, False, False),
    (TURING, F16, False, True),
    (AMPERE, BF16, True, False),
    (HOPPER, BF16, True, False),
    (CPU_BF16, BF16, False, False),
    (CPU_PLAIN, F32, False, False),
    (CPU_FP16_ONLY, F32, False, False),  # CPU autocast is bf16; fp16 unscaled would underflow
], ids=["pascal", "turing", "ampere", "hopper", "cpu-bf16", "cpu-plain", "cpu-fp16-only"])
def test_decision_table(caps, compute, tf32, scaled):
    p = select(caps)
    assert p.param_dtype == F32
    assert p.compute_dtype == compute
    assert p.tf32 is tf32
    assert p.uses_loss_scaling is scaled
    assert p.islands == ()
    assert len(p.reasons) >= 2 and all(isinstance(r, str) and r for r in p.reasons)
    assert f"compute={str(compute).replace('torch.', '')}" in text(p)


def test_turing_gets_dynamic_default_scale():
    p = select(TURING)
    assert p.loss_scale == LossScale(mode="dynamic", init_scale=65536.0)
    assert "bf16 would be emulated" in text(p)
    assert str(p) == "params=float32,compute=float16,loss_scale=dynamic:65536"


def test_fp8_is_only_a_recommendation():
    assert "fp8" in text(select(HOPPER))
    assert select(HOPPER).compute_dtype == BF16
    assert "fp8" not in text(select(AMPERE))


def test_tf32_without_bf16_still_used_for_fp32():
    odd = dataclasses.replace(PASCAL, tf32=True)
    p = select(odd)
    assert p.compute_dtype == F32 and p.tf32


# ---------------------------------------------------------------------- islands and loss scale

def test_islands_from_analysis_names_and_pairs():
    analysis = FakeAnalysis({BF16: ["lm_head", ("ln_f", "variance overflows")]})
    p = select(AMPERE, analysis=analysis)
    assert analysis.asked == [BF16]
    assert p.islands == ("lm_head", "ln_f")
    assert "variance overflows" in text(p)
    assert "islands=lm_head;ln_f" in str(p)


def test_islands_asked_for_the_chosen_dtype():
    analysis = FakeAnalysis({F16: ["softmax"], BF16: ["other"]})
    assert select(TURING, analysis=analysis).islands == ("softmax",)
    assert analysis.asked == [F16]


def test_no_islands_when_compute_is_fp32():
    analysis = FakeAnalysis({F32: ["x"]})
    p = select(PASCAL, analysis=analysis)
    assert p.islands == () and analysis.asked == []


def test_islands_missing_from_model_are_noted():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    analysis = FakeAnalysis({BF16: ["0", "lm_head"]})
    p = AdaptivePrecisionSelector().select(model, AMPERE, analysis=analysis)
    assert p.islands == ("0", "lm_head")
    assert "lm_head match no module" in text(p)


@pytest.mark.parametrize("grad_amax, scale", [
    (1.0, 2048.0),            # 1 * 2048 * 16 = 32768 <= 65504 < 65536
    (65504 / 16 / 1024, 1024.0),  # exactly on the bound
    (0.001, 2.0**21),
    (1e-12, 2.0**24),         # clamped above
    (1e6, 1.0),               # clamped below
])
def test_initial_loss_scale(grad_amax, scale):
    assert initial_loss_scale(grad_amax) == scale


def test_loss_scale_from_grad_amax():
    p = select(TURING, analysis=FakeAnalysis(grad_amax=0.5))
    assert p.loss_scale.init_scale == 4096.0
    assert "grad_amax=0.5" in text(p)
    assert select(AMPERE, analysis=FakeAnalysis(grad_amax=0.5)).loss_scale is None  # bf16 needs none


def test_unusable_grad_amax_falls_back():
    p = select(TURING, analysis=FakeAnalysis(grad_amax=float("nan")))
    assert p.loss_scale.init_scale == 65536.0 and "unusable" in text(p)


# ---------------------------------------------------------------------- overrides

def test_override_dict_wins_and_is_recorded():
    p = select(AMPERE, overrides={"compute_dtype": "fp16", "islands": ["head"], "tf32": False})
    assert (p.compute_dtype, p.islands, p.tf32) == (F16, ("head",), False)
    assert p.loss_scale is not None  # fp16 compute by override still gets scaling
    assert text(p).count("set by override") == 3


def test_override_string_and_loss_scale():
    p = select(TURING, overrides="compute=bf16, loss_scale=predictive:1024")
    assert p.compute_dtype == BF16
    assert p.loss_scale == LossScale(mode="predictive", init_scale=1024)
    p = select(TURING, overrides={"loss_scale": None})
    assert p.compute_dtype == F16 and p.loss_scale is None


def test_override_policy_object():
    forced = PrecisionPolicy(F32, F32)
    assert select(HOPPER, overrides=forced) == forced


def test_bad_override_names_the_field():
    with pytest.raises(ValueError, match="colour"):
        select(AMPERE, overrides={"colour": 1})
    with pytest.raises(ValueError, match="compute"):
        select(AMPERE, overrides={"compute": "int8"})


# ---------------------------------------------------------------------- string form

@pytest.mark.parametrize("alias, dtype", [
    ("float32", F32), ("f32", F32), ("fp32", F32), ("float16", F16), ("f16", F16), ("fp16", F16),
    ("half", F16), ("bfloat16", BF16), ("bf16", BF16), ("BF16", BF16), ("torch.float16", F16),
])
def test_dtype_aliases(alias, dtype):
    assert parse_dtype(alias) == dtype
    p = PrecisionPolicy.from_string(f"params=float32, compute = {alias}")
    assert p.compute_dtype == dtype
    assert PrecisionPolicy.from_string(str(p)) == p


def test_jmp_style_string():
    p = PrecisionPolicy(F32, F16, tf32=True, islands=("lm_head", "ln_f"), loss_scale=LossScale())
    assert str(p) == "params=float32,compute=float16,islands=lm_head;ln_f,tf32=1,loss_scale=dynamic:65536"
    assert PrecisionPolicy.from_string("p=f32,c=f16") == PrecisionPolicy(F32, F16)
    assert PrecisionPolicy.from_string("fp32") == PrecisionPolicy.from_string("float32") == PrecisionPolicy(F32, F32)
    assert PrecisionPolicy.from_string("params=bf16") == PrecisionPolicy(BF16, BF16)
    assert PrecisionPolicy.from_string("bf16-pure") == PrecisionPolicy(BF16, BF16)


def test_reasons_do_not_break_equality():
    p = select(TURING, analysis=FakeAnalysis({F16: ["a.b"]}, grad_amax=0.1))
    q = PrecisionPolicy.from_string(str(p))
    assert q == p and q.reasons == () and hash(q) == hash(p)


dtypes = st.sampled_from([F32, F16, BF16])
names = st.text(alphabet="abcxyz_.0123", min_size=1, max_size=8)
loss_scales = st.none() | st.builds(
    LossScale, mode=st.sampled_from(["dynamic", "predictive"]),
    init_scale=st.floats(min_value=1e-3, max_value=2.0**30),
    growth_interval=st.integers(1, 10**6), hysteresis=st.integers(1, 8),
    min_scale=st.none() | st.just(1.0), max_scale=st.none() | st.sampled_from([2.0**24, 1e9]))


@settings(max_examples=150, deadline=None)
@given(dtypes, dtypes, st.booleans(), st.lists(names, max_size=4), loss_scales)
def test_string_round_trip(param, compute, tf32, islands, loss_scale):
    p = PrecisionPolicy(param, compute, tf32, tuple(islands), loss_scale, reasons=("r",))
    assert PrecisionPolicy.from_string(str(p)) == p
    assert PrecisionPolicy.from_json(p.to_json()) == p
    assert PrecisionPolicy.from_json(p.to_json()).reasons == ("r",)


@pytest.mark.parametrize("bad, field", [
    ("params=float32,compute=f8", "compute"),
    ("params=int8", "params"),
    ("params=f32,colour=red", "colour"),
    ("params=f32,tf32=maybe", "tf32"),
    ("params=f32,loss_scale=static:8", "loss_scale"),
    ("params=f32,loss_scale=dynamic:lots", "init_scale"),
    ("params=f32,loss_scale=dynamic:8:speed=2", "loss_scale"),
    ("compute=f16", "params"),
    ("params=f32,params=f16", "params"),
    ("params=f32,compute", "compute"),
    ("f8", "params"),
    ("", "empty"),
    ("params=bf16,scope=some", "scope"),
    ("params=f32,compute=bf16,scope=matmul", "param_scope"),
])
def test_bad_strings_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        PrecisionPolicy.from_string(bad)


def test_bad_constructor_values():
    with pytest.raises(ValueError, match="islands"):
        PrecisionPolicy(F32, F16, islands=("a,b",))
    with pytest.raises(ValueError, match="hysteresis"):
        LossScale(hysteresis=0)
    with pytest.raises(ValueError, match="compute_dtype"):
        PrecisionPolicy(F32, torch.int8)


def test_loss_scale_feeds_grad_scaler():
    from adaptive_amp.scaler import GradScaler

    ls = LossScale(mode="predictive", init_scale=1024, growth_interval=100, hysteresis=2, max_scale=2.0**20)
    scaler = GradScaler("cpu", **ls.grad_scaler_kwargs())
    assert scaler.get_scale() == 1024.0


# ---------------------------------------------------------------------- capabilities and detection

@pytest.mark.parametrize("caps", [PASCAL, TURING, HOPPER, CPU_BF16,
                                  dataclasses.replace(CPU_PLAIN, throughput={"float32": 1.5})])
def test_capabilities_json_round_trip(caps):
    back = Capabilities.from_json(caps.to_json())
    assert back == caps
    assert isinstance(back.compute_capability, (tuple, type(None)))


def test_capabilities_str_is_readable():
    s = str(HOPPER)
    assert "H100" in s and "sm_90" in s and "fp8" in s and s.count("\n") >= 3
    assert "none beyond fp32" in str(CPU_PLAIN)


def test_capabilities_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="warp_size"):
        Capabilities.from_dict({"device_type": "cpu", "name": "x", "warp_size": 32})


def test_detect_this_cpu():
    caps = HardwareDetector().detect("cpu")
    assert caps.device_type == "cpu" and caps.name
    assert caps.compute_capability is None and caps.index is None
    assert caps.tf32 is False and caps.fp8 is False
    assert caps.multiprocessors >= 1 and caps.total_memory > 2**27
    assert caps.throughput == {}
    assert Capabilities.from_json(caps.to_json()) == caps
    assert select(caps).compute_dtype == (BF16 if caps.bf16 else F32)


def test_detect_cpu_bf16_flag_matches_cpuinfo():
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("checks the x86 flags")
    expected = "avx512_bf16" in flags or "amx_bf16" in flags
    assert HardwareDetector().detect("cpu").bf16 is expected


def test_detect_measure_on_cpu():
    caps = HardwareDetector().detect("cpu", measure=True)
    assert set(caps.throughput) == {"float32", "float16", "bfloat16"}
    assert all(v > 0 for v in caps.throughput.values())
    assert "TFLOP/s" in str(caps)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when there is no CUDA")
def test_detect_cuda_without_cuda_raises_clearly():
    with pytest.raises(RuntimeError, match="no usable CUDA device"):
        HardwareDetector().detect(torch.device("cuda"))


def test_detect_rejects_other_devices():
    with pytest.raises(ValueError, match="meta"):
        HardwareDetector().detect("meta")


@pytest.mark.cuda
@requires_cuda
def test_detect_real_gpu():
    caps = HardwareDetector().detect("cuda")
    sm = caps.compute_capability
    assert caps.device_type == "cuda" and caps.multiprocessors > 0 and caps.total_memory > 0
    if not torch.version.hip:
        assert caps.fp16 == (sm >= (7, 0)) and caps.bf16 == (sm >= (8, 0)) and caps.fp8 == (sm >= (8, 9))
    assert HardwareDetector().detect().device_type == "cuda"


@pytest.mark.parametrize("name", ["bf16-pure", "pure-bf16", " BF16-Pure "])
def test_bf16_pure_preset(name):
    p = PrecisionPolicy.from_string(name)
    assert p.param_dtype == torch.bfloat16 and p.compute_dtype == torch.bfloat16 and p.loss_scale is None
    assert p.param_scope == "all" and p.pure
    assert PrecisionPolicy.from_string(str(p)) == p


def test_bf16_weights_preset_and_its_forms():
    p = PrecisionPolicy.from_string("bf16-weights")
    assert (p.param_dtype, p.compute_dtype, p.param_scope, p.loss_scale) == (BF16, BF16, "matmul", None)
    assert not p.pure and str(p) == "params=bfloat16,compute=bfloat16,scope=matmul"
    assert PrecisionPolicy.from_string(str(p)) == p == PrecisionPolicy.from_dict(p.to_dict())
    assert PrecisionPolicy.from_json(p.to_json()) == p != PrecisionPolicy.from_string("bf16-pure")
    assert PrecisionPolicy(BF16, BF16, param_scope="matmul") == p  # the earlier fields keep their positions
    with pytest.raises(ValueError, match="param_scope is 'weights'"):
        PrecisionPolicy(BF16, BF16, param_scope="weights")
    with pytest.raises(ValueError, match="param_scope='matmul'.*float32"):
        PrecisionPolicy(F32, BF16, param_scope="matmul")
    chosen = AdaptivePrecisionSelector().select(None, Capabilities(device_type="cpu", name="cpu", bf16=True),
                                                overrides={"param_dtype": "bf16", "compute_dtype": "bf16",
                                                           "param_scope": "matmul"})
    assert chosen == p and "scope=matmul: set by override" in chosen.reasons


def test_float16_compute_without_a_loss_scale_gets_dynamic_scaling_and_says_so():
    p = PrecisionPolicy.from_string("params=float32,compute=float16")
    assert p.loss_scale == LossScale()  # torch's defaults
    assert any("dynamic loss scaling is on by default" in r and "loss_scale=none" in r for r in p.reasons)
    assert PrecisionPolicy(F32, F16).loss_scale == LossScale()
    off = PrecisionPolicy.from_string("params=float32,compute=float16,loss_scale=none")
    assert off.loss_scale is None and not off.reasons
    # The string form says "none", so that it reads back without scaling.
    assert str(off) == "params=float32,compute=float16,loss_scale=none"
    assert PrecisionPolicy.from_string(str(off)) == off and PrecisionPolicy.from_dict(off.to_dict()) == off
    assert PrecisionPolicy.from_string("params=float32,compute=bfloat16").loss_scale is None
    assert PrecisionPolicy(F32, BF16).replace(compute_dtype=F16).loss_scale is None  # replace keeps "none"


@pytest.mark.parametrize("setting, match", [
    ("min_scale=-1", "min_scale must be >= 0"),
    ("min_scale=nan", "min_scale must be a finite number"),
    ("min_scale=inf", "min_scale must be a finite number"),
    ("max_scale=inf", "max_scale must be a finite number"),
    ("max_scale=1e39", "max_scale must be a finite number"),
    ("growth_interval=2.5", "growth_interval must be a whole number, got '2.5'"),
    ("growth_interval=inf", "growth_interval must be a whole number"),
    ("hysteresis=nan", "hysteresis must be a whole number"),
    ("min_scale=1:min_scale=2", "min_scale given twice"),
])
def test_a_loss_scale_setting_grad_scaler_would_refuse_is_refused_in_the_policy_string(setting, match):
    with pytest.raises(ValueError, match=match):
        PrecisionPolicy.from_string(f"params=float32,compute=float16,loss_scale=dynamic:65536:{setting}")


@pytest.mark.parametrize("kw", [dict(min_scale=float("nan")), dict(max_scale=float("inf")), dict(min_scale=-1.0),
                                dict(growth_interval=2.5), dict(growth_interval=float("inf")), dict(hysteresis=True)])
def test_loss_scale_refuses_what_grad_scaler_refuses(kw):
    with pytest.raises(ValueError, match="loss_scale: " + next(iter(kw))):
        LossScale(**kw)


def test_loss_scale_string_is_case_insensitive_like_the_rest_of_the_policy():
    p = PrecisionPolicy.from_string("Params=FP32,compute=fp16,loss_scale=Dynamic:1024:Min_Scale=1")
    assert p.loss_scale == LossScale(init_scale=1024, min_scale=1.0)
