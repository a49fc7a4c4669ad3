"""fp8 layers stacked on the memory recipes: bf16-weights and bf16-pure (stochastic-rounding optimizer, fp32 or
bf16 moments) and activation checkpointing, as presets ("bf16-pure+fp8"), as tuning candidates and under a
MemoryGuard's moves; the guard's recompute whatever the weights' dtype.

On the CPU torch._scaled_mm runs, so fp8 is exercised for real with the device check patched "as on an H100"
and the gain measurement replaced by a table (select_fp8_layers' gain_fn)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import adaptive_amp
from adaptive_amp import AdaptiveMixedPrecision, zoo
from adaptive_amp.layers import expand_names
from adaptive_amp.policy import PrecisionPolicy

from conftest import controller_losses, quiet_torchao, requires_cuda


def _sr_adamw(model, moments=torch.float32):
    return adaptive_amp.optim.AdamW(model.parameters(), lr=1e-3, stochastic_rounding=True, moment_dtype=moments)


def _train(amp, zm, steps, model=None):
    losses = []
    for step in range(steps):
        with amp.autocast():
            loss = zm.loss(zm.model if model is None else model, zm.make_batch(4, seed=step % 2))
        amp.backward(loss)
        amp.step()
        amp.zero_grad()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------- the guard's recompute


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_guards_recompute_takes_any_weight_dtype_and_leaves_the_weights(fp8_here, dtype):
    from adaptive_amp.fp8 import fp8_layer_row

    torch.manual_seed(0)
    layer = nn.Linear(32, 64).to(dtype)
    weight, bias = layer.weight, layer.bias
    before = weight.detach().clone(), bias.detach().clone()
    row = fp8_layer_row("fc", layer, torch.randn(8, 32).to(dtype))
    assert 0 < row["error"] < 0.15
    assert layer.weight is weight and layer.bias is bias and weight.dtype == bias.dtype == dtype
    assert torch.equal(weight, before[0]) and torch.equal(bias, before[1])


def test_bf16_pure_with_fp8_layers_is_guarded_at_statistics_steps(fp8_here):
    zm = zoo.build("llama", "tiny", seed=0)
    opt = _sr_adamw(zm.model)
    policy = PrecisionPolicy.from_string("bf16-pure").replace(layers=(("*.mlp.*", "fp8-tensorwise"),))
    amp = AdaptiveMixedPrecision(zm.model, opt, policy=policy, stats_every=1, progress=False)
    losses = _train(amp, zm, 3)
    assert all(map(torch.isfinite, torch.tensor(losses)))
    rows = amp._fp8_watch.rows
    assert len(rows) == 6 and all(0 < r["error"] < 0.15 for r in rows), rows
    assert not [e for e in amp.events if e.kind.startswith("fp8")]
    assert all(p.dtype == torch.bfloat16 for p in zm.model.parameters())


# ---------------------------------------------------------------------------- presets "<base>+fp8"


def _gains(layer, shape, kind):
    """A gain table in place of timing on a GPU: every layer gains, tensorwise most."""
    return 1.4 if kind == "fp8-tensorwise" else 1.2


def _hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _kinds(model):
    return {n: getattr(type(m), "_kinds_applied", ()) for n, m in model.named_modules()
            if getattr(type(m), "_kinds_applied", ())}


@pytest.mark.parametrize("family, base, compiled", [
    ("llama", "bf16-weights", False), ("llama", "bf16-pure", False), ("gpt2", "bf16-weights", False),
    ("gpt2", "bf16-pure", False), ("llama", "bf16-pure", True), ("gpt2", "bf16-weights", True),
], ids=lambda v: {False: "eager", True: "compiled"}.get(v, v) if isinstance(v, bool) else v)
def test_fp8_presets_train_fp8_layers_over_the_memory_recipes(fp8_here, family, base, compiled):
    from adaptive_amp.policy import recipe_policy

    twin = zoo.build(family, "tiny", seed=0)  # the base preset alone: what the parameters must look like
    plain = AdaptiveMixedPrecision(twin.model, _sr_adamw(twin.model), policy=base, progress=False)
    zm = zoo.build(family, "tiny", seed=0)
    params = dict(zm.model.named_parameters())
    hooks = _hooks(zm.model)
    opt = _sr_adamw(zm.model)
    timed = set()

    def gains(layer, shape, kind):  # (a layer as the run computes it: its weights in bf16, not the model's)
        timed.add((layer.weight.dtype, any(layer is m for m in zm.model.modules())))
        return _gains(layer, shape, kind)

    amp = AdaptiveMixedPrecision(zm.model, opt, policy=f"{base}+fp8", stats_every=2, progress=False,
                                 fp8=dict(gain_fn=gains, batches=[zm.make_batch(4, seed=0)],
                                          run=lambda m, b: zm.loss(m, b)))
    assert timed == {(torch.bfloat16, False)}
    # The base preset's policy plus the measured layers, each with its reason.
    assert amp.policy.replace(layers=()) == recipe_policy(base, amp.capabilities.tf32)
    assert plain.policy.replace(tf32=amp.policy.tf32) == recipe_policy(base, amp.capabilities.tf32)
    linears = [n for n, m in zm.model.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
    # One entry for each layer of the repeated block (a pattern over the blocks), one for the head.
    named, unmatched = expand_names([name for name, _ in amp.policy.layers], zm.model)
    assert sorted(named) == sorted(linears) and not unmatched
    assert {kind for _, kind in amp.policy.layers} == {"fp8-tensorwise"} and len(amp.policy.layers) < len(linears)
    assert all(any(r.startswith(f"layer {n}: fp8-tensorwise, gains 1.40x") for r in amp.policy.reasons)
               for n in linears)
    assert amp.adjuster.layer_kinds == {n: "fp8-tensorwise" for n in linears}
    # The same Parameter objects, in the dtypes of the base preset.
    assert {n: p.dtype for n, p in zm.model.named_parameters()} == {n: p.dtype for n, p in twin.model.named_parameters()}
    assert all(p is params[n] for n, p in zm.model.named_parameters())
    model = torch.compile(zm.model, backend="aot_eager") if compiled else zm.model
    losses = _train(amp, zm, 6, model)
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert len(amp._fp8_watch.rows) == len(linears) and not [e for e in amp.events if e.kind.startswith("fp8")]
    assert {n: p.dtype for n, p in zm.model.named_parameters()} == {n: p.dtype for n, p in twin.model.named_parameters()}
    amp.remove()
    assert not _kinds(zm.model) and _hooks(zm.model) == hooks
    assert all(p is params[n] for n, p in zm.model.named_parameters())
    plain.remove()


def test_fp8_presets_need_the_sr_optimizer_and_refuse_before_measuring(fp8_here, monkeypatch):
    from adaptive_amp.fp8 import training

    zm = zoo.build("llama", "tiny", seed=0)
    calls = []
    monkeypatch.setattr(training, "select_fp8_layers", lambda *a, **k: calls.append(1))
    hooks = _hooks(zm.model)
    with pytest.raises(TypeError, match="keeps weights in bfloat16, so its optimizer must round"):
        AdaptiveMixedPrecision(zm.model, torch.optim.AdamW(zm.model.parameters()), policy="bf16-pure+fp8",
                               sample_inputs=zm.make_batch(2), progress=False)
    for bad, match in (("fp16+fp8", "policy 'fp16[+]fp8': fp8 stacks on bf16, bf16-weights, bf16-pure"),
                       ("bf16-weights+bf16-moments+fp8", "moments are the optimizer's own")):
        with pytest.raises(ValueError, match=match):
            AdaptiveMixedPrecision(zm.model, _sr_adamw(zm.model), policy=bad, sample_inputs=zm.make_batch(2),
                                   progress=False)
    assert calls == [] and _hooks(zm.model) == hooks and not _kinds(zm.model)
    assert all(p.dtype == torch.float32 for p in zm.model.parameters())


# ---------------------------------------------------------------------------- tuning candidates "+fp8"

FAST = dict(steps=3, rounds=1, timed_steps=1)


def _counting(monkeypatch):
    """Counts the fp8 selections and the fp8 matmuls run."""
    from adaptive_amp.fp8 import execution, training

    calls = {"select": 0, "fp8": 0}
    select, forward = training.select_fp8_layers, execution.fp8_forward

    def counted_select(*args, **kwargs):
        calls["select"] += 1
        return select(*args, **kwargs)

    def counted_forward(*args, **kwargs):
        calls["fp8"] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(training, "select_fp8_layers", counted_select)
    monkeypatch.setattr(execution, "fp8_forward", counted_forward)
    return calls


def _state(zm, opt):
    return ({k: v.clone() for k, v in zm.model.state_dict().items()}, {n: p.dtype for n, p in
                                                                        zm.model.named_parameters()},
            _hooks(zm.model), torch.get_rng_state(), type(opt), [m.training for m in zm.model.modules()])


def _same_state(a, b):
    assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    assert a[1:3] == b[1:3] and torch.equal(a[3], b[3]) and a[4:] == b[4:]


def test_tuning_measures_the_fp8_map_once_and_every_fp8_candidate_trains_it(fp8_here, monkeypatch):
    from adaptive_amp.policy import AdaptivePrecisionSelector

    calls = _counting(monkeypatch)
    zm = zoo.build("llama", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    batches = [zm.make_batch(4, seed=i) for i in range(2)]
    before = _state(zm, opt)
    result = AdaptivePrecisionSelector().tune(zm.model, opt, batches, zm.loss,
                                              candidates=["fp32", "bf16", "bf16+fp8", "bf16-pure+fp8"],
                                              fp8=dict(gain_fn=_gains), **FAST)
    _same_state(before, _state(zm, opt))
    assert not _kinds(zm.model)
    assert calls["select"] == 1
    by = {t.name: t for t in result.trials}
    assert set(by) == {"fp32", "bf16", "bf16+fp8", "bf16-pure+fp8"} and result.skipped == []
    for name in ("bf16+fp8", "bf16-pure+fp8"):
        assert by[name].error is None and all(map(torch.isfinite, torch.tensor(by[name].losses))), by[name]
    # every matmul layer (7 a block, and the head) in fp8 in each fp8 trial's steps (the first is its probe)
    linears = [n for n, m in zm.model.named_modules() if isinstance(m, nn.Linear)]
    assert calls["fp8"] >= 2 * FAST["steps"] * len(linears)
    assert "fp8 selection" in result.phase_seconds
    if result.recipe.name.endswith("+fp8"):
        assert dict(result.policy.layers) == {n: "fp8-tensorwise" for n in linears}
        assert any(r.startswith(f"layer {linears[0]}: fp8-tensorwise") for r in result.policy.reasons)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_an_fp8_candidate_agrees_when_its_gradient_is_within_the_sampling_noise(compiled, fp8_here):
    """With no cosine good enough (min_cosine above 1), a recipe with fp8 layers still agrees when its first
    gradient lies nearer fp32's than one batch's sampling noise (the reference's gradients on two batches, over
    sqrt 2); a recipe without fp8 layers does not; noise_fraction=0 turns the rule off, and identical batches
    (no sampling noise) leave nothing within it."""
    from adaptive_amp.policy import AdaptivePrecisionSelector

    torch._dynamo.reset()
    zm = zoo.build("llama", "tiny", seed=0)
    model = torch.compile(zm.model, backend="eager") if compiled else zm.model
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    batches = [zm.make_batch(4, seed=i) for i in range(3)]
    cands = ["fp32", "bf16", "bf16+fp8"]

    def run(batches, **kw):
        result = AdaptivePrecisionSelector().tune(model, opt, batches, zm.loss, candidates=cands,
                                                  fp8=dict(gain_fn=_gains), min_cosine=1.5, **FAST, **kw)
        return result, {t.name: t for t in result.trials}

    result, by = run(batches)
    ref, bf16, fp8 = by["fp32"], by["bf16"], by["bf16+fp8"]
    assert result.reference == "fp32" and ref.grad_distance == 0.0 and 0 < ref.grad_noise < 2
    assert bf16.grad_noise is None and fp8.grad_noise is None
    # The fp8 candidate's first gradient is further from fp32's than bf16's, yet well within the noise.
    assert 0 < bf16.grad_distance < fp8.grad_distance < ref.grad_noise
    assert fp8.agrees and fp8.grad_cosine < 1.5 and fp8.within_noise and not ref.within_noise
    assert "(its gradient within the sampling noise)" in result.table()
    assert any(r.startswith("trial bf16+fp8:") and "gradient within the sampling noise" in r
               for r in result.policy.reasons), result.policy.reasons
    assert not bf16.agrees and bf16.verdict.startswith("disagrees: first-step gradient cosine")
    assert "sampling noise" not in bf16.verdict
    d = result.to_dict()
    assert [t["grad_noise"] for t in d["trials"]][0] == ref.grad_noise
    assert "grad dist" in result.table() and "sampling noise is" in result.table()

    _, off = run(batches, noise_fraction=0)
    assert not off["bf16+fp8"].agrees and "sampling noise" not in off["bf16+fp8"].verdict
    assert not off["bf16+fp8"].within_noise
    # The same noise, a bound tighter than fp8's distance: outside it.
    _, tight = run(batches, noise_fraction=0.01)
    assert not tight["bf16+fp8"].agrees and "> 0.01x the sampling noise" in tight["bf16+fp8"].verdict
    # One batch: no noise to measure, and the verdict says why the cosine alone judged.
    _, one = run(batches[:1])
    assert one["fp32"].grad_noise is None and not one["bf16+fp8"].agrees
    assert "the sampling-noise test needs two or more batches" in one["bf16+fp8"].verdict
    _, same = run([batches[0]] * 3)
    # (the reference's gradient is kept in bf16: its rounding is all the noise left)
    assert same["fp32"].grad_noise < 0.01 and not same["bf16+fp8"].agrees
    assert "> the sampling noise" in same["bf16+fp8"].verdict, same["bf16+fp8"].verdict
    assert all(m._forward_pre_hooks == {} for m in zm.model.modules()) and not _kinds(zm.model)
    # Without an fp8 candidate nothing is judged by the noise, and the second probe is not run.
    plain = AdaptivePrecisionSelector().tune(model, opt, batches, zm.loss, candidates=["fp32", "bf16"], **FAST)
    assert plain.trials[0].grad_noise is None and "sampling noise" not in plain.table()


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), True, "1"])
def test_a_bad_noise_fraction_is_refused_naming_it_before_any_trial(bad):
    from adaptive_amp.policy import AdaptivePrecisionSelector

    zm = zoo.build("llama", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    before = _state(zm, opt)
    with pytest.raises(ValueError, match="noise_fraction is"):
        AdaptivePrecisionSelector().tune(zm.model, opt, [zm.make_batch(2)], zm.loss, candidates=["fp32", "bf16"],
                                         noise_fraction=bad, **FAST)
    _same_state(before, _state(zm, opt))


def test_without_fp8_here_each_fp8_candidate_is_skipped_with_why_before_any_trial(monkeypatch):
    quiet_torchao()
    from adaptive_amp.policy import AdaptivePrecisionSelector, candidate_recipes

    calls = _counting(monkeypatch)
    zm = zoo.build("gpt2", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    batches = [zm.make_batch(4, seed=i) for i in range(2)]
    before = _state(zm, opt)
    result = AdaptivePrecisionSelector().tune(zm.model, opt, batches, zm.loss,
                                              candidates=["bf16", "bf16+fp8", "bf16-weights+bf16-moments+fp8+ckpt",
                                                          "bf16-pure+fp8"], **FAST)
    _same_state(before, _state(zm, opt))
    assert [t.name for t in result.trials] == ["bf16"] and calls == {"select": 1, "fp8": 0}
    assert [n for n, _ in result.skipped] == ["bf16+fp8", "bf16-weights+bf16-moments+fp8+ckpt", "bf16-pure+fp8"]
    assert all(why.startswith("no layer in fp8: fp8 matmuls need a CUDA GPU") for _, why in result.skipped)
    assert sum(r.startswith("trial bf16-pure+fp8: skipped: no layer in fp8") for r in result.policy.reasons) == 1
    # without a measurement at all (the selector's candidates alone), with why
    _, skipped = candidate_recipes(None, names=["bf16+fp8"])
    assert skipped == [("bf16+fp8", "its fp8 layers are measured on the model: AdaptivePrecisionSelector.tune "
                                    "measures them")]


@pytest.mark.parametrize("where, why", [
    ("torchao missing", "no layer in fp8: torchao is not installed"),
    ("no layer gains", "no layer in fp8: no layer gains and tolerates fp8 (15 measured: layer "),
])
def test_where_fp8_cannot_pay_each_fp8_candidate_is_skipped_with_why(fp8_here, monkeypatch, where, why):
    from adaptive_amp.fp8 import eligibility
    from adaptive_amp.policy import AdaptivePrecisionSelector

    zm = zoo.build("llama", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    fp8 = dict(gain_fn=lambda layer, shape, kind: 1.0)
    if where == "torchao missing":
        monkeypatch.setattr(eligibility, "torchao_missing", lambda: "torchao is not installed (test)")
        fp8 = None
    result = AdaptivePrecisionSelector().tune(zm.model, opt, [zm.make_batch(4, seed=0)], zm.loss,
                                              candidates=["bf16", "bf16+fp8", "bf16-pure+fp8+ckpt"], fp8=fp8,
                                              steps=2, rounds=1, timed_steps=1)
    assert [t.name for t in result.trials] == ["bf16"]
    assert [n for n, _ in result.skipped] == ["bf16+fp8", "bf16-pure+fp8+ckpt"]
    assert all(w.startswith(why) for _, w in result.skipped), result.skipped


def test_a_tuning_whose_fp8_candidates_all_train_bf16_weights_times_the_layers_from_bf16_weights(fp8_here):
    from adaptive_amp.policy import AdaptivePrecisionSelector

    zm = zoo.build("gpt2", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    batches = [zm.make_batch(4, seed=i) for i in range(2)]
    for candidates, dtype in ((["bf16-weights", "bf16-weights+fp8", "bf16-pure+fp8"], torch.bfloat16),
                              (["bf16", "bf16+fp8", "bf16-pure+fp8"], torch.float32)):
        timed = set()

        def gains(layer, shape, kind):
            timed.add(layer.weight.dtype)
            return _gains(layer, shape, kind)

        result = AdaptivePrecisionSelector().tune(zm.model, opt, batches, zm.loss, candidates=candidates,
                                                  fp8=dict(gain_fn=gains), steps=2, rounds=1, timed_steps=1)
        assert timed == {dtype} and [t.name for t in result.trials] == candidates


def test_bad_fp8_tuning_input_is_refused_by_name_with_nothing_changed(fp8_here, monkeypatch):
    from adaptive_amp.policy import AdaptivePrecisionSelector

    calls = _counting(monkeypatch)
    zm = zoo.build("llama", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    batches = [zm.make_batch(4, seed=0)]
    before = _state(zm, opt)
    tune = AdaptivePrecisionSelector().tune
    for kwargs, error, match in (
            (dict(candidates=["fp16+fp8"]), ValueError, "candidates 'fp16[+]fp8': fp8 stacks on bf16"),
            (dict(candidates=["bf16+fp8+moments"]), ValueError, "candidates 'bf16[+]fp8[+]moments' is unknown"),
            (dict(candidates=["bf16+fp8"], fp8=dict(run=zm.loss)), ValueError, "fp8: unknown key.*'run'"),
            (dict(candidates=["bf16+fp8"], fp8=[1]), TypeError, "fp8 is a list")):
        with pytest.raises(error, match=match):
            tune(zm.model, opt, batches, zm.loss, **kwargs, **FAST)
    _same_state(before, _state(zm, opt))
    assert calls["select"] == 0


def test_policy_tune_with_only_an_fp8_candidate_trains_it_under_the_controller(fp8_here):
    zm = zoo.build("llama", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    batches = [zm.make_batch(4, seed=i) for i in range(2)]
    amp = AdaptiveMixedPrecision(zm.model, opt, policy="tune", progress=False, stats_every=1,
                                 fp8=dict(gain_fn=_gains),
                                 tune=dict(batches=batches, loss_fn=zm.loss, candidates=["bf16-pure+fp8"], **FAST))
    assert amp.tuning.recipe.name == "bf16-pure+fp8" and amp.policy.pure
    assert set(amp.adjuster.layer_kinds.values()) == {"fp8-tensorwise"}
    assert isinstance(amp.optimizers[0], adaptive_amp.optim.AdamW)
    losses = _train(amp, zm, 3)
    assert all(map(torch.isfinite, torch.tensor(losses))) and len(amp._fp8_watch.rows) == 2 * 7 + 1
    assert all(p.dtype == torch.bfloat16 for p in zm.model.parameters())


# ---------------------------------------------------------------------------- MemoryGuard moves


def test_memory_guard_moves_keep_the_fp8_layers_and_undo_gives_the_fp32_weights_back(fp8_here):
    from adaptive_amp.layer_precision import applied_kinds
    from adaptive_amp.pressure import MemoryGuard
    from adaptive_amp.recipes import matmul_layers

    zm = zoo.build("llama", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    params = dict(zm.model.named_parameters())
    headroom = [10**9]
    amp = AdaptiveMixedPrecision(zm.model, opt, policy="bf16+fp8", stats_every=1, progress=False,
                                 fp8=dict(gain_fn=_gains, batches=[zm.make_batch(4, seed=0)],
                                          run=lambda m, b: zm.loss(m, b)),
                                 memory_guard=MemoryGuard(min_free=1000, check_every=1, reader=lambda: headroom[0],
                                                          allow_recover=True, recover_after=2))
    start, kinds, layers = str(amp.policy), dict(amp.adjuster.layer_kinds), amp.policy.layers
    assert len(kinds) == 15 and set(kinds.values()) == {"fp8-tensorwise"}

    def steps(n):
        return [float(amp.train_step(lambda i=i: zm.loss(zm.model, zm.make_batch(4, seed=i % 2)))) for i in range(n)]

    steps(2)
    headroom[0] = 10  # pressure: one move after each step
    losses = steps(4)
    assert [m.name for m in amp.memory_guard.moves] == ["bf16-moments", "bf16-weights", "checkpoint"]
    assert all(map(torch.isfinite, torch.tensor(losses)))
    # fp8 layers stay fp8, now over bf16 weights, guarded (a row each, no event), blocks checkpointed
    assert amp.adjuster.layer_kinds == kinds and amp.policy.layers == layers
    assert amp.policy.param_dtype == torch.bfloat16 and amp.policy.param_scope == "matmul"
    matmul = {id(p) for _, m in matmul_layers(zm.model) for p in m.parameters(recurse=False)}
    assert {p.dtype for p in zm.model.parameters() if id(p) in matmul} == {torch.bfloat16}
    assert len(amp._fp8_watch.rows) == 15 and all(r["error"] < 0.15 for r in amp._fp8_watch.rows)
    assert not [e for e in amp.events if e.kind.startswith("fp8")]
    assert all("checkpoint" in dict(applied_kinds(b)) for b in zm.model.model.layers)
    headroom[0] = 10**9  # memory frees up: each move undone after 2 steps of headroom
    steps(12)
    assert not amp.memory_guard.moves and str(amp.policy) == start
    assert amp.adjuster.layer_kinds == kinds and all(p is params[n] for n, p in zm.model.named_parameters())
    assert all(p.dtype == torch.float32 for p in zm.model.parameters())
    assert amp.optimizers[0] is opt and type(opt) is torch.optim.AdamW
    assert all(math.isfinite(v) for v in steps(2))
    amp.remove()
    assert not _kinds(zm.model)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("base", ["bf16-weights", "bf16-pure"])
def test_fp8_presets_train_on_the_gpu(base, compiled):
    """On a GPU with fp8 matmuls: a tiny Llama's layers in fp8 (a gain table: they are too small to gain) over
    bf16 weights, eager and compiled with inductor, train and raise no guard event; without a measurement
    table, where the GPU has no fp8 matmuls, every layer stays as it was, with the reason."""
    quiet_torchao()
    from adaptive_amp import fp8

    zm = zoo.build("llama", "tiny", seed=0, device="cuda")
    opt = _sr_adamw(zm.model)
    batch = zm.make_batch(8, seed=0, device="cuda")
    options = dict(batches=[batch], run=lambda m, b: zm.loss(m, b))
    why = fp8.fp8_unavailable("cuda")
    if why is not None:
        amp = AdaptiveMixedPrecision(zm.model, opt, policy=f"{base}+fp8", progress=False, fp8=options)
        assert amp.policy.layers == () and sum(why in r for r in amp.policy.reasons) == 15
        return
    amp = AdaptiveMixedPrecision(zm.model, opt, policy=f"{base}+fp8", stats_every=2, progress=False,
                                 fp8=dict(gain_fn=_gains, **options))
    assert len(amp.adjuster.layer_kinds) == 15
    model = torch.compile(zm.model) if compiled else zm.model
    losses = controller_losses(amp, zm, model, steps=20, device="cuda")
    assert losses[-1] < losses[0] and all(map(math.isfinite, losses))
    assert not [e for e in amp.events if e.kind.startswith("fp8")] and len(amp._fp8_watch.rows) == 15
