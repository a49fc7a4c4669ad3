"""FP8 per layer (adaptive_amp.fp8): eligibility and refusals, execution through torchao's float8 matmul (on
the CPU torch._scaled_mm runs too, so parity with torchao's Float8Linear is checked here), measured selection,
and the run-time guard on synthetic statistics."""

from __future__ import annotations

import copy
import functools
import logging
import math
import re
import time

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("torchao")
logging.getLogger("torchao").setLevel(logging.ERROR)

from adaptive_amp import fp8  # noqa: E402
from adaptive_amp.detectors import LayerStats, SeriesView  # noqa: E402
from adaptive_amp.fp8 import eligibility  # noqa: E402

from conftest import quiet_torchao, requires_cuda  # noqa: E402


def _conv1d(n_in, n_out, like: nn.Linear = None):
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(n_out, n_in)
    if like is not None:
        with torch.no_grad():
            layer.weight.copy_(like.weight.t())
            layer.bias.copy_(like.bias)
    return layer


def _float8_linear(linear: nn.Linear, kind: str):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear.from_float(copy.deepcopy(linear), config=Float8LinearConfig.from_recipe_name(fp8.RECIPES[kind]))


# ---------------------------------------------------------------------------- eligibility


def test_layers_fp8_can_take_and_why_not_the_others():
    pytest.importorskip("transformers")
    assert fp8.layer_unsupported(nn.Linear(64, 48)) is None
    assert fp8.layer_unsupported(_conv1d(64, 48)) is None
    assert fp8.matmul_sizes(_conv1d(64, 48)) == (64, 48)  # weight stored (in, out)
    assert fp8.layer_unsupported(nn.Linear(64, 50257)) == "out_features 50257 not divisible by 16"
    assert fp8.layer_unsupported(_conv1d(40, 48)) == "in_features 40 not divisible by 16"
    assert "not an nn.Linear" in fp8.layer_unsupported(nn.LayerNorm(64))
    assert "float32, bfloat16 or float16" in fp8.layer_unsupported(nn.Linear(64, 48).double())


def test_every_layer_skipped_with_the_reason_where_fp8_cannot_run():
    from adaptive_amp import zoo

    zm = zoo.build("gpt2", "tiny", seed=0)
    found = fp8.eligible_layers(zm.model, "cpu")
    assert not found.layers and len(found.skipped) == 9
    assert all("compute capability 8.9" in why and "CPU" in why for why in found.skipped.values())
    found = fp8.eligible_layers(zm.model, check_device=False)
    assert len(found.layers) == 9 and not found.skipped


def test_require_fp8_names_the_reason_and_changes_nothing(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 50))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="fp8-tensorwise cannot run here: fp8 matmuls need a CUDA GPU"):
        fp8.require_fp8(model)
    monkeypatch.setattr(eligibility.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"torchao is not installed \(pip install 'torchao>="):
        fp8.require_fp8(model)
    monkeypatch.undo()
    monkeypatch.setattr(eligibility, "device_unsupported", lambda device=None: None)  # as on an H100
    assert list(fp8.require_fp8(model, ["0"], kind="fp8-rowwise")) == ["0"]
    with pytest.raises(ValueError, match="layer '2' cannot run in fp8-tensorwise: out_features 50 not divisible by 16"):
        fp8.require_fp8(model)
    with pytest.raises(ValueError, match="layer '1' cannot run in fp8-tensorwise: a ReLU"):
        fp8.require_fp8(model, ["0", "1"])
    with pytest.raises(ValueError, match="names: the model has no module named 'mlp'"):
        fp8.require_fp8(model, ["mlp"])
    with pytest.raises(ValueError, match="kind is 'fp8'; the fp8 kinds are fp8-tensorwise, fp8-rowwise"):
        fp8.require_fp8(model, kind="fp8")
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_device_refusals_name_the_gpu_and_its_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.version, "hip", None)
    assert fp8.device_unsupported("cuda") == ("NVIDIA A100 has compute capability 8.0; fp8 matmuls need 8.9 or newer "
                                              "(Ada, Hopper, Blackwell)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.device_unsupported("cuda") is None


# ---------------------------------------------------------------------------- execution


@pytest.mark.parametrize("kind", fp8.KINDS)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_fp8_forward_is_torchaos_float8_linear_bitwise_for_linear_and_conv1d(kind, autocast):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    reference = _float8_linear(linear, kind)
    conv = _conv1d(64, 48, like=linear)
    weight, bias = linear.weight, linear.bias
    x = torch.randn(4, 8, 64)
    grad = torch.randn(4, 8, 48)
    outs = []
    for layer, run in ((linear, lambda t: fp8.fp8_forward(linear, t, kind)),
                       (conv, lambda t: fp8.fp8_forward(conv, t, kind)),
                       # torchao's module follows CUDA autocast only: hand it what autocast gives the matmul
                       (reference, lambda t: reference(t.bfloat16() if autocast else t))):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = run(xi)
        y.backward(grad.to(y.dtype))
        grad_w = layer.weight.grad.t() if layer is conv else layer.weight.grad
        outs.append((y, xi.grad, grad_w, layer.bias.grad))
    assert outs[0][0].dtype == (torch.bfloat16 if autocast else torch.float32)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)
    # The module is not swapped: the same Parameter objects, in their dtype, gradients where the optimizer looks.
    assert linear.weight is weight and linear.bias is bias and weight.dtype == torch.float32
    assert type(linear) is nn.Linear and set(linear.state_dict()) == {"weight", "bias"}
    # fp8 is not bf16: the results differ from the plain layer's, within fp8's rounding.
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        plain = linear(x)
    rel = float((outs[0][0].detach().float() - plain.detach().float()).norm() / plain.detach().float().norm())
    assert 1e-3 < rel < 0.1


def test_fp8_forward_compiles_without_a_graph_break():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(4, 8, 64)
    eager = fp8.fp8_forward(linear, x, "fp8-rowwise")
    compiled = torch.compile(lambda t: fp8.fp8_forward(linear, t, "fp8-rowwise"), backend="aot_eager", fullgraph=True)
    xc = x.clone().requires_grad_(True)
    out = compiled(xc)
    out.sum().backward()
    assert torch.equal(out, eager) and xc.grad is not None and linear.weight.grad is not None


@pytest.mark.parametrize("make", ["linear", "conv1d"])
def test_fp8_layer_graphs_do_not_depend_on_the_imported_modules(monkeypatch, make):
    # Every fp8 layer's forward asks whether it is a Conv1D inside the traced graph. Asked through sys.modules,
    # the graph would be guarded on it: importing transformers would recompile, and a thread importing a module
    # while dynamo reads sys.modules fails the compile ("dictionary changed size during iteration").
    import sys
    import types

    pytest.importorskip("transformers")
    torch.manual_seed(0)
    layer = nn.Linear(64, 48) if make == "linear" else _conv1d(64, 48)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(lambda t: fp8.fp8_forward(layer, t, "fp8-tensorwise") + fp8.plain_forward(layer, t),
                             backend=backend, fullgraph=True)
    x = torch.randn(4, 64)
    compiled(x)
    monkeypatch.setitem(sys.modules, "transformers.pytorch_utils", types.ModuleType("transformers.pytorch_utils"))
    monkeypatch.setitem(sys.modules, "an_unrelated_module", types.ModuleType("an_unrelated_module"))
    out = compiled(x)
    assert len(graphs) == 1
    assert torch.equal(out, fp8.fp8_forward(layer, x, "fp8-tensorwise") + fp8.plain_forward(layer, x))
    assert eligibility.is_conv1d(layer) is (make == "conv1d")


def test_wrap_forward_is_a_kind_for_the_per_layer_mechanism():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(5, 64)
    forward = fp8.wrap_forward(nn.Linear.forward, kind="fp8-tensorwise")
    assert torch.equal(forward(linear, x), fp8.fp8_forward(linear, x, "fp8-tensorwise"))
    with pytest.raises(ValueError, match="the fp8 kinds are"):
        fp8.wrap_forward(nn.Linear.forward, kind="fp8-blockwise")
    with pytest.raises(ValueError, match="module: cannot run in fp8-rowwise: in_features 63 not divisible by 16"):
        fp8.check_layer(nn.Linear(63, 32), "fp8-rowwise")


def test_fp8_kinds_plug_into_the_per_layer_precision_mechanism():
    layer_precision = pytest.importorskip("adaptive_amp.layer_precision")
    import functools

    from adaptive_amp import zoo

    for kind in fp8.KINDS:
        layer_precision.register_kind(kind, functools.partial(fp8.wrap_forward, kind=kind))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(4, 64)
    plain = model(x)
    params = list(model.parameters())
    handle = layer_precision.apply_kind(model[0], "fp8-rowwise")
    out = model(x)
    assert torch.equal(out, model[2](model[1](fp8.fp8_forward(model[0], x, "fp8-rowwise"))))
    assert not torch.equal(out, plain) and list(model.parameters()) == params
    handle.remove()
    assert torch.equal(model(x), plain)

    # GPT-2's Conv1D layers, eager and compiled, under bf16 autocast; a copy is the plain model.
    zm = zoo.build("gpt2", "tiny", seed=0)
    batch = zm.make_batch(2, seed=1)
    handles = [layer_precision.apply_kind(m, "fp8-tensorwise") for m in zm.model.modules() if fp8.matmul_sizes(m)]
    assert len(handles) == 9
    with torch.autocast("cpu", torch.bfloat16):
        eager = zm.loss(zm.model, batch)
        compiled = zm.loss(torch.compile(zm.model, backend="aot_eager"), batch)
    eager.backward()
    assert torch.equal(eager.detach(), compiled.detach())
    assert all(p.grad is not None and p.dtype == torch.float32 for p in zm.model.parameters())
    copied = copy.deepcopy(zm.model)
    assert type(copied.transformer.h[0].attn.c_attn).forward is not type(zm.model.transformer.h[0].attn.c_attn).forward
    for h in handles:
        h.remove()
    assert torch.equal(zm.loss(zm.model, batch), zm.loss(copied, batch))


# ---------------------------------------------------------------------------- measurement and selection


def test_capture_inputs_sees_each_layer_and_leaves_no_hook():
    from adaptive_amp import zoo

    zm = zoo.build("gpt2", "tiny", seed=0)
    layers = fp8.eligible_layers(zm.model, check_device=False).layers
    batches = [zm.make_batch(2, seed=i) for i in range(2)]
    seen = fp8.capture_inputs(zm.model, layers, batches)
    assert set(seen.inputs) == set(layers) and all(len(v) == 2 for v in seen.inputs.values())
    hidden, seq = zm.model.config.n_embd, zm.seq_len
    assert seen.inputs["transformer.h.0.mlp.c_proj"][0].shape == (2, seq, 4 * hidden)
    assert not any(m._forward_pre_hooks for m in zm.model.modules())
    few = fp8.capture_inputs(zm.model, layers, batches, max_tokens=5)
    assert [x.shape for x in few.inputs["lm_head"]] == [(5, hidden)] and few.shapes["lm_head"] == [(2, seq, hidden)]
    # At most max_tokens rows a layer over all batches: the second batch adds what the first left room for.
    rows = 2 * seq + 3
    some = fp8.capture_inputs(zm.model, layers, batches * 3, max_tokens=rows)
    assert [x.shape for x in some.inputs["lm_head"]] == [(2 * seq, hidden), (3, hidden)]
    assert torch.equal(some.inputs["lm_head"][0], seen.inputs["lm_head"][0].reshape(-1, hidden))
    assert torch.equal(some.inputs["lm_head"][1], seen.inputs["lm_head"][1].reshape(-1, hidden)[:3])
    # Every layer full after two batches: the four after them, shaped as those, are not run.
    assert len(some.shapes["lm_head"]) == 2
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        fp8.capture_inputs(zm.model, layers, batches, max_tokens=0)


def test_capture_inputs_runs_a_batch_shaped_as_one_run_before_only_while_a_layer_has_room():
    from adaptive_amp import zoo

    zm = zoo.build("gpt2", "tiny", seed=0)
    layers = fp8.eligible_layers(zm.model, check_device=False).layers
    ran = []

    def run(model, batch):
        ran.append(batch["input_ids"].shape)
        return model(**batch)
    alike = [zm.make_batch(2, seed=i) for i in range(3)]
    seq = zm.seq_len
    fp8.capture_inputs(zm.model, layers, alike, run, max_tokens=2 * seq)  # full after the first
    assert ran == [(2, seq)]
    ran.clear()
    fp8.capture_inputs(zm.model, layers, alike, run, max_tokens=2 * seq + 1)  # the second has room to fill
    assert ran == [(2, seq)] * 2
    ran.clear()
    fp8.capture_inputs(zm.model, layers, alike, run)  # without max_tokens every input is kept
    assert len(ran) == 3
    ran.clear()
    longer = zm.make_batch(2, seed=3, seq_len=seq // 2)
    seen = fp8.capture_inputs(zm.model, layers, alike[:1] + [longer] + alike[1:], run, max_tokens=1)
    assert ran == [(2, seq), (2, seq // 2)]  # another shape is run: its layers' shapes may be the largest
    assert seen.shapes["lm_head"] == [(2, seq, zm.model.config.n_embd), (2, seq // 2, zm.model.config.n_embd)]
    ran.clear()
    # What the signature cannot read (here an object), or a layer the batches have not called yet: run.
    opaque = [dict(b, extra=object()) for b in alike]
    fp8.capture_inputs(zm.model, layers, opaque, lambda m, b: run(m, {k: v for k, v in b.items() if k != "extra"}),
                       max_tokens=1)
    assert len(ran) == 3
    ran.clear()
    with pytest.MonkeyPatch.context() as mp:  # under torch.distributed (a forward may be collective): all run
        from adaptive_amp.fp8 import measure

        mp.setattr(measure, "world_group", lambda: object())
        fp8.capture_inputs(zm.model, layers, alike, run, max_tokens=1)
    assert len(ran) == 3
    ran.clear()
    first = {n: m for n, m in layers.items() if n == "lm_head"}
    calls = iter([False, True, True])

    def sometimes(model, batch):
        ran.append(None)
        if next(calls):
            model(**batch)
    fp8.capture_inputs(zm.model, first, alike, sometimes, max_tokens=1)
    assert len(ran) == 2  # the head was not called by the first batch, so the second ran; the third was spared


def test_captured_inputs_are_shared_by_layers_reading_one_tensor_and_kept_in_the_measured_dtype():
    from adaptive_amp import zoo

    quiet_torchao()
    zm = zoo.build("llama", "tiny", seed=0)  # float32
    layers = fp8.eligible_layers(zm.model, check_device=False).layers
    batches = [zm.make_batch(2, seed=i) for i in range(2)]
    rows = zm.seq_len * 2 + 16  # the whole first batch, and 16 rows of the second
    wide = fp8.capture_inputs(zm.model, layers, batches, max_tokens=rows)
    kept = fp8.capture_inputs(zm.model, layers, batches, max_tokens=rows, dtype=torch.bfloat16)
    attn = "model.layers.0.self_attn."
    for k in range(2):  # the query, key and value projections read one tensor: one copy for the three
        assert kept.inputs[attn + "q_proj"][k] is kept.inputs[attn + "k_proj"][k] is kept.inputs[attn + "v_proj"][k]
        assert kept.inputs[attn + "q_proj"][k] is not kept.inputs[attn + "o_proj"][k]
    assert all(x.dtype == torch.bfloat16 for xs in kept.inputs.values() for x in xs)
    # Which layers read one tensor, with or without a bound on the rows kept.
    mlp = "model.layers.0.mlp."
    expected = {attn + "k_proj": attn + "q_proj", attn + "v_proj": attn + "q_proj", mlp + "up_proj": mlp + "gate_proj"}
    assert {k: v for k, v in kept.shared.items() if k.startswith("model.layers.0.")} == expected
    assert fp8.capture_inputs(zm.model, layers, batches[:1]).shared == kept.shared == wide.shared
    assert all(torch.equal(a.to(torch.bfloat16), b) for name in wide.inputs
               for a, b in zip(wide.inputs[name], kept.inputs[name]))
    # A tensor written in place between two layers is copied again.
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)

    def run(model, x):
        first(x)
        x.mul_(10)
        second(x)
    seen = fp8.capture_inputs(nn.Sequential(first, second), {"0": first, "1": second}, [torch.ones(2, 8)], run,
                              max_tokens=4)
    assert torch.equal(seen.inputs["0"][0], torch.ones(2, 8)) and torch.equal(seen.inputs["1"][0], torch.ones(2, 8) * 10)
    assert seen.shared == {}
    # Two layers reading one tensor, the second with more room left: it gets the rows the first had no room for.
    x = torch.arange(32.0).reshape(4, 8)
    calls = iter([["0"], ["0", "1"]])
    both = fp8.capture_inputs(nn.Sequential(first, second), {"0": first, "1": second}, [x, x],
                              lambda m, b: [m[int(n)](b) for n in next(calls)], max_tokens=6)
    assert [t.shape[0] for t in both.inputs["0"]] == [4, 2] and [t.shape[0] for t in both.inputs["1"]] == [4]
    assert torch.equal(both.inputs["1"][0], x)
    assert both.shared == {"1": "0"}  # (not "0" with itself: the second batch is the first one again)
    with torch.inference_mode():  # (inference tensors have no version counter)
        frozen = torch.ones(2, 8)
    seen = fp8.capture_inputs(nn.Sequential(first, second), {"0": first, "1": second}, [frozen],
                              lambda m, b: (m[0](b), m[1](b)))
    assert seen.shared == {"1": "0"} and torch.equal(seen.inputs["1"][0], frozen)
    # What autocast's matmul reads anyway: the measured error is the same.
    layer = layers[attn + "q_proj"]
    assert fp8.layer_error(layer, wide.inputs[attn + "q_proj"]) == fp8.layer_error(layer, kept.inputs[attn + "q_proj"])


def test_layer_error_is_fp8s_rounding_and_leaves_the_parameters_gradients_alone():
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    x = torch.randn(128, 64)
    err = fp8.layer_error(layer, [x], "fp8-tensorwise")
    assert 0.01 < err.output < 0.1 and 0.01 < err.grad_input < 0.1 and err.output_cosine > 0.99
    assert layer.weight.grad is None and layer.bias.grad is None  # measured through autograd.grad
    rowwise = fp8.layer_error(layer, [x[:64], x[64:]], "fp8-rowwise")  # e4m3 gradients: closer than e5m2's
    assert rowwise.grad_input < err.grad_input and rowwise.grad_weight_cosine > 0.99
    with pytest.raises(ValueError, match="inputs is empty"):
        fp8.layer_error(layer, [], "fp8-tensorwise")


def test_layer_gain_refuses_a_cpu_layer():
    with pytest.raises(ValueError, match="module is on cpu; layers are timed with CUDA events"):
        fp8.layer_gain(nn.Linear(64, 64), (8, 64))
    with pytest.raises(ValueError, match="nothing to time: kinds is empty and bf16=False"):
        fp8.layer_times(nn.Linear(64, 64), (8, 64), [], bf16=False)
    with pytest.raises(ValueError, match="kind is 'fp8'"):
        fp8.layer_times(nn.Linear(64, 64), (8, 64), ["fp8"])


def _tiny_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.GELU(), nn.Linear(64, 50))


def test_selection_puts_layers_that_gain_and_tolerate_fp8_in_it_each_with_its_reason():
    model = _tiny_mlp()
    batches = [torch.randn(32, 64) for _ in range(2)]
    gains = {(64, 256): {"fp8-tensorwise": 1.31, "fp8-rowwise": 1.12}, (256, 64): {"fp8-tensorwise": 0.92,
                                                                                   "fp8-rowwise": 0.8}}
    calls = []

    def gain_fn(layer, shape, kind):
        calls.append((layer.in_features, layer.out_features, shape, kind))
        return gains[(layer.in_features, layer.out_features)][kind]

    choices = fp8.select_fp8_layers(model, batches, gain_fn=gain_fn, max_tokens=16)
    assert list(choices) == ["0", "2", "4"]
    assert choices["0"].kind == "fp8-tensorwise"
    assert choices["0"].reason.startswith("gains 1.31x, error ") and choices["0"].reason.endswith("within 0.1")
    assert choices["2"].kind is None
    assert choices["2"].reason == "skipped: 256 x 64 on 32 tokens too small to gain (0.92x < 1.05x in fp8-tensorwise)"
    assert choices["4"].kind is None and choices["4"].reason == "skipped: out_features 50 not divisible by 16"
    # Tensorwise is tolerated by both: rowwise is neither measured nor timed.
    assert calls == [(64, 256, (32, 64), "fp8-tensorwise"), (256, 64, (32, 256), "fp8-tensorwise")]
    assert list(choices["0"].errors) == list(choices["0"].gains) == ["fp8-tensorwise"]
    # A tight error bound leaves the fast layer where it is, saying so, with no gain timed for it.
    calls.clear()
    strict = fp8.select_fp8_layers(model, batches, gain_fn=gain_fn, max_error=1e-3, kinds=["fp8-rowwise"])
    assert strict["0"].kind is None and strict["0"].reason.startswith("skipped: error ")
    assert strict["0"].reason.endswith("above 0.001 in fp8-rowwise") and not strict["0"].gains and not calls
    assert "fp8-rowwise" in strict["0"].errors and "fp8-tensorwise" not in strict["0"].errors
    assert str(choices["0"]).startswith("0: fp8-tensorwise (gains 1.31x")
    # Where the time went, and the map's reasons say it.
    spent = {}
    fp8.select_fp8_layers(model, batches, gain_fn=gain_fn, max_tokens=16, seconds=spent)
    assert set(spent) == {"inputs", "gains", "errors", "shapes", "inferred"} and spent["shapes"] == 2
    assert spent["inferred"] == 0  # (a gain_fn's gains are not inferred)
    assert all(spent[k] >= 0 for k in ("inputs", "gains", "errors")) and spent["errors"] > 0
    measured = fp8.measure_fp8_map(model, batches, gain_fn=gain_fn, max_tokens=16)
    assert re.fullmatch(r"fp8: 3 layers measured in [0-9.]+ s \(inputs [0-9.]+ s, 2 gains timed in [0-9.]+ s, "
                        r"errors [0-9.]+ s\)", measured.reasons[-1]), measured.reasons[-1]


def test_layers_reading_one_input_join_those_of_them_in_fp8_when_not_slower(monkeypatch):
    """A compiled block's query projection gains; its key and value projections (smaller) gain too little to pay
    on their own, and join it in fp8 when not slower (so that a compiled backward keeps their input once, not in
    bf16 and in fp8). Slower, eager (where torchao keeps the bf16 input anyway), erring too much, or where none of
    their input's layers gains, they stay."""
    from adaptive_amp import zoo
    from adaptive_amp.fp8 import select

    quiet_torchao()
    zm = zoo.build("llama", "tiny", seed=0)
    batches = [zm.make_batch(2, seed=0)]
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    n_q = zm.model.get_submodule(attn + "q_proj").out_features

    def select_with(kv_gain, **options):
        def gain_fn(layer, shape, kind):
            if layer.out_features == layer.in_features == n_q:  # the query and output projections
                return 1.2
            if layer.in_features == n_q and layer.out_features < n_q:  # key and value
                return kv_gain
            return 1.02 if layer.in_features == n_q else 1.0  # gate and up; down (and the head)
        return fp8.select_fp8_layers(zm.model, batches, run=zm.loss, gain_fn=gain_fn, **options)

    choices = select_with(1.02, compiled=True)
    for name in ("k_proj", "v_proj"):
        choice = choices[attn + name]
        assert choice.kind == "fp8-tensorwise", choice
        assert choice.reason.startswith("gains 1.02x, error ") and choice.reason.endswith(
            f"in fp8 with {attn}q_proj, which takes the same input, so that a compiled backward keeps it once")
    assert choices[attn + "o_proj"].kind == "fp8-tensorwise"
    # gate and up gain too little, and neither of their input's layers is in fp8: both stay
    assert choices[mlp + "gate_proj"].kind is choices[mlp + "up_proj"].kind is None
    even = select_with(0.98, compiled=True)  # (within the timing's spread of 1.0x: joins)
    assert even[attn + "k_proj"].kind == "fp8-tensorwise", even[attn + "k_proj"]
    slower = select_with(0.95, compiled=True)
    assert slower[attn + "k_proj"].kind is None and "too small to gain (0.95x < 1.05x" in slower[attn + "k_proj"].reason
    eager = select_with(1.02)
    assert eager[attn + "q_proj"].kind == "fp8-tensorwise" and eager[attn + "k_proj"].kind is None
    # a layer skipped for its error does not join, nor one that tolerates only a recipe its input's layers do not run
    real_error = select.layer_error

    def error(module, inputs, kind, **options):
        err = real_error(module, inputs, kind, **options)
        if module is zm.model.get_submodule(attn + "k_proj"):
            return fp8.LayerError(*(1.0 for _ in range(3)), *(0.0 for _ in range(3)))
        if module is zm.model.get_submodule(attn + "v_proj") and kind == "fp8-tensorwise":
            return fp8.LayerError(*(1.0 for _ in range(3)), *(0.0 for _ in range(3)))
        return err
    monkeypatch.setattr(select, "layer_error", error)
    erring = select_with(1.02, compiled=True)
    assert erring[attn + "q_proj"].kind == "fp8-tensorwise"
    assert erring[attn + "k_proj"].kind is None and erring[attn + "k_proj"].reason.startswith("skipped: error ")
    assert erring[attn + "v_proj"].kind is None and "fp8-rowwise" in erring[attn + "v_proj"].gains


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_layers_of_one_input_join_in_fp8_inside_blocks_compiled_in_place(family):
    """The zoo's blocks compiled in place, each gain timed as its layer runs (adaptive_amp.layers.compiled_layers):
    Llama's key and value projections join their query projection in fp8; GPT-2's fused Conv1D projections read
    no input together; the head beside the blocks runs eagerly and joins nothing."""
    from adaptive_amp import zoo
    from adaptive_amp.layers import compiled_layers
    from adaptive_amp.recipes import find_blocks

    quiet_torchao()
    torch._dynamo.reset()
    zm = zoo.build(family, "tiny", seed=0)
    for _, block in find_blocks(zm.model):
        block.compile(backend="aot_eager")
    n = zm.model.config.hidden_size
    big = {"gpt2": (n, 3 * n), "llama": (n, n)}[family]  # GPT-2's fused projection; Llama's query and output ones

    def gain_fn(layer, shape, kind):  # (those gain; every other layer too little)
        return 1.2 if eligibility.matmul_sizes(layer) == big else 1.02
    choices = fp8.select_fp8_layers(zm.model, [zm.make_batch(2, seed=0)], run=zm.loss, gain_fn=gain_fn,
                                    compiled=compiled_layers(zm.model))
    in_fp8 = sorted(n.split(".", 3)[-1] for n, c in choices.items() if c.kind is not None and ".0." in n)
    expected = {"gpt2": ["attn.c_attn"],
                "llama": ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]}
    assert in_fp8 == expected[family]
    head = next(c for n, c in choices.items() if n.endswith("lm_head"))
    assert head.kind is None and "timed eagerly" in head.reason
    torch._dynamo.reset()


def test_selection_tries_the_finer_recipe_only_where_the_coarser_errs_too_much():
    model = _tiny_mlp()
    # Rows of very different sizes: one scale per tensor rounds the small rows' gradients coarsely (e5m2 in the
    # tensorwise recipe), one per row does not.
    batches = [torch.randn(32, 64) * torch.logspace(-3, 0, 32).unsqueeze(1)]
    tensorwise = fp8.layer_error(model[0], batches, "fp8-tensorwise").worst
    rowwise = fp8.layer_error(model[0], batches, "fp8-rowwise").worst
    assert rowwise < tensorwise, (rowwise, tensorwise)
    calls = []

    def gain_fn(layer, shape, kind):
        calls.append((layer.in_features, kind))
        return 1.2

    bound = (rowwise + tensorwise) / 2
    choices = fp8.select_fp8_layers(model, batches, gain_fn=gain_fn, max_error=bound)
    assert choices["0"].kind == "fp8-rowwise", choices["0"]
    assert list(choices["0"].errors) == ["fp8-tensorwise", "fp8-rowwise"] and list(choices["0"].gains) == ["fp8-rowwise"]
    assert (64, "fp8-tensorwise") not in calls and (64, "fp8-rowwise") in calls
    # Preference is the order given: rowwise first is taken wherever it is tolerated.
    first = fp8.select_fp8_layers(model, batches, gain_fn=gain_fn, kinds=["fp8-rowwise", "fp8-tensorwise"])
    assert first["0"].kind == "fp8-rowwise" and list(first["0"].errors) == ["fp8-rowwise"]
    # Neither tolerated: the least error is named, nothing is timed.
    calls.clear()
    none = fp8.select_fp8_layers(model, batches, gain_fn=gain_fn, max_error=rowwise / 2)
    assert none["0"].kind is None and none["0"].reason.endswith(f"above {rowwise / 2:g} in fp8-rowwise"), none["0"]
    assert (64, "fp8-rowwise") not in calls


def test_selection_times_a_shapes_bf16_baseline_once(monkeypatch):
    from adaptive_amp.fp8 import select

    asked = []

    def fake_times(layer, shape, kinds, *, bf16=True, **options):
        asked.append((layer.in_features, tuple(kinds), bf16))
        return {**({"bf16": 3.0} if bf16 else {}), **{k: {"fp8-tensorwise": 2.0, "fp8-rowwise": 2.5}[k] for k in kinds}}

    # Two layers of one shape: the first tolerates tensorwise, the second only rowwise.
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    errors = {(0, "fp8-tensorwise"): 0.05, (0, "fp8-rowwise"): 0.03, (1, "fp8-tensorwise"): 0.2, (1, "fp8-rowwise"): 0.04}

    def fake_error(layer, inputs, kind, **options):
        e = errors[(0 if layer is model[0] else 1, kind)]
        return fp8.LayerError(e, e, e, 1.0, 1.0, 1.0)

    monkeypatch.setattr(select, "layer_times", fake_times)
    monkeypatch.setattr(select, "layer_error", fake_error)
    monkeypatch.setattr(select, "eligible_layers", lambda root, check_device: eligibility.eligible_layers(root, check_device=False))
    choices = select.select_fp8_layers(model, [torch.randn(32, 64)], run=lambda m, b: (m[0](b), m[1](b)))
    assert [c.kind for c in choices.values()] == ["fp8-tensorwise", "fp8-rowwise"]
    assert [c.gains for c in choices.values()] == [{"fp8-tensorwise": 1.5}, {"fp8-rowwise": 1.2}]
    assert asked == [(64, ("fp8-tensorwise",), True), (64, ("fp8-rowwise",), False)]
    # What each saves against bf16, and the map's sum over its fp8 layers (none known from a gain_fn).
    assert [c.saved_ms for c in choices.values()] == [1.0, 0.5]
    from adaptive_amp.fp8.training import measure_fp8_map

    run = lambda m, b: (m[0](b), m[1](b))  # noqa: E731
    assert measure_fp8_map(model, [torch.randn(32, 64)], run=run).saved_ms == 1.5
    assert measure_fp8_map(model, [torch.randn(32, 64)], run=run, min_gain=1.3).saved_ms == 1.0
    assert measure_fp8_map(model, [torch.randn(32, 64)], run=run, gain_fn=lambda *a: 1.5).saved_ms is None


class _ThreeMatmuls(nn.Module):
    """A 64 x 64, a 64 x 256 and a 256 x 64 layer, each called on 32 rows."""

    def __init__(self):
        super().__init__()
        self.small, self.wide, self.deep = nn.Linear(64, 64), nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.deep(self.wide(x)) + self.small(x)


@pytest.mark.parametrize("wide_gain, infer, timed", [(0.9, True, ["wide", "deep"]),
                                                     (0.9, False, ["small", "wide", "deep"]),
                                                     (1.0, True, ["wide", "deep", "small"])])
def test_a_shape_no_larger_than_one_that_gained_too_little_is_judged_from_it(monkeypatch, wide_gain, infer, timed):
    """The largest shapes are timed first; the 64 x 64 layer, no larger either way than the 64 x 256 one, is not
    timed where that one gained less than 0.97x (it could neither be chosen nor join a layer of its input), and
    its reason names the larger shape. The 256 x 64 one is larger one way, and is timed. infer_smaller=False
    times every shape, in module order; a gain at 1.0x (the sharing floor) leaves the smaller shape timed."""
    from adaptive_amp.fp8 import select

    model = _ThreeMatmuls()
    names = {(64, 64): "small", (64, 256): "wide", (256, 64): "deep"}
    gains = {"small": 0.5, "wide": wide_gain, "deep": 1.2}
    asked = []

    def fake_times(layer, shape, kinds, *, bf16=True, **options):
        name = names[(layer.in_features, layer.out_features)]
        asked.append(name)
        return {**({"bf16": 1.0} if bf16 else {}), **{k: 1.0 / gains[name] for k in kinds}}

    monkeypatch.setattr(select, "layer_times", fake_times)
    monkeypatch.setattr(select, "eligible_layers", lambda root, check_device: eligibility.eligible_layers(root, check_device=False))
    spent = {}
    choices = select.select_fp8_layers(model, [torch.randn(32, 64)], infer_smaller=infer, seconds=spent)
    assert asked == timed
    assert list(choices) == ["small", "wide", "deep"]  # (module order, whatever the timing's)
    assert choices["deep"].kind == "fp8-tensorwise" and choices["wide"].kind is None
    small = choices["small"]
    assert small.kind is None and spent["shapes"] == len(timed) and spent["inferred"] == 3 - len(timed)
    if "small" in timed:
        assert small.gains == {"fp8-tensorwise": 0.5} and "(0.50x < 1.05x in fp8-tensorwise)" in small.reason
    else:
        assert not small.gains and small.saved_ms is None and small.errors
        assert small.reason == ("skipped: 64 x 64 on 32 tokens too small to gain: 64 x 256 on 32 tokens, no smaller "
                                "either way, gained 0.90x in fp8-tensorwise")
    from adaptive_amp.fp8.training import measure_fp8_map

    reasons = measure_fp8_map(model, [torch.randn(32, 64)], infer_smaller=infer).reasons
    assert ("1 judged from a larger shape" in reasons[-1]) == ("small" not in timed), reasons[-1]


def test_selection_names_bad_arguments_and_layers_not_called():
    model = _tiny_mlp()
    batches = [torch.randn(32, 64)]
    unused = fp8.select_fp8_layers(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), batches,
                                   run=lambda m, b: m[0](b), gain_fn=lambda m, s, k: 2.0)
    assert unused["1"].reason == "skipped: not called by the sample batches"
    with pytest.raises(ValueError, match="kind is 'fp8-e5m2'"):
        fp8.select_fp8_layers(model, batches, kinds=["fp8-e5m2"], gain_fn=lambda m, s, k: 2.0)
    with pytest.raises(ValueError, match="min_gain and max_error must be > 0"):
        fp8.select_fp8_layers(model, batches, max_error=0, gain_fn=lambda m, s, k: 2.0)
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_selection_on_the_cpu_skips_every_layer_with_why():
    choices = fp8.select_fp8_layers(_tiny_mlp(), [torch.randn(8, 64)])
    assert {c.kind for c in choices.values()} == {None}
    assert all("need a CUDA GPU of compute capability 8.9" in c.reason for c in choices.values())


# ---------------------------------------------------------------------------- run-time guard


def test_cast_statistics_counts_underflow_and_saturation():
    x = torch.tensor([448.0, 1.0, 1e-4, 0.0])
    stats = fp8.cast_statistics(x)  # scale 1: 1e-4 is below e4m3's smallest subnormal (2**-9) by half
    assert stats == {"amax": 448.0, "underflow": 1 / 3, "saturated": 0.0}
    stale = fp8.cast_statistics(x, scale=torch.tensor(2.0))  # a scale from a smaller amax: 448 saturates
    assert stale["saturated"] == 0.25
    rows = torch.tensor([[448.0, 1e-4], [1e-3, 1e-4]])
    assert fp8.cast_statistics(rows, rowwise=True)["underflow"] == 0.25  # the second row has its own scale


def test_a_dynamic_scale_saturates_nothing():
    # amax * (448 / amax) rounds above 448 for many bf16 tensors: the cast rounds it to 448, nothing is lost
    for seed in range(20):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed)).bfloat16() * 3.3
        assert fp8.cast_statistics(x)["saturated"] == 0.0, seed
        assert fp8.cast_statistics(x, rowwise=True)["saturated"] == 0.0, seed


def test_a_layers_guard_row_from_its_input():
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    x = torch.randn(256, 64)
    row = fp8.fp8_layer_row("fc", layer, x)
    assert row["name"] == "fc" and row["underflow"] < 1e-3 and 0.01 < row["error"] < 0.1
    assert row["amax"] == float(x.abs().max())
    x[:, 5] *= 1e4  # an outlier channel: the others lose their codes in the one scale of the tensor
    bad = fp8.fp8_layer_row("fc", layer, x, "fp8-rowwise", error=False)
    assert bad["underflow"] > 0.01 and "error" not in bad  # rows share the outlier channel: scaling by row is no help
    assert fp8.Fp8Guard().observe(0, [bad])[0].kind == "fp8_demote"


def test_the_watch_keeps_a_copy_of_a_few_rows_not_the_whole_input():
    """A view of the input would hold all of it until the step ends: with checkpointed blocks, every block's
    activations at once."""
    from types import SimpleNamespace

    from adaptive_amp.fp8.training import _KEPT

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32))
    watch = fp8.Fp8Watch(max_rows=16)
    watch.sync(SimpleNamespace(layer_kinds={"0": "fp8-tensorwise", "2": "bf16"}, model=model))
    assert list(watch.kinds) == ["0"]
    x = torch.randn(4, 100, 64)
    model(x)
    assert _KEPT not in model[0].__dict__  # not armed: nothing kept
    watch.armed = watch.due = True
    model(x)
    kept = model[0].__dict__[_KEPT]
    assert kept.shape == (16, 64) and kept.untyped_storage().nbytes() == 16 * 64 * 4
    assert torch.equal(kept, x.reshape(-1, 64)[:16])
    watch.armed = False
    watch.drop()  # (a step that failed: what it captured goes, and there is nothing to read)
    assert _KEPT not in model[0].__dict__ and watch.read() is None
    watch.armed = watch.due = True
    model(x)
    watch.armed = False
    rows = watch.read()
    assert [r["name"] for r in rows] == ["0"] and _KEPT not in model[0].__dict__ and watch.read() is None
    watch.remove()
    assert not model[0]._forward_pre_hooks


def _reads(steps, growth, seed=0):
    """Synthetic statistics of one layer's input every 10 steps: `growth(step)` multiplies one channel."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(0, steps, 10):
        x = torch.randn(256, 64, generator=gen) * (1 + step / steps)  # the ordinary drift of training
        x[:, 5] *= growth(step)
        yield step, fp8.cast_statistics(x)


def test_guard_demotes_a_layer_growing_outlier_channels_and_leaves_an_ordinary_one():
    guard = fp8.Fp8Guard()
    events = []
    for step, stats in _reads(2000, lambda s: 1.0):
        events += guard.observe(step, [dict(stats, name="ordinary")])
    assert events == [] and guard.demoted == {}
    for step, stats in _reads(2000, lambda s: 10 ** (4 * s / 2000)):  # 1x -> 10^4x over 2000 steps
        events += guard.observe(step, [dict(stats, name="mlp.down_proj")])
    assert [e.kind for e in events] == ["fp8_demote"]
    demote = events[0]
    assert demote.layer == "mlp.down_proj" and demote.data["to"] == "bf16" and 800 < demote.step < 1800
    assert "underflows in the scaled e4m3 cast" in demote.message and "500 stable steps" in demote.message
    assert list(guard.demoted) == ["mlp.down_proj"]


def test_guard_brings_a_layer_back_after_a_stable_period_doubling_the_wait_at_each_failure():
    guard = fp8.Fp8Guard(stable_steps=100, min_history=3)
    ok = {"name": "l", "amax": 4.0, "underflow": 1e-5, "saturated": 0.0}
    bad = dict(ok, underflow=0.05)
    log = []

    def read(step, row):
        log.extend((e.step, e.kind, e.data.get("wait")) for e in guard.observe(step, [row]))

    read(0, ok)
    read(10, bad)  # demoted: wait 100
    read(60, ok)
    read(100, bad)  # still bad while in bf16: the stable period starts again
    read(150, ok)
    read(200, ok)  # 100 stable steps: back
    read(210, dict(ok, error=0.5))  # fails again: wait 200
    read(400, ok)
    read(410, ok)
    assert log == [(10, "fp8_demote", 100), (200, "fp8_restore", None), (210, "fp8_demote", 200),
                   (410, "fp8_restore", None)]
    state = guard.state_dict()
    again = fp8.Fp8Guard(stable_steps=100, min_history=3)
    again.load_state_dict(state)
    assert again.state_dict() == state and again._failures == {"l": 2}


def test_guard_amax_growth_after_warm_up_and_saturation_and_non_finite_inputs():
    guard = fp8.Fp8Guard(min_history=3)
    row = {"name": "l", "underflow": 0.0, "saturated": 0.0}
    events = []
    for step, amax in enumerate([4.0, 100.0, 4.0, 5.0, 4.0, 70.0]):  # 100 falls in the warm-up
        events += guard.observe(step, [dict(row, amax=amax)])
    assert [(e.step, e.kind) for e in events] == [(5, "fp8_demote")]
    assert "amax 70 is 18x the median of its last 5 reads" in events[0].message
    guard = fp8.Fp8Guard(min_history=3)
    events = guard.observe(0, [dict(row, amax=4.0, saturated=0.01), dict(row, name="m", amax=math.inf)])
    assert [e.layer for e in events] == ["l", "m"]
    assert "1.00% of its input saturates" in events[0].message and "not finite" in events[1].message
    with pytest.raises(ValueError, match="amax_growth must be > 1"):
        fp8.Fp8Guard(amax_growth=1.0)
    with pytest.raises(ValueError, match="min_history <= window"):
        fp8.Fp8Guard(min_history=30, window=20)


def test_guard_reads_fp8_layer_statistics_as_a_monitor_detector():
    guard = fp8.Fp8Guard()
    stats = [LayerStats(step=50, kind="fp8", fmt="float8_e4m3fn",
                        rows=[{"name": "a", "amax": 3.0, "underflow": 0.2, "saturated": 0.0}]),
             LayerStats(step=50, kind="activation", fmt=None, rows=[{"name": "a", "amax": 3.0}])]
    empty = np.zeros(1)
    view = SeriesView(steps=np.array([50]), known_loss=np.ones(1, bool), loss=empty, found=np.zeros(1, bool),
                      grad_norm=empty, scale=empty, first_new=0, layer_stats=stats)
    events = guard.detect(view)
    assert [(e.step, e.kind, e.layer) for e in events] == [(50, "fp8_demote", "a")]
    assert "20.00% of its input underflows" in str(events[0])


# ---------------------------------------------------------------------------- on a GPU


def _skip_without_fp8_gpu():
    why = fp8.fp8_unavailable("cuda")
    if why:
        pytest.skip(why)


@pytest.mark.cuda
@requires_cuda
def test_fp8_on_the_gpu_matches_torchao_compiled_and_gains_on_a_large_layer():
    _skip_without_fp8_gpu()
    torch.manual_seed(0)
    linear = nn.Linear(4096, 4096, bias=False, device="cuda")
    for kind in fp8.KINDS:
        torch._dynamo.reset()
        reference = _float8_linear(linear, kind)
        x = torch.randn(8, 1024, 4096, device="cuda")
        with torch.autocast("cuda", torch.bfloat16):
            ours = fp8.fp8_forward(linear, x, kind)
            theirs = reference(x)
            ours_compiled = torch.compile(functools.partial(fp8.fp8_forward, linear, kind=kind), fullgraph=True)(x)
            theirs_compiled = torch.compile(reference)(x)
        assert torch.equal(ours, theirs)
        # Compiled, against torchao's own module compiled the same way (inductor fuses the amax, scale and cast,
        # so compiled and eager outputs differ by an fp8 rounding here and there).
        error = (ours_compiled.float() - theirs_compiled.float()).norm() / theirs_compiled.float().norm()
        assert float(error) < 1e-2, (kind, float(error))
    assert fp8.require_fp8(linear) == {"": linear}
    gain = fp8.layer_gain(linear, (8192, 4096), "fp8-tensorwise", compiled=True)
    assert gain.bf16_ms > 0 and gain.fp8_ms > 0 and gain.gain > 1.0, gain  # H100/H200: about 1.25x
    ms = fp8.layer_times(linear, (8192, 4096), fp8.KINDS, bf16=False, compiled=True)
    assert set(ms) == set(fp8.KINDS) and all(v > 0 for v in ms.values()), ms


@pytest.mark.cuda
@requires_cuda
def test_layer_times_time_the_gpus_work_not_the_hosts():
    # A small layer's compiled call spends longer queuing (guards, autograd) than its kernels run: the events time
    # the kernels alone, so the median is well under what a call takes the host.
    _skip_without_fp8_gpu()
    layer = nn.Linear(256, 256, bias=False, device="cuda")
    ms = fp8.layer_times(layer, (64, 256), ["fp8-tensorwise"], compiled=True, iters=10)
    calls, x = 50, torch.randn(64, 256, device="cuda", requires_grad=True)
    run = torch.compile(lambda t: fp8.fp8_forward(layer, t), dynamic=False)
    for _ in range(3):
        torch.autograd.grad(run(x).sum(), x)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        torch.autograd.grad(run(x).sum(), x)
    torch.cuda.synchronize()
    host_ms = (time.perf_counter() - began) * 1e3 / calls
    assert ms["fp8-tensorwise"] < 0.5 * host_ms and ms["bf16"] < 0.5 * host_ms, (ms, host_ms)


@pytest.mark.cuda
@requires_cuda
def test_layers_are_timed_compiled_for_their_own_shapes(monkeypatch):
    # After a first shape dynamo would make the next one's sizes symbolic: each layer's graph is compiled static,
    # as a compiled model's is.
    _skip_without_fp8_gpu()
    asked = []
    compile_ = torch.compile

    def recording(fn, **kwargs):
        asked.append(kwargs.get("dynamic"))
        return compile_(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", recording)
    for out_features in (512, 256):
        fp8.layer_times(nn.Linear(512, out_features, bias=False, device="cuda"), (64, 512), compiled=True,
                        warmup=1, iters=1)
    assert asked == [False] * 4, asked


@pytest.mark.cuda
@requires_cuda
def test_selection_on_the_gpu_times_each_shape_once_and_skips_small_layers():
    _skip_without_fp8_gpu()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 14336, bias=False), nn.SiLU(), nn.Linear(14336, 4096, bias=False),
                          nn.Linear(4096, 64, bias=False)).cuda()
    batches = [torch.randn(8192, 4096, device="cuda")]
    choices = fp8.select_fp8_layers(model, batches, compiled=True)
    assert choices["0"].kind is not None, choices["0"]
    assert choices["3"].kind is None and "too small to gain" in choices["3"].reason, choices["3"]
    for c in choices.values():
        print(c)
