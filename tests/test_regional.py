"""Statistics steps of a model compiled whole run its repeated blocks compiled (adaptive_amp.regional): one block
graph for the statistics steps instead of a second whole-model compile, with the eager model's statistics.

Compiled with the "aot_eager" backend (dynamo and AOT autograd as with inductor, without code generation).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from adaptive_amp import zoo  # noqa: E402
from adaptive_amp.controller import AdaptiveMixedPrecision  # noqa: E402
from adaptive_amp.hardware import Capabilities  # noqa: E402
from adaptive_amp.recipes import find_blocks  # noqa: E402
from adaptive_amp.regional import RegionalStatistics  # noqa: E402

from conftest import counting_aot_eager  # noqa: E402

pytestmark = pytest.mark.skipif(getattr(torch.compiler, "set_stance", None) is None,
                                reason="torch.compiler.set_stance (torch >= 2.6)")

CPU_BF16 = Capabilities(device_type="cpu", name="test cpu with bf16", bf16=True, fp16=True)
BF16 = "params=float32,compute=bfloat16"


def train(zm, model, steps, **kwargs):
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = AdaptiveMixedPrecision(model, opt, policy=BF16, capabilities=CPU_BF16, progress=False, read_every=2,
                                     stats_every=2, **kwargs)
    for i in range(steps):
        batch = zm.make_batch(2, seed=i)
        amp.train_step(lambda b=batch: zm.loss(model, b))
    amp.events.extend(amp.monitor.read())
    return amp


def rows_at(amp, step):
    return {ls.kind: [(r["name"], r["amax"], r["numel"]) for r in ls.rows]
            for ls in amp.monitor.layer_stats if ls.step == step}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_compiled_whole_compiles_one_block_for_its_statistics_steps(family):
    zm = zoo.build(family, seed=0)
    reference = copy.deepcopy(zm)
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(zm.model, backend=counting_aot_eager(graphs))
    amp = train(zm, compiled, 5)
    blocks = find_blocks(zm.model)
    assert len(blocks) >= 2
    # Statistics at steps 0, 2 and 4; two graphs in all: one block's (the statistics steps, every block) and the
    # whole model's (the other steps), none compiled again.
    assert sorted({ls.step for ls in amp.monitor.layer_stats}) == [0, 2, 4]
    assert len(graphs) == 2 and graphs[0] < graphs[1], graphs
    # The statistics of step 0 (the same weights) are the eager model's.
    eager = train(reference, reference.model, 1)
    ours, theirs = rows_at(amp, 0), rows_at(eager, 0)
    assert set(ours) == set(theirs) == {"activation", "input", "gradient"}
    for kind in ours:
        assert [r[0] for r in ours[kind]] == [r[0] for r in theirs[kind]], kind
        for a, b in zip(ours[kind], theirs[kind]):
            assert a[2] == b[2] and a[1] == pytest.approx(b[1], rel=1e-3, abs=1e-6), (kind, a[0])
    assert all(b._compiled_call_impl is None for _, b in blocks)  # as they were between statistics steps
    amp.remove()


def test_blocks_compiled_on_their_own_and_eager_models_keep_their_path():
    zm = zoo.build("gpt2", seed=0)
    assert RegionalStatistics(zm.model).blocks() == []  # eager: nothing compiled
    torch._dynamo.reset()
    whole = torch.compile(zm.model, backend="aot_eager")
    assert len(RegionalStatistics(whole).blocks()) == len(find_blocks(zm.model))
    with torch.compiler.set_stance("force_eager"):  # the user's stance wins
        assert RegionalStatistics(whole).blocks() == []
    for _, block in find_blocks(zm.model):
        block.compile(backend="aot_eager")
    assert RegionalStatistics(whole).blocks() == []  # the blocks compile on their own already


def test_a_statistics_step_that_raises_leaves_the_blocks_and_the_stance_as_they_were():
    from adaptive_amp.regional import _stance

    zm = zoo.build("llama", seed=0)
    torch._dynamo.reset()
    whole = torch.compile(zm.model, backend="aot_eager")
    regional = RegionalStatistics(whole)
    with pytest.raises(RuntimeError, match="the forward failed"):
        with regional.step() as blocks:
            assert blocks and all(b._compiled_call_impl is not None for b in blocks)
            assert _stance() == "force_eager"
            raise RuntimeError("the forward failed")
    assert _stance() == "default"
    assert all(b._compiled_call_impl is None for _, b in find_blocks(zm.model))


def test_a_forward_replaced_by_a_compiled_one_counts_as_compiled_whole():
    # Lightning's from_compiled (what trainer.fit does with a torch.compile'd LightningModule) replaces the
    # instance's forward with a compiled one; a forward wrapped by something else keeps the eager path.
    import functools

    zm = zoo.build("llama", seed=0)
    model = zm.model
    eager_forward = model.forward

    class Hook:
        callback = staticmethod(lambda *a: None)  # looks like a context to a closure scan, is not dynamo's

    hook = Hook()

    @functools.wraps(eager_forward)
    def wrapped(*args, **kwargs):
        assert hook is not None
        return eager_forward(*args, **kwargs)

    model.forward = wrapped
    assert RegionalStatistics(model).blocks() == []
    model.forward = torch.compiler.disable(eager_forward)  # a dynamo context too, that compiles nothing
    assert RegionalStatistics(model).blocks() == []
    torch._dynamo.reset()
    model.forward = torch.compile(eager_forward, backend="aot_eager")
    assert len(RegionalStatistics(model).blocks()) == len(find_blocks(model)) >= 2
    del model.forward
    assert RegionalStatistics(model).blocks() == []


def test_what_runs_compiled_is_what_the_layers_are_timed_as():
    # fp8 maps time a model's layers compiled where the model runs compiled (layers.is_compiled): a wrapper, a
    # module compiled in place, Lightning's compiled module, a compiled forward; not a module that
    # torch.compiler.disable wrapped (it runs eagerly: fp8 timed compiled would be judged faster than it runs).
    # A tuning screens eagerly and compiles its finalists itself (tune.times_compiled) for a wrapper or modules
    # compiled in place, whose compiled calls it can set aside; a model compiled otherwise runs its trials as is.
    from adaptive_amp.layers import compiled_whole, is_compiled
    from adaptive_amp.tune import times_compiled

    zm = zoo.build("llama", seed=0)
    model = zm.model
    torch._dynamo.reset()
    assert not is_compiled(model) and not times_compiled(model) and compiled_whole(model) == (False, None)
    wrapper = torch.compile(model, backend="aot_eager")
    assert is_compiled(wrapper) and times_compiled(wrapper) and compiled_whole(wrapper) == (True, wrapper.dynamo_ctx)
    disabled = torch.compiler.disable(model)
    assert not is_compiled(disabled) and not times_compiled(disabled) and compiled_whole(disabled) == (False, None)
    model._compiler_ctx = {"compiler": "dynamo", "dynamo_ctx": wrapper.dynamo_ctx}  # what from_compiled leaves
    assert is_compiled(model) and compiled_whole(model)[1] is wrapper.dynamo_ctx and not times_compiled(model)
    del model._compiler_ctx
    find_blocks(model)[0][1].compile(backend="aot_eager")  # one block in place: compiled, not whole
    assert is_compiled(model) and times_compiled(model) and not compiled_whole(model)[0]
    # Under a torch.compiler.disable wrapper a block compiled in place still runs compiled (its own compiled call
    # replaces the wrapper's context), so the model counts as compiled, and a tuning compiles its finalists.
    disabled = torch.compiler.disable(model)
    assert is_compiled(disabled) and times_compiled(disabled)
    graphs = []
    torch._dynamo.reset()
    find_blocks(model)[0][1].compile(backend=counting_aot_eager(graphs))
    with torch.no_grad():
        disabled(**zm.make_batch(1, seed=0))
    assert len(graphs) == 1, graphs


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blocks_handed_a_key_value_cache_run_eagerly_at_statistics_steps(family):
    # With config.use_cache on, transformers hands every block the cache, and each block fills its own layer of
    # it: a shared block graph would compile once per block. The statistics steps run the blocks eagerly instead.
    zm = zoo.build(family, seed=0)
    zm.model.config.use_cache = True
    reference = copy.deepcopy(zm)
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(zm.model, backend=counting_aot_eager(graphs))
    with pytest.warns(UserWarning, match="model.config.use_cache = False"):
        amp = train(zm, compiled, 5)
    assert len(find_blocks(zm.model)) >= 2
    assert sorted({ls.step for ls in amp.monitor.layer_stats}) == [0, 2, 4]
    assert len(graphs) == 1, graphs  # the whole model's, for the ordinary steps; nothing for the statistics steps
    eager = train(reference, reference.model, 1)
    ours, theirs = rows_at(amp, 0), rows_at(eager, 0)
    assert set(ours) == set(theirs) == {"activation", "input", "gradient"}
    for kind in ours:
        assert [(r[0], r[2]) for r in ours[kind]] == [(r[0], r[2]) for r in theirs[kind]], kind
        for a, b in zip(ours[kind], theirs[kind]):
            assert a[1] == pytest.approx(b[1], rel=1e-3, abs=1e-6), (kind, a[0])
    amp.remove()


def test_a_statistics_step_traced_by_the_users_compile_keeps_the_whole_graph():
    # amp.autocast() inside a function the user compiles: the statistics step's context is traced, and must not
    # read what dynamo cannot trace (a model compiled in place: its compiled call's closure).
    zm = zoo.build("llama", seed=0)
    torch._dynamo.reset()
    zm.model.compile(backend="eager")
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = AdaptiveMixedPrecision(zm.model, opt, policy=BF16, capabilities=CPU_BF16, progress=False,
                                     read_every=2, stats_every=2)

    @torch.compile(backend="eager")
    def forward_loss(batch):
        with amp.autocast():
            return zm.loss(zm.model, batch)

    for i in range(3):
        amp.backward(forward_loss(zm.make_batch(2, seed=i)))
        amp.step()
        amp.zero_grad()
    assert sorted({ls.step for ls in amp.monitor.layer_stats}) == [0, 2]
    assert all(b._compiled_call_impl is None for _, b in find_blocks(zm.model))
    amp.remove()
