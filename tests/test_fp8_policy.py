"""The per-layer precision map (PrecisionPolicy.layers) and fp8 through the controller: the map's string,
dict and moves; fp8 refused where it cannot run with nothing converted; fp8 applied eager and compiled;
policy="bf16+fp8" measuring; and the guard demoting a layer whose input grows an outlier channel.

On the CPU torch._scaled_mm runs, so fp8 is exercised for real with the device check patched "as on an H100"."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from adaptive_amp.layer_precision import base_class
from adaptive_amp.policy import LAYER_KINDS, PrecisionPolicy

from conftest import controller_losses, out_of_memory_in_first_backward, quiet_torchao, requires_cuda

FC = "transformer.h.0.mlp.c_fc"
LAYER = "model.layers.0.mlp.down_proj"


# ---------------------------------------------------------------------------- the map on the policy


def test_one_map_in_the_string_the_dict_and_the_islands_view():
    p = PrecisionPolicy.from_string(f"params=float32,compute=bfloat16,layers={FC}:fp8-tensorwise;lm_head:fp32")
    assert p.islands == ("lm_head",) and p.layers == ((FC, "fp8-tensorwise"),)
    assert p.layer_map == {FC: "fp8-tensorwise", "lm_head": "fp32"}
    assert str(p) == f"params=float32,compute=bfloat16,layers={FC}:fp8-tensorwise;lm_head:fp32"
    assert PrecisionPolicy.from_string(str(p)) == p and PrecisionPolicy.from_dict(p.to_dict()) == p
    assert PrecisionPolicy.from_json(p.to_json()) == p
    # fp32 entries only: written as islands, as before
    q = PrecisionPolicy.from_string("params=float32,compute=float16,layers=a:fp32;b:fp32")
    assert q == PrecisionPolicy.from_string("params=float32,compute=float16,islands=a;b")
    assert "islands=a;b" in str(q) and "layers" not in str(q)
    # a later entry wins over an earlier one on the same name, and takes the later place
    r = PrecisionPolicy(layers={"*.mlp.*": "fp8-rowwise", "x": "bf16"}).replace(layers=(("*.mlp.*", "fp8-rowwise"),
                                                                                        ("x", "bf16"),
                                                                                        ("*.mlp.*", "bf16")))
    assert r.layers == (("x", "bf16"), ("*.mlp.*", "bf16"))
    assert set(LAYER_KINDS) >= {"fp32", "bf16"}


def test_a_layer_moves_fp8_bf16_fp32_and_back_and_an_island_wins():
    from adaptive_amp import fp8

    assert set(fp8.KINDS) <= set(LAYER_KINDS)
    p = PrecisionPolicy(compute_dtype="bf16", layers=((FC, "fp8-tensorwise"),))
    bf16 = p.with_layer(FC, "bf16")
    assert bf16.layer_map == {FC: "bf16"}
    fp32 = bf16.with_layer(FC, "fp32")
    assert fp32.islands == (FC,) and fp32.layers == ()
    assert fp32.with_layer(FC, "fp8-tensorwise") == p
    assert p.with_layer(FC, None).layer_map == {}
    # an island added over an fp8 layer (the controller's overflow promotion) wins; taking it away gives fp8 back
    promoted = p.replace(islands=(FC,))
    assert promoted.layer_map == {FC: "fp32"}
    assert promoted.replace(islands=()).layer_map == {FC: "fp8-tensorwise"}


@pytest.mark.parametrize("text, match", [
    ("params=float32,layers=a:fp9", "kind 'fp9' of 'a' is unknown; expected one of fp32, bf16"),
    ("params=float32,layers=a", "'a' is not name:kind"),
])
def test_bad_map_entries_are_refused_by_name(text, match):
    with pytest.raises(ValueError, match=match):
        PrecisionPolicy.from_string(text)


def test_a_map_or_fp8_option_of_the_wrong_type_is_refused_by_name():
    from adaptive_amp import AdaptiveMixedPrecision

    with pytest.raises(TypeError, match="layers must be"):
        PrecisionPolicy(compute_dtype="bf16", layers=3)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="fp8 must be a dict"):
        AdaptiveMixedPrecision(model, opt, policy="auto", fp8=5, progress=False)
    with pytest.raises(ValueError, match="fp8: unknown key.*'batchez'"):
        AdaptiveMixedPrecision(model, opt, policy="bf16+fp8", sample_inputs=torch.randn(4, 16),
                               fp8=dict(batchez=[torch.randn(4, 16)]), progress=False)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


# ---------------------------------------------------------------------------- fp8 through the controller


def _kinds(model):
    return {n: getattr(type(m), "_kinds_applied", ()) for n, m in model.named_modules()
            if getattr(type(m), "_kinds_applied", ())}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 50))


def test_fp8_where_it_cannot_run_is_refused_at_construction_with_nothing_converted(monkeypatch):
    quiet_torchao()
    from adaptive_amp import AdaptiveMixedPrecision
    from adaptive_amp.fp8 import eligibility

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())  # noqa: E731
    before = hooks()
    with pytest.raises(RuntimeError, match=r"policy.layers: 0 in fp8-tensorwise: .*need a CUDA GPU .*on the CPU"):
        AdaptiveMixedPrecision(model, opt, policy="params=float32,compute=bfloat16,layers=0:fp8-tensorwise;2:bf16")
    assert not _kinds(model) and hooks() == before
    monkeypatch.setattr(eligibility, "device_unsupported", lambda device=None: None)
    with pytest.raises(ValueError, match="layer '2' cannot run in fp8-rowwise: out_features 50 not divisible by 16"):
        AdaptiveMixedPrecision(model, opt, policy="params=float32,compute=bfloat16,layers=*:fp8-rowwise")
    assert not _kinds(model) and hooks() == before
    monkeypatch.setattr(eligibility.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="torchao is not installed"):
        AdaptiveMixedPrecision(model, opt, policy="params=float32,compute=bfloat16,layers=0:fp8-tensorwise")
    assert not _kinds(model) and hooks() == before


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_controller_runs_fp8_layers_of_the_map_eager_and_compiled(fp8_here, compiled):
    from adaptive_amp import AdaptiveMixedPrecision
    from adaptive_amp.fp8 import fp8_forward

    model = _mlp()
    reference = nn.Sequential(*[m for m in _mlp()])  # the same weights (seed 0)
    x = torch.randn(8, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = AdaptiveMixedPrecision(model, opt, policy="params=float32,compute=bfloat16,layers=0:fp8-tensorwise;2:fp32",
                                 progress=False)
    assert amp.adjuster.layer_kinds == {"0": "fp8-tensorwise"} and amp.adjuster.islands == ("2",)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    with amp.autocast():
        out = run(x)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        h = reference[1](fp8_forward(reference[0], x, "fp8-tensorwise"))
    expected = reference[2](h.float())
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)
    assert out.dtype == torch.float32  # the island
    # fp8 -> bf16 -> fp32 -> back, each applied by the one mechanism
    for kind in ("bf16", "fp32", "fp8-tensorwise"):
        amp.adjuster.set_policy(amp.policy.with_layer("0", kind))
        with amp.autocast():
            run(x)
        assert (amp.adjuster.layer_kinds.get("0") or ("fp32" if "0" in amp.adjuster.islands else None)) == kind
    assert len(model[0]._forward_pre_hooks) == 1  # the guard's eye on the fp8 layer
    amp.remove()
    assert not _kinds(model) and type(model[0]) is nn.Linear and base_class(model[0]) is nn.Linear
    assert not model[0]._forward_pre_hooks


def test_bf16_plus_fp8_measures_each_layer_and_gives_every_decision_a_reason(monkeypatch):
    quiet_torchao()
    from adaptive_amp import AdaptiveMixedPrecision
    from adaptive_amp.fp8 import eligibility

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    # on the CPU: nothing goes to fp8, each layer with why
    amp = AdaptiveMixedPrecision(model, opt, policy="bf16+fp8", sample_inputs=x, progress=False)
    assert amp.policy.layers == () and amp.policy.compute_dtype == torch.bfloat16
    assert sum("not fp8 (fp8 matmuls need a CUDA GPU" in r for r in amp.policy.reasons) == 2
    amp.remove()
    # as on an H100, with a gain table: the first layer gains, the second cannot take fp8 (50 outputs)
    monkeypatch.setattr(eligibility, "device_unsupported", lambda device=None: None)
    gains = lambda layer, shape, kind: 1.4 if kind == "fp8-tensorwise" else 1.1  # noqa: E731
    amp = AdaptiveMixedPrecision(model, opt, policy="bf16+fp8", sample_inputs=x, progress=False,
                                 fp8=dict(gain_fn=gains))
    assert amp.policy.layers == (("0", "fp8-tensorwise"),)
    assert any(r.startswith("layer 0: fp8-tensorwise, gains 1.40x") for r in amp.policy.reasons)
    assert any(r.startswith("layer 2: stays as it was, not fp8 (out_features 50") for r in amp.policy.reasons)
    assert "layers=0:fp8-tensorwise" in str(amp.policy) and "layers=0:fp8-tensorwise" in str(amp.report())
    with pytest.raises(ValueError, match="policy='bf16[+]fp8' measures each layer on sample batches"):
        AdaptiveMixedPrecision(model, opt, policy="bf16+fp8")


# ---------------------------------------------------------------------------- guarded at run time


def _llama_run(policy, steps, outlier, guard=None):
    """A tiny zoo Llama (SwiGLU) trained `steps` steps, statistics every step; `outlier(step)` is the value
    planted in channel 0 of LAYER's input (the SwiGLU output), whose weight column is held at zero so that
    the outlier does not change what the layer computes exactly: only its fp8 cast suffers from it."""
    from adaptive_amp import AdaptiveMixedPrecision, zoo

    zm = zoo.build("llama", "tiny", seed=0)
    layer = dict(zm.model.named_modules())[LAYER]
    at = {"step": 0}

    def plant(module, args):
        with torch.no_grad():
            module.weight[:, 0] = 0
        x = args[0].clone()
        x[..., 0] = outlier(at["step"])
        return (x,)

    layer.register_forward_pre_hook(plant)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    amp = AdaptiveMixedPrecision(zm.model, opt, policy=policy, stats_every=1, progress=False,
                                 fp8=dict(guard=guard) if guard is not None else None)
    losses = _train(amp, zm, range(steps), at)
    return losses, [e for e in amp.events if e.kind.startswith("fp8")], amp


def _train(amp, zm, steps, at) -> list:
    """The controller's steps `steps` on the zoo model's batch of each step's seed, ``at["step"]`` set for the
    planted hooks: the losses."""
    losses = []
    for step in steps:
        at["step"] = step
        with amp.autocast():
            loss = zm.loss(zm.model, zm.make_batch(4, seed=step))
        amp.backward(loss)
        amp.step()
        amp.zero_grad()
        losses.append(loss.item())
    return losses


FP8 = f"params=float32,compute=float32,layers={LAYER}:fp8-tensorwise"
BF16 = f"params=float32,compute=float32,layers={LAYER}:bf16"


def test_a_layer_growing_an_outlier_channel_is_demoted_before_the_loss_departs(fp8_here):
    from adaptive_amp.fp8 import Fp8Guard

    steps, grow = 10, (lambda step: 4.0 ** step)  # fp8 alone departs from bf16 at step 7
    bf16, _, _ = _llama_run(BF16, steps, grow)
    unguarded, none, _ = _llama_run(FP8, steps, grow, guard=False)
    guarded, events, amp = _llama_run(FP8, steps, grow, guard=Fp8Guard())
    assert none == []
    departs = next(i for i, (a, b) in enumerate(zip(unguarded, bf16)) if abs(a - b) > 1e-3)
    assert [e.kind for e in events] == ["fp8_demote"] and events[0].layer == LAYER
    assert events[0].step <= departs - 2, (events, departs)
    assert max(abs(a - b) for a, b in zip(guarded, bf16)) < 5e-4
    assert amp.policy.layer_map == {LAYER: "bf16"} and amp.adjuster.layer_kinds == {LAYER: "bf16"}
    assert any("fp8_demote" in r or "demoted to bf16" in r for r in amp.policy.reasons)


def test_an_ordinary_run_raises_no_event_and_a_demoted_layer_returns_with_back_off(fp8_here):
    from adaptive_amp.fp8 import Fp8Guard

    _, events, amp = _llama_run(FP8, 10, lambda step: 1.0)
    assert events == [] and amp.adjuster.layer_kinds == {LAYER: "fp8-tensorwise"}
    # bf16 compute, every MLP layer in fp8 (the inputs arrive in bf16)
    _, events, amp = _llama_run("params=float32,compute=bfloat16,layers=*.mlp.*:fp8-tensorwise", 6, lambda step: 1.0)
    assert events == [] and len(amp._fp8_watch.rows) == 6
    spikes = {3, 9}
    _, events, amp = _llama_run(FP8, 16, lambda step: 1e5 if step in spikes else 1.0,
                                guard=Fp8Guard(stable_steps=3, min_history=1))
    # (an event is dated by the first step under the policy it makes)
    assert [(e.kind, e.step) for e in events] == [("fp8_demote", 4), ("fp8_restore", 7), ("fp8_demote", 10),
                                                  ("fp8_restore", 16)]
    assert events[2].data["wait"] == 6  # the second failure waits twice as long
    assert [p.rpartition(":")[2] for _, p in amp.policy_history] == ["fp8-tensorwise", "bf16"] * 2 + ["fp8-tensorwise"]
    assert amp.adjuster.layer_kinds == {LAYER: "fp8-tensorwise"}
    text = str(amp.report(plots=False))
    assert f"layers={LAYER}:bf16" in text and "demoted to bf16" in text and "back to fp8" in text


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_layers_of_a_zoo_llama_train_on_the_gpu(compiled):
    """On a GPU with fp8 matmuls: the MLPs of a tiny Llama in fp8 through the controller, eager and compiled,
    train as bf16 does; where the GPU has none, construction refuses with the reason."""
    quiet_torchao()
    from adaptive_amp import AdaptiveMixedPrecision, fp8, zoo

    zm = zoo.build("llama", "tiny", seed=0, device="cuda")
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    policy = "params=float32,compute=bfloat16,layers=*.mlp.*:fp8-tensorwise;*.o_proj:fp8-rowwise"
    why = fp8.fp8_unavailable("cuda")
    if why is not None:
        with pytest.raises(RuntimeError, match="cannot run here"):
            AdaptiveMixedPrecision(zm.model, opt, policy=policy, progress=False)
        return
    amp = AdaptiveMixedPrecision(zm.model, opt, policy=policy, stats_every=2, progress=False)
    model = torch.compile(zm.model) if compiled else zm.model
    losses = controller_losses(amp, zm, model, steps=20, device="cuda")
    assert losses[-1] < losses[0] and all(map(torch.isfinite, map(torch.tensor, losses)))
    assert not [e for e in amp.events if e.kind.startswith("fp8")]
    assert len(amp.adjuster.layer_kinds) == 8 and len(amp._fp8_watch.rows) == 8


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_guard_keeps_a_copy_of_a_few_rows_of_each_fp8_input_in_zoo_models(fp8_here, family, compiled):
    """At a statistics step each fp8 layer (transformers' Conv1D and nn.Linear) keeps its own copy of at most
    max_rows rows, not a view holding the whole input (with checkpointing, every block's activations), and the
    copies become the guard's rows as the forward ends: none is held through the backward."""
    from adaptive_amp import AdaptiveMixedPrecision, zoo
    from adaptive_amp.fp8.training import _KEPT

    torch._dynamo.reset()
    zm = zoo.build(family, "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    amp = AdaptiveMixedPrecision(zm.model, opt, policy="params=float32,compute=bfloat16,layers=*.mlp.*:fp8-tensorwise",
                                 progress=False)
    watched = dict(zm.model.named_modules())
    watched = {n: watched[n] for n in amp.adjuster.layer_kinds}
    assert watched and all(".mlp." in n for n in watched)
    amp._fp8_watch.max_rows = 3
    model = torch.compile(zm.model, backend="aot_eager") if compiled else zm.model
    assert amp._stats_due()
    with amp.autocast():
        zm.loss(model, zm.make_batch(4, seed=0))
        for name, module in watched.items():
            kept = module.__dict__[_KEPT]
            assert kept.shape[0] == 3 and kept.untyped_storage().nbytes() == kept.numel() * kept.element_size(), name
    assert not any(_KEPT in m.__dict__ for m in watched.values()) and amp._fp8_watch.settled_at == 0
    assert [r["name"] for r in amp._fp8_watch.read()] == list(watched)
    amp.remove()
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_backward_inside_autocast_frees_the_guards_copies_before_it_runs(fp8_here, family, compiled):
    """Lightning's manual optimization calls the backward inside its step's context (the controller's autocast):
    the statistics step's copies become the guard's rows as the backward starts, none held through it, and a
    recompute in the backward (activation checkpointing) captures nothing."""
    from adaptive_amp import AdaptiveMixedPrecision, zoo
    from adaptive_amp.fp8.guard import fp8_layer_row
    from adaptive_amp.fp8.training import _KEPT

    torch._dynamo.reset()
    zm = zoo.build(family, "tiny", seed=0)
    zm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    amp = AdaptiveMixedPrecision(zm.model, opt, policy="params=float32,compute=bfloat16,layers=*.mlp.*:fp8-tensorwise",
                                 progress=False)
    layers = {n: m for n, m in zm.model.named_modules() if n in amp.adjuster.layer_kinds}
    seen, held = {}, []
    for name, module in layers.items():
        module.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, args[0].detach().clone()))
        module.register_full_backward_pre_hook(
            lambda m, grad: held.append(any(_KEPT in k.__dict__ for k in layers.values())))
    model = torch.compile(zm.model, backend="aot_eager") if compiled else zm.model
    with amp.autocast():
        loss = zm.loss(model, zm.make_batch(4, seed=0))
        assert all(_KEPT in m.__dict__ for m in layers.values())
        amp.backward(loss)
    assert held and not any(held)
    assert not any(_KEPT in m.__dict__ for m in layers.values()) and amp._fp8_watch.settled_at == 0
    first = [fp8_layer_row(n, layers[n], seen[n].reshape(-1, seen[n].shape[-1])[:1024]) for n in layers]
    assert [r["amax"] for r in amp._fp8_watch.read()] == [r["amax"] for r in first]
    amp.remove()
    torch._dynamo.reset()


def test_under_gradient_accumulation_the_first_forward_of_a_statistics_step_feeds_the_guard(fp8_here):
    """A statistics step of two micro-batches: the first forward's fp8 inputs become the guard's rows as it ends,
    the second captures nothing, and the step's guard reads the first's rows."""
    from adaptive_amp import AdaptiveMixedPrecision, zoo
    from adaptive_amp.fp8.guard import fp8_layer_row
    from adaptive_amp.fp8.training import _KEPT

    zm = zoo.build("llama", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    amp = AdaptiveMixedPrecision(zm.model, opt, policy="params=float32,compute=bfloat16,layers=*.mlp.*:fp8-tensorwise",
                                 progress=False, stats_every=2)
    layers = {n: m for n, m in zm.model.named_modules() if n in amp.adjuster.layer_kinds}
    seen, kept = {}, []
    for name, module in layers.items():
        module.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, args[0].detach().clone()))
        module.register_forward_hook(lambda m, args, out: kept.append(_KEPT in m.__dict__))
    for step in range(3):  # statistics at steps 0 and 2
        seen.clear()
        kept.clear()
        for seed in (step, step + 10):
            with amp.autocast():
                loss = zm.loss(zm.model, zm.make_batch(4, seed=seed))
            if step == 0 and seed == 0:
                first = {n: fp8_layer_row(n, layers[n], seen[n].reshape(-1, seen[n].shape[-1])[:1024])
                         for n in layers}
            assert not any(_KEPT in m.__dict__ for m in layers.values())  # (none held into the backward)
            amp.backward(loss / 2)
        amp.step()
        amp.zero_grad()
        # (the statistics step's first forward: a copy from each layer's hook on; none in the second, nor in an
        # ordinary step)
        assert kept == ([True] * len(layers) + [False] * len(layers) if step % 2 == 0 else [False] * 2 * len(layers))
        if step == 0:
            assert [r["amax"] for r in amp._fp8_watch.rows] == [first[n]["amax"] for n in layers]
    assert amp._fp8_watch.settled_at is None
    amp.remove()


def test_the_guard_reads_a_training_forward_not_an_evaluation_or_a_forward_without_fp8_layers(fp8_here):
    """At a statistics step, an evaluation (no gradients) in amp.autocast() and a forward that calls no fp8 layer
    (another model's) leave the guard to the training forward that follows; rows the step's guard did not read
    (adapt turned off) are not taken for the next statistics step's."""
    from adaptive_amp import AdaptiveMixedPrecision, zoo
    from adaptive_amp.fp8.guard import fp8_layer_row

    zm = zoo.build("llama", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    amp = AdaptiveMixedPrecision(zm.model, opt, policy="params=float32,compute=bfloat16,layers=*.mlp.*:fp8-tensorwise",
                                 progress=False, stats_every=2)
    layers = {n: m for n, m in zm.model.named_modules() if n in amp.adjuster.layer_kinds}
    seen = {}
    for name, module in layers.items():
        module.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0].detach().clone()))
    other = nn.Linear(4, 4)

    def train(seed):
        with amp.autocast():
            loss = zm.loss(zm.model, zm.make_batch(4, seed=seed))
        expected = {n: fp8_layer_row(n, layers[n], seen[n].reshape(-1, seen[n].shape[-1])[:1024])["amax"]
                    for n in layers}
        amp.backward(loss)
        amp.step()
        amp.zero_grad()
        return expected
    with torch.no_grad(), amp.autocast():
        zm.loss(zm.model, zm.make_batch(4, seed=5))  # evaluation
    with amp.autocast():
        other(torch.randn(2, 4))  # no fp8 layer called
    assert amp._fp8_watch.settled_at is None
    expected = train(seed=1)
    assert [r["amax"] for r in amp._fp8_watch.rows] == [expected[n] for n in layers]
    train(seed=2)
    with amp.autocast():  # step 2, a statistics step whose rows no guard reads (adaptation turned off meanwhile)
        loss = zm.loss(zm.model, zm.make_batch(4, seed=3))
    assert amp._fp8_watch.settled_at == 2
    amp.adapt = False
    amp.backward(loss)
    amp.step()
    amp.zero_grad()
    train(seed=3)
    assert amp._fp8_watch.settled_at == 2
    amp.adapt = True
    expected = train(seed=4)
    assert [r["amax"] for r in amp._fp8_watch.rows] == [expected[n] for n in layers]
    amp.remove()


def _step_zero(family, compiled, forwards):
    """The fp8 guard's rows (amax) and the layer statistics of statistics step 0 of a zoo model with fp8 MLPs, where
    ``forwards(amp, model, zm)`` runs the step's forwards and backwards."""
    from adaptive_amp import AdaptiveMixedPrecision, zoo

    torch._dynamo.reset()
    zm = zoo.build(family, "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    amp = AdaptiveMixedPrecision(zm.model, opt, policy="params=float32,compute=bfloat16,layers=*.mlp.*:fp8-tensorwise",
                                 progress=False, stats_every=2)
    model = torch.compile(zm.model, backend="aot_eager") if compiled else zm.model
    forwards(amp, model, zm)
    amp.step()
    amp.monitor.read()
    rows = [r["amax"] for r in amp._fp8_watch.rows]
    stats = [ls.rows for ls in amp.monitor.layer_stats if ls.kind == "activation"]
    amp.remove()
    torch._dynamo.reset()
    return rows, stats


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_statistics_step_measures_its_first_training_forward_in_zoo_models(fp8_here, family, compiled):
    """transformers' GPT-2 (Conv1D) and Llama, eager and compiled: an evaluation (no gradients) or a forward calling
    no fp8 layer before the training forward, or a second micro-batch after it, leave the step's fp8 guard rows
    and layer statistics as the training forward alone gives them."""
    def train(amp, model, zm, seed=1):
        with amp.autocast():
            loss = zm.loss(model, zm.make_batch(4, seed=seed))
        amp.backward(loss)

    def evaluate_first(amp, model, zm):
        with torch.no_grad(), amp.autocast():
            zm.loss(model, zm.make_batch(4, seed=5))
        with amp.autocast():
            nn.Linear(4, 4)(torch.randn(2, 4))
        train(amp, model, zm)

    def accumulate(amp, model, zm):
        train(amp, model, zm)
        train(amp, model, zm, seed=2)
    alone = _step_zero(family, compiled, train)
    assert alone[0] and alone[1]
    assert _step_zero(family, compiled, evaluate_first) == alone
    assert _step_zero(family, compiled, accumulate) == alone


def test_a_resumed_run_keeps_the_guards_demotions_and_back_off(fp8_here, tmp_path):
    """A checkpoint taken while a layer is demoted: the resumed run holds it in bf16 and brings it back at the
    step the uninterrupted run does, with the same back-off."""
    from adaptive_amp import AdaptiveMixedPrecision, zoo
    from adaptive_amp.fp8 import Fp8Guard

    spikes, at = {3, 9}, {"step": 0}

    def plant(module, args):  # an outlier channel at the spikes, its weight column zero (as in _llama_run)
        with torch.no_grad():
            module.weight[:, 0] = 0
        x = args[0].clone()
        x[..., 0] = 1e5 if at["step"] in spikes else 1.0
        return (x,)

    def controller(zm):
        dict(zm.model.named_modules())[LAYER].register_forward_pre_hook(plant)
        opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
        return AdaptiveMixedPrecision(zm.model, opt, policy=FP8, stats_every=1, progress=False,
                                      fp8=dict(guard=Fp8Guard(stable_steps=3, min_history=1)))

    whole = zoo.build("llama", "tiny", seed=0)
    amp = controller(whole)
    _train(amp, whole, range(16), at)
    expected = [(e.kind, e.step, e.data.get("wait")) for e in amp.events if e.kind.startswith("fp8")]
    assert [k for k, _, _ in expected] == ["fp8_demote", "fp8_restore", "fp8_demote", "fp8_restore"]

    first = zoo.build("llama", "tiny", seed=0)
    amp = controller(first)
    _train(amp, first, range(5), at)
    assert amp.adjuster.layer_kinds == {LAYER: "bf16"}  # demoted when saved
    path = tmp_path / "ckpt.pt"
    torch.save({"amp": amp.state_dict(), "model": first.model.state_dict()}, path)
    saved = torch.load(path, weights_only=True)

    second = zoo.build("llama", "tiny", seed=1)
    second.model.load_state_dict(saved["model"])
    resumed = controller(second)
    assert resumed.adjuster.layer_kinds == {LAYER: "fp8-tensorwise"}
    bad = dict(saved["amp"], fp8={"guard": {"history": {}}, "kinds": {}})
    with pytest.raises(ValueError, match=r"state\['fp8'\] is refused"):
        resumed.load_state_dict(bad)
    assert resumed.adjuster.layer_kinds == {LAYER: "fp8-tensorwise"} and resumed.step_count == 0
    resumed.load_state_dict(saved["amp"])
    assert resumed.adjuster.layer_kinds == {LAYER: "bf16"}
    _train(resumed, second, range(5, 16), at)
    got = [(e.kind, e.step, e.data.get("wait")) for e in resumed.events if e.kind.startswith("fp8")]
    assert got == expected


def test_blocks_compiled_one_at_a_time_trace_no_graph_per_layer_for_the_guard(fp8_here):
    """``block.compile()`` on each decoder layer (regional compilation): the fp8 layers' watch adds no graph (one
    per layer would pass dynamo's recompile limit on a 32-layer model and leave the rest eager), and still reads
    every fp8 layer at statistics steps."""
    import transformers

    from adaptive_amp import AdaptiveMixedPrecision

    def graphs_traced(guard):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                          use_cache=False)
        model = transformers.LlamaForCausalLM(config)
        graphs = []

        def counting(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        amp = AdaptiveMixedPrecision(model, opt, policy="params=float32,compute=bfloat16,layers=*.mlp.*:fp8-tensorwise",
                                     stats_every=2, progress=False, fp8=dict(guard=guard), exclude=["*"])
        for layer in model.model.layers:
            layer.compile(backend=counting)
        ids = torch.randint(0, 128, (2, 16))
        for _ in range(4):  # statistics at steps 0 and 2
            amp.train_step(lambda: model(input_ids=ids, labels=ids).loss)
        rows = [] if amp._fp8_watch is None else amp._fp8_watch.rows
        amp.remove()
        torch._dynamo.reset()
        return len(graphs), rows

    unwatched, _ = graphs_traced(False)
    watched, rows = graphs_traced(None)
    # (the activation statistics' hooks are left out: exclude=["*"]) one graph and its backward for ordinary
    # steps, one pair for statistics steps, whatever the number of layers
    assert watched == unwatched <= 4, (watched, unwatched)
    assert len(rows) == 18 and len({r["name"] for r in rows}) == 18


def test_a_compiled_model_has_its_fp8_gains_timed_compiled(monkeypatch):
    """policy="bf16+fp8" times each layer as the run computes it: every layer of a model compiled whole
    compiled; where modules are compiled in place, the layers inside them compiled and the others (an output head
    beside compiled blocks) eagerly; an eager model eagerly; fp8=dict(compiled=...) decides where given."""
    quiet_torchao()
    from adaptive_amp import AdaptiveMixedPrecision
    from adaptive_amp.fp8 import eligibility, select

    monkeypatch.setattr(eligibility, "device_unsupported", lambda device=None: None)
    seen = []

    def layer_times(module, shape, kinds, *, bf16=True, compiled=False, **kw):
        seen.append((module.in_features, compiled))
        return {"bf16": 1.0, **{k: 1.0 for k in kinds}}

    monkeypatch.setattr(select, "layer_times", layer_times)
    x = torch.randn(8, 32)

    def mlp():  # (both layers' sizes fp8 can take)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48))

    def measured(model, **fp8):
        seen.clear()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp = AdaptiveMixedPrecision(model, opt, policy="bf16+fp8", sample_inputs=x, progress=False, fp8=fp8)
        reasons = [r for r in amp.policy.reasons if "timed eagerly" in r]
        amp.remove()
        return sorted(seen), reasons

    assert measured(mlp()) == ([(32, False), (64, False)], [])
    assert measured(torch.compile(mlp(), backend="aot_eager")) == ([(32, True), (64, True)], [])
    whole = mlp()
    whole.compile(backend="aot_eager")
    assert measured(whole) == ([(32, True), (64, True)], [])
    in_place = mlp()
    in_place[0].compile(backend="aot_eager")  # (the first layer on its own: the second runs eagerly)
    timed, reasons = measured(in_place)
    assert timed == [(32, True), (64, False)]
    assert len(reasons) == 1 and reasons[0].startswith("layer 2: stays as it was")
    assert "timed eagerly: it runs outside" in reasons[0]
    wrapped = mlp()  # (the first layer replaced by a torch.compile wrapper in its parent)
    wrapped[0] = torch.compile(wrapped[0], backend="aot_eager")
    assert measured(wrapped)[0] == [(32, True), (64, False)]
    assert measured(torch.compile(mlp(), backend="aot_eager"), compiled=False) == ([(32, False), (64, False)], [])
    assert measured(in_place, compiled=True) == ([(32, True), (64, True)], [])
    # a tuning's map (its "+fp8" candidates) the same way
    from adaptive_amp.fp8.training import tuning_fp8_map

    seen.clear()
    tuning_fp8_map(in_place, [x], lambda model, batch: model(batch).sum())
    assert sorted(seen) == [(32, True), (64, False)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_step_that_ran_out_of_memory_leaves_no_fp8_inputs_behind(fp8_here, family, compiled):
    """A statistics step whose backward ran out of memory: its fp8 layers' (transformers' Conv1D and nn.Linear)
    inputs, turned into the guard's rows as the forward ended, hold no copy during the backward, the rows are
    dropped, and the step run again captures and reads its own, and records its own layer statistics, not the
    failed attempt's."""
    from adaptive_amp import AdaptiveMixedPrecision, zoo
    from adaptive_amp.fp8.training import _KEPT

    torch._dynamo.reset()
    zm = zoo.build(family, "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    amp = AdaptiveMixedPrecision(zm.model, opt, policy="params=float32,compute=bfloat16,layers=*.mlp.*:fp8-tensorwise",
                                 progress=False, stats_every=1, read_every=1)
    model = torch.compile(zm.model, backend="aot_eager") if compiled else zm.model
    fp8_layers = [m for n, m in zm.model.named_modules() if n in amp.adjuster.layer_kinds]
    captured, failed_rows, failed_fp8_rows = [], [], []

    def before():  # what the forward captured and recorded, when backward fails
        captured.append(amp._fp8_watch.settled_at == 0 and not any(_KEPT in m.__dict__ for m in fp8_layers))
        failed_fp8_rows.extend(amp._fp8_watch._settled[1])
        failed_rows.extend(st.rows(sort_by=None) for s, kind, st in amp.monitor._pending_stats
                           if s == 0 and kind == "activation")
    oom, failed = out_of_memory_in_first_backward(before)
    # (the failed attempt's batch differs, so that its statistics would show)
    batches = [zm.make_batch(4, seed=1), zm.make_batch(4, seed=0)]
    with pytest.raises(torch.OutOfMemoryError):
        amp.train_step(lambda: oom(zm.loss(model, batches[failed()])))
    assert captured == [True] and fp8_layers and len(failed_rows) == 1
    assert not any(_KEPT in m.__dict__ for m in fp8_layers) and not amp._fp8_watch.due
    assert amp._fp8_watch.settled_at is None
    amp.train_step(lambda: oom(zm.loss(model, batches[failed()])))
    assert len(amp._fp8_watch.rows) == len(fp8_layers) and amp.step_count == 1
    assert [r["amax"] for r in amp._fp8_watch.rows] != [r["amax"] for r in failed_fp8_rows]
    amp.monitor.read()
    activation = [ls for ls in amp.monitor.layer_stats if ls.kind == "activation"]
    assert [ls.step for ls in activation] == [0]
    assert [r["amax"] for r in activation[0].rows] != [r["amax"] for r in failed_rows[0]]
    amp.remove()
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", ["eager", "blocks", "whole"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_zoo_fp8_gains_are_timed_as_each_layer_runs(monkeypatch, family, compiled):
    """The zoo's GPT-2 (Conv1D) and Llama under policy="bf16+fp8": eager, every layer timed eagerly; each decoder
    block compiled in place, the blocks' layers timed compiled and the output head beside them eagerly; compiled
    whole, every layer compiled."""
    quiet_torchao()
    from adaptive_amp import AdaptiveMixedPrecision, zoo
    from adaptive_amp.fp8 import eligibility, select
    from adaptive_amp.recipes import find_blocks

    monkeypatch.setattr(eligibility, "device_unsupported", lambda device=None: None)
    timed = {}

    def layer_times(module, shape, kinds, *, bf16=True, compiled=False, **kw):
        timed.setdefault(compiled, []).append(tuple(shape))
        return {"bf16": 1.0, **{k: 1.0 for k in kinds}}

    monkeypatch.setattr(select, "layer_times", layer_times)
    torch._dynamo.reset()
    zm = zoo.build(family, "tiny", seed=0)
    blocks = [b for _, b in find_blocks(zm.model)]
    model = zm.model
    if compiled == "blocks":
        for block in blocks:
            block.compile(backend="aot_eager")
    elif compiled == "whole":
        model = torch.compile(zm.model, backend="aot_eager")
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    batch = zm.make_batch(2, seed=0)
    amp = AdaptiveMixedPrecision(model, opt, policy="bf16+fp8", progress=False,
                                 fp8=dict(batches=[batch], run=lambda _, b: zm.loss(zm.model, b)))
    eagerly = [r for r in amp.policy.reasons if "timed eagerly" in r]
    amp.remove()
    torch._dynamo.reset()
    assert timed
    if compiled == "eager":
        assert set(timed) == {False} and not eagerly
    elif compiled == "whole":
        assert set(timed) == {True} and not eagerly
    else:  # the blocks' layers compiled; the head, and it alone, eagerly
        assert set(timed) == {True, False}
        assert len(eagerly) == 1 and eagerly[0].startswith("layer lm_head: "), eagerly
