"""Layers found by what they do (modules that own weights), on every zoo model: the analyzer, the islands,
the controller's statistics and the report all see the same layers; include/exclude by name or type."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from adaptive_amp import zoo  # noqa: E402
from adaptive_amp.adjust import DynamicPrecisionAdjuster  # noqa: E402
from adaptive_amp.analysis import PrecisionAnalyzer  # noqa: E402
from adaptive_amp.controller import AdaptiveMixedPrecision  # noqa: E402
from adaptive_amp.hardware import Capabilities  # noqa: E402
from adaptive_amp.layers import canonical_name, find_layers, unwrap_model  # noqa: E402
from adaptive_amp.policy import AdaptivePrecisionSelector, PrecisionPolicy  # noqa: E402

FAMILIES = list(zoo.FAMILIES)
CPU_BF16 = Capabilities(device_type="cpu", name="test cpu with bf16", bf16=True, fp16=True)


@pytest.fixture(scope="module", params=FAMILIES)
def zm(request):
    return zoo.build(request.param, "tiny", seed=0)


def test_every_parameter_belongs_to_a_layer(zm):
    layers = find_layers(zm.model)
    owned = {id(p) for _, m in layers for p in m.parameters(recurse=False)}
    missing = [n for n, p in zm.model.named_parameters() if id(p) not in owned]
    assert not missing, missing  # no weight is invisible to the analyzer, the monitor or the islands
    assert all(n for n, _ in layers)  # the root is never a layer


def test_layers_of_each_family_are_found_whatever_their_class():
    from transformers.pytorch_utils import Conv1D

    kinds = {f: {type(m).__name__ for _, m in find_layers(zoo.build(f).model)} for f in FAMILIES}
    assert {"Conv1D", "LayerNorm", "Embedding", "Linear"} <= kinds["gpt2"]
    assert {"Linear", "LlamaRMSNorm", "Embedding"} <= kinds["llama"]
    assert {"Linear", "LayerNorm", "Embedding"} <= kinds["bert"]
    assert {"Linear", "T5LayerNorm", "Embedding"} <= kinds["t5"]
    assert {"Linear", "LayerNorm", "Conv2d", "ViTEmbeddings"} <= kinds["vit"]  # ViTEmbeddings owns cls_token
    assert {"Conv2d", "BatchNorm2d", "Linear"} <= kinds["resnet"]
    gpt2 = zoo.build("gpt2").model
    names = [n for n, _ in find_layers(gpt2)]
    assert "transformer.h.1.mlp.c_fc" in names and isinstance(gpt2.transformer.h[1].mlp.c_fc, Conv1D)
    assert "transformer.h.1.mlp" not in names  # a container is not a layer; its layers are


class Wrapped(nn.Module):
    """A user's own weight-owning layer (no standard class) inside a container."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        return x @ self.weight


def test_custom_layers_and_include_exclude():
    model = nn.Sequential(Wrapped(8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))
    assert [n for n, _ in find_layers(model)] == ["0", "2.0", "2.1"]
    assert [n for n, _ in find_layers(model, include=nn.Linear)] == ["2.0"]
    assert [n for n, _ in find_layers(model, include=["2.*", Wrapped])] == ["0", "2.0", "2.1"]
    assert [n for n, _ in find_layers(model, include="1")] == ["1"]  # a module without weights, on request
    assert [n for n, _ in find_layers(model, exclude=nn.LayerNorm)] == ["0", "2.0"]
    assert [n for n, _ in find_layers(model, exclude="2.*")] == ["0"]
    with pytest.raises(TypeError, match=r"include\[1\] is 3; pass a module name pattern"):
        find_layers(model, include=["0", 3])
    with pytest.raises(TypeError, match=r"exclude\[0\] is <class 'int'>"):
        PrecisionAnalyzer(exclude=int)


def test_analysis_table_has_every_layer(zm):
    batch = zm.make_batch(2, seed=1)
    analysis = PrecisionAnalyzer(candidates=("bfloat16",), progress=False).analyze(
        zm.model, zm.inputs(batch), loss_fn=zm.output_loss(batch))
    layers = [n for n, _ in find_layers(zm.model)]
    analyzed = {r.name for r in analysis.results}
    assert analyzed | set(analysis.skipped) == set(layers)
    assert len(analyzed) >= 0.9 * len(layers), analysis.skipped  # skipped: only layers the forward never calls
    table = analysis.table()
    assert all(name in table for name in analyzed)
    assert all(r.grad_underflow_fraction is not None for r in analysis.results)
    # The report sees the same layers.
    amp = AdaptiveMixedPrecision(zm.model, torch.optim.SGD(zm.model.parameters(), lr=0.0), policy="auto",
                                 sample_inputs=zm.inputs(batch), capabilities=CPU_BF16, progress=False,
                                 overrides={"compute_dtype": "bfloat16"})
    assert {r["name"] for r in amp.report(plots=False).sensitive_layers(limit=None)} >= analyzed
    amp.remove()


def test_every_layer_can_become_an_island(zm):
    """With every layer an island, every layer computes in fp32 under bf16 autocast; without, some do not."""
    layers = [n for n, _ in find_layers(zm.model)]
    modules = dict(zm.model.named_modules())
    batch = zm.make_batch(2, seed=1)

    def output_dtypes(policy):
        adj = DynamicPrecisionAdjuster(zm.model, policy)
        seen = {}

        def record(name):
            def hook(module, args, out):
                seen.setdefault(name, (out if isinstance(out, torch.Tensor) else out[0]).dtype)
            return hook

        handles = [modules[n].register_forward_hook(record(n)) for n in layers]
        try:
            with adj.autocast():
                zm.loss(zm.model, batch).backward()
        finally:
            for h in handles:
                h.remove()
            adj.remove()
        zm.model.zero_grad()
        return seen

    plain = output_dtypes(PrecisionPolicy(compute_dtype="bfloat16"))
    assert torch.bfloat16 in plain.values()
    islands = output_dtypes(PrecisionPolicy(compute_dtype="bfloat16", islands=layers))
    assert set(islands) == set(plain)
    assert set(islands.values()) == {torch.float32}, {n: d for n, d in islands.items() if d != torch.float32}


def test_island_patterns_and_compiled_names():
    zm = zoo.build("gpt2")
    policy = PrecisionPolicy.from_string("params=float32,compute=bfloat16,islands=transformer.h.*.mlp.c_fc;lm_head")
    adj = DynamicPrecisionAdjuster(zm.model, policy)
    assert adj.islands == ("transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc", "lm_head")
    adj.remove()
    with pytest.raises(ValueError, match=r"does not have: \['transformer.h.\*.mlp.c_fcc'\]"):
        DynamicPrecisionAdjuster(zm.model, PrecisionPolicy(islands=("transformer.h.*.mlp.c_fcc",)))
    # A compiled model's names carry _orig_mod.; a policy names the layer the same way for both.
    compiled = torch.compile(zm.model)
    assert "_orig_mod.lm_head" in dict(compiled.named_modules())
    assert PrecisionPolicy(islands=("_orig_mod.lm_head",)).islands == ("lm_head",)
    assert canonical_name("_orig_mod.transformer._orig_mod.h.0") == "transformer.h.0"
    assert unwrap_model(compiled) is zm.model
    assert find_layers(compiled) == find_layers(zm.model)
    for model in (zm.model, compiled):
        adj = DynamicPrecisionAdjuster(model, PrecisionPolicy.from_string("params=float32,compute=bf16,islands=lm_head"))
        assert adj.islands == ("lm_head",) and type(zm.model.lm_head) is not nn.Linear
        adj.remove()
        assert type(zm.model.lm_head) is nn.Linear and "forward" not in zm.model.lm_head.__dict__
    reasons = AdaptivePrecisionSelector().select(compiled, CPU_BF16, overrides="islands=lm_head;nope").reasons
    assert any("nope match no module" in r for r in reasons) and not any("lm_head match" in r for r in reasons)


def test_controller_watches_every_layer_by_name(zm):
    """Per-layer statistics name every layer that returns a float tensor (GPT-2's Conv1D included)."""
    opt = torch.optim.SGD(zm.model.parameters(), lr=1e-3)
    amp = AdaptiveMixedPrecision(zm.model, opt, policy="params=float32,compute=bfloat16", capabilities=CPU_BF16,
                                 read_every=1, stats_every=1)
    for step in range(2):
        with amp.autocast():
            loss = zm.loss(zm.model, zm.make_batch(2, seed=step))
        amp.backward(loss)
        amp.step()
        amp.zero_grad()
    amp.remove()
    rows = {r["name"] for ls in amp.monitor.layer_stats if ls.kind == "activation" for r in ls.rows}
    layers = {n for n, _ in find_layers(zm.model)}
    skipped = set(PrecisionAnalyzer(candidates=("bfloat16",), progress=False).analyze(
        zm.model, zm.inputs(zm.make_batch(1))).skipped)
    assert rows == layers - skipped
    assert sorted({ls.step for ls in amp.monitor.layer_stats}) == [0, 1]
    grads = {r["name"] for ls in amp.monitor.layer_stats if ls.kind == "gradient" for r in ls.rows}
    assert grads == {n for n, _ in zm.model.named_parameters()}
    assert not any(m._forward_hooks for m in zm.model.modules())  # remove() took the hooks off


def test_collapse_names_writes_a_repeated_blocks_layers_once_where_the_pattern_means_exactly_them():
    from adaptive_amp.layers import collapse_names, expand_names

    zm = zoo.build("llama", "tiny", seed=0)  # two decoder layers
    linears = [n for n, m in zm.model.named_modules() if isinstance(m, nn.Linear)]
    every = [(n, "fp8-tensorwise") for n in linears]
    collapsed = collapse_names(every, zm.model)
    assert collapsed[0] == ("model.layers.*.self_attn.q_proj", "fp8-tensorwise")
    assert ("lm_head", "fp8-tensorwise") in collapsed and len(collapsed) == 8  # 7 of the block, the head
    assert sorted(expand_names([n for n, _ in collapsed], zm.model)[0]) == sorted(linears)
    # One block's up_proj differs: both stay named, the rest still collapse.
    mixed = [(n, "bf16" if n == "model.layers.1.mlp.up_proj" else k) for n, k in every]
    out = collapse_names(mixed, zm.model)
    assert ("model.layers.0.mlp.up_proj", "fp8-tensorwise") in out and ("model.layers.1.mlp.up_proj", "bf16") in out
    assert ("model.layers.*.mlp.down_proj", "fp8-tensorwise") in out and len(out) == 9
    # A pattern that would also take a layer not in the entries is not written.
    part = [(n, k) for n, k in every if n != "model.layers.1.self_attn.k_proj"]
    out = collapse_names(part, zm.model)
    assert ("model.layers.0.self_attn.k_proj", "fp8-tensorwise") in out
    assert not any(n == "model.layers.*.self_attn.k_proj" for n, _ in out)
    assert collapse_names([], zm.model) == []
    # A layer named twice keeps its entries where they were: the later one still wins.
    q = [(f"model.layers.{i}.self_attn.q_proj", "fp8-tensorwise") for i in range(2)]
    twice = [q[0], ("model.layers.1.self_attn.q_proj", "bf16"), q[1]]
    assert collapse_names(twice, zm.model) == twice
