"""Tuning a compiled model (adaptive_amp.tune, "Compiled models"): an eager screen, then only the finalists'
repeated blocks compiled and timed, and the user's compiled model left as it was."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from functorch.compile import make_boxed_func  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

from adaptive_amp import zoo  # noqa: E402
from adaptive_amp.hardware import Capabilities  # noqa: E402
from adaptive_amp.policy import AdaptivePrecisionSelector  # noqa: E402
from adaptive_amp.recipes import find_blocks  # noqa: E402
from adaptive_amp.tune import Tuner, _call_block, compiled_blocks  # noqa: E402

from conftest import assert_bitwise_equal, requires_cuda  # noqa: E402

CPU = Capabilities(device_type="cpu", name="test cpu", bf16=True)
tune = AdaptivePrecisionSelector().tune
FOUR = ["fp32", "bf16", "bf16-weights", "bf16-pure"]


def _counting():
    """A backend (aot_eager's kernels) that lists every graph it compiles ("fw" or "bw")."""
    graphs = []

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            graphs.append(kind)
            return make_boxed_func(gm.forward)
        return compile_graph
    return aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw")), graphs


def _setup(family="llama"):
    torch._dynamo.reset()
    zm = zoo.build(family, "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=3e-3)
    batches = [zm.make_batch(4, seed=i) for i in range(3)]
    return zm, opt, batches


def _timed(monkeypatch, zm, eager_ms: dict, compiled_ms: dict, eager_out_of_memory=()):
    """A loss_fn, and the tuning's step timer replaced by one that reports each recipe's step time from
    `eager_ms` or `compiled_ms` (as its blocks run): the choice without the timing noise of a shared CPU. A
    recipe is named by its dtypes, then "+fp8" with fp8 layers and "+ckpt" with its blocks checkpointed; those in
    `eager_out_of_memory` run out of memory when their blocks are not compiled."""
    from adaptive_amp import tune as tune_module
    from adaptive_amp.layer_precision import applied_kinds
    from adaptive_amp.recipes import matmul_layers

    layer = matmul_layers(zm.model)[-1][1]
    norm = next(p for p in zm.model.parameters() if p.dim() == 1)
    block = find_blocks(zm.model)[0][1]
    last = {}

    def loss_fn(model, batch):
        kinds = [k for k, _ in applied_kinds(layer)] + [k for k, _ in applied_kinds(block)]
        last["name"] = (("bf16-pure" if norm.dtype == torch.bfloat16 else "bf16-weights"
                         if layer.weight.dtype == torch.bfloat16 else "bf16" if torch.is_autocast_enabled("cpu")
                         else "fp32") + ("+fp8" if any(k.startswith("fp8-") for k in kinds) else "")
                        + ("+ckpt" if "checkpoint" in kinds else ""))
        last["compiled"] = block._compiled_call_impl is not None
        if last["name"] in eager_out_of_memory and not last["compiled"]:
            raise torch.OutOfMemoryError("CUDA out of memory (planted: the eager step saves too much)")
        return zm.loss(model, batch)

    class Timer:
        def __init__(self, device):
            self.marks = []

        def start(self):
            return None

        def stop(self, start):
            self.marks.append((compiled_ms if last["compiled"] else eager_ms)[last["name"]])

        def times_ms(self):
            return list(self.marks)
    monkeypatch.setattr(tune_module, "_Timer", Timer)
    return loss_fn


def _cache_entries() -> int:
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(_call_block.__code__))


def _state(zm, opt):
    out = {f"param {n}": p.detach().clone() for n, p in zm.model.state_dict(keep_vars=True).items()}
    out.update({f"state {i} {k}": v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()})
    return out


@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_compiled_tuning_runs_every_trajectory_eagerly_and_compiles_only_the_finalists(family, monkeypatch):
    zm, opt, batches = _setup(family)
    zm.loss(zm.model, batches[0]).backward()  # some optimizer state and gradients to leave as they were
    opt.step()
    backend, graphs = _counting()
    compiled = torch.compile(zm.model, backend=backend)
    before = _state(zm, opt)
    # Eagerly bf16-pure is twice as fast as bf16 autocast; compiled, bf16-weights is the fastest.
    loss_fn = _timed(monkeypatch, zm, {"fp32": 10, "bf16": 8, "bf16-weights": 6, "bf16-pure": 4},
                     {"fp32": 5, "bf16": 3, "bf16-weights": 2.5, "bf16-pure": 2.9})
    result = tune(compiled, opt, batches, loss_fn, capabilities=CPU, candidates=FOUR, steps=3, rounds=2,
                  timed_steps=2)
    by = {t.name: t for t in result.trials}
    assert list(by) == FOUR and all(t.error is None and len(t.losses) == 3 for t in by.values())
    # The screen compiled nothing: each finalist (the fastest of the lowest bf16 extent, and of the next that
    # beats it eagerly) compiled one forward and one backward graph, which all its blocks share.
    assert graphs == ["fw", "bw"] * 2 and [n for n in FOUR if by[n].step_times_ms] == ["bf16", "bf16-weights"]
    assert "not compiled" in by["fp32"].verdict and by["fp32"].step_time_ms is None
    assert by["bf16-pure"].verdict.startswith("agrees; not compiled: to be chosen it would have to be")
    assert [t.eager_step_times_ms for t in by.values()] == [[10, 10], [8, 8], [6, 6], [4, 4]]
    assert by["bf16-weights"].step_times_ms == [2.5] * 4  # rounds * timed_steps
    assert result.recipe.name == "bf16-weights"
    assert result.compile_seconds > 0 and "compiled timing" in result.phase_seconds
    assert "then bf16, bf16-weights timed with the blocks compiled" in result.timing
    assert "eager ms/step" in result.table() and "timing: eager screen" in result.table()
    assert result.to_dict()["trials"][0]["eager_step_time_ms"] == 10
    # The user's compiled model as it was: weights and optimizer state bitwise, no block compiled, no graph left.
    after = _state(zm, opt)
    assert before.keys() == after.keys()
    for k in before:
        assert_bitwise_equal(before[k], after[k], k)
    assert all(m._compiled_call_impl is None for m in zm.model.modules()) and _cache_entries() == 0
    assert all(p.dtype == torch.float32 for p in zm.model.parameters())
    torch.testing.assert_close(zm.loss(compiled, batches[0]), zm.loss(zm.model, batches[0]))


def test_with_no_state_margin_every_extent_that_beats_the_lower_ones_is_a_finalist(monkeypatch):
    zm, opt, batches = _setup()
    loss_fn = _timed(monkeypatch, zm, {"fp32": 10, "bf16": 8, "bf16-weights": 6, "bf16-pure": 4},
                     {"fp32": 5, "bf16": 3, "bf16-weights": 2.5, "bf16-pure": 2.4})
    backend, graphs = _counting()
    result = tune(torch.compile(zm.model, backend=backend), opt, batches, loss_fn, capabilities=CPU,
                  candidates=FOUR, steps=3, rounds=1, timed_steps=1, state_margin=0)
    assert graphs == ["fw", "bw"] * 3 and result.recipe.name == "bf16-pure"


def test_compiled_times_decide_where_they_reverse_the_eager_ones(monkeypatch):
    # As GPT-2 small measured on an H200: bf16-pure faster than bf16 autocast eagerly, slower compiled. Torch's
    # recipe is always a finalist, so the tuning does not lose to it.
    zm, opt, batches = _setup()
    loss_fn = _timed(monkeypatch, zm, {"fp32": 10, "bf16": 8, "bf16-pure": 5}, {"fp32": 5, "bf16": 3, "bf16-pure": 3.6})
    result = tune(torch.compile(zm.model, backend="aot_eager"), opt, batches, loss_fn, capabilities=CPU,
                  candidates=["fp32", "bf16", "bf16-pure"], steps=3, rounds=1, timed_steps=1)
    assert result.recipe.name == "bf16" and result.trials[2].verdict.startswith("agrees, slower (3.6 ms")


def test_compiled_tuning_chooses_what_eager_tuning_chooses_when_the_answer_is_clear(monkeypatch):
    zm, opt, batches = _setup()
    loss_fn = _timed(monkeypatch, zm, {"fp32": 10, "bf16-pure": 4}, {"fp32": 5, "bf16-pure": 2})
    eager = tune(zm.model, opt, batches, loss_fn, capabilities=CPU, candidates=["fp32", "bf16-pure"], steps=3,
                 rounds=1, timed_steps=1)
    backend, graphs = _counting()
    result = tune(torch.compile(zm.model, backend=backend), opt, batches, loss_fn, capabilities=CPU,
                  candidates=["fp32", "bf16-pure"], steps=3, rounds=1, timed_steps=1)
    assert eager.recipe.name == result.recipe.name == "bf16-pure" and graphs == ["fw", "bw"] * 2
    assert [t.losses for t in eager.trials] == [t.losses for t in result.trials]  # the same eager trajectories
    assert not eager.trials[0].eager_step_times_ms and eager.timing.startswith("eager:")


def test_a_lone_finalist_is_chosen_without_compiling(monkeypatch):
    # bf16-pure, slower in the screen, is not a finalist: fp32 is chosen on its eager times, nothing compiled.
    zm, opt, batches = _setup()
    loss_fn = _timed(monkeypatch, zm, {"fp32": 4, "bf16-pure": 10}, {})
    backend, graphs = _counting()
    result = tune(torch.compile(zm.model, backend=backend), opt, batches, loss_fn, capabilities=CPU,
                  candidates=["fp32", "bf16-pure"], steps=3, rounds=1, timed_steps=1)
    assert result.recipe.name == "fp32" and not graphs and result.compile_seconds == 0
    assert "no compiled timing" in result.timing and "not compiled" in result.trials[1].verdict
    assert result.trials[0].step_times_ms == result.trials[0].eager_step_times_ms == [4, 4]


def test_eager_tuning_compiles_nothing(monkeypatch):
    from adaptive_amp import tune as tune_module

    zm, opt, batches = _setup()
    monkeypatch.setattr(tune_module, "compiled_blocks", lambda *a, **k: pytest.fail("eager models compile nothing"))
    result = tune(zm.model, opt, batches, zm.loss, capabilities=CPU, candidates=["fp32", "bf16-pure"], steps=3,
                  rounds=2, timed_steps=1)
    assert not result.compiled and result.compile_seconds == 0
    assert all(not t.eager_step_times_ms and t.step_times_ms for t in result.trials)


def test_compiled_blocks_share_one_graph_and_are_undone():
    zm, _, batches = _setup()
    blocks = [b for _, b in find_blocks(zm.model)]
    assert len(blocks) >= 2
    backend, graphs = _counting()
    expected = zm.loss(zm.model, batches[0])
    theirs = object()  # a block the user compiled gets its own compiled call back
    blocks[0]._compiled_call_impl = theirs
    try:
        with compiled_blocks(zm.model, backend) as n:
            assert n == len(blocks) and all(b._compiled_call_impl is not None for b in blocks)
            zm.loss(zm.model, batches[0]).backward()
            loss = zm.loss(zm.model, batches[0])
            assert _cache_entries() == 1
        assert graphs == ["fw", "bw"]  # one graph for every block
        torch.testing.assert_close(loss, expected)
        assert blocks[0]._compiled_call_impl is theirs and all(b._compiled_call_impl is None for b in blocks[1:])
        assert _cache_entries() == 0
    finally:
        blocks[0]._compiled_call_impl = None


def test_the_finalists_compile_with_the_users_backend():
    zm, opt, batches = _setup()
    backend, _ = _counting()
    tuner = Tuner(torch.compile(zm.model, backend=backend), opt, batches, zm.loss, CPU,
                  AdaptivePrecisionSelector().candidates(CPU, None, ["fp32"])[0])
    assert tuner.compiled and tuner.module is zm.model and tuner.backend.compiler_fn is backend
    assert Tuner(zm.model, opt, batches, zm.loss, CPU,
                 AdaptivePrecisionSelector().candidates(CPU, None, ["fp32"])[0]).module is zm.model


@pytest.mark.cuda
@requires_cuda
def test_compiled_tuning_on_a_gpu_with_inductor_leaves_the_model_as_it_was():
    # What the H200 runs at scale, on a tiny Llama: inductor's block graphs, CUDA-event timing, the eager peak as
    # the memory, and the user's compiled model as it was afterwards.
    from adaptive_amp.hardware import HardwareDetector

    torch._dynamo.reset()
    zm = zoo.build("llama", "tiny", seed=0, device="cuda")
    opt = torch.optim.AdamW(zm.model.parameters(), lr=3e-3)
    batches = [zm.make_batch(4, seed=i, device="cuda") for i in range(3)]
    compiled = torch.compile(zm.model)
    before = _state(zm, opt)
    result = tune(compiled, opt, batches, zm.loss, capabilities=HardwareDetector().detect(torch.device("cuda")),
                  candidates=FOUR, steps=3, rounds=1, timed_steps=2)
    assert result.compiled and all(t.error is None for t in result.trials)
    assert all(t.peak_bytes and t.eager_step_times_ms for t in result.trials)
    assert result.chosen.step_times_ms and result.timing.startswith("eager screen")
    after = _state(zm, opt)
    for k in before:
        assert_bitwise_equal(before[k], after[k], k)
    assert all(m._compiled_call_impl is None for m in zm.model.modules()) and _cache_entries() == 0
    torch.testing.assert_close(zm.loss(compiled, batches[0]), zm.loss(zm.model, batches[0]))


def test_blocks_compiled_in_place_are_screened_eagerly_and_put_back(monkeypatch):
    """``block.compile()`` on each repeated block (how large models are often compiled): the screen compiles
    nothing, the finalists compile with the blocks' own backend, and each block's compiled call is put back."""
    zm, opt, batches = _setup()
    backend, graphs = _counting()
    blocks = [b for _, b in find_blocks(zm.model)]
    for b in blocks:
        b.compile(backend=backend)
    impls = [b._compiled_call_impl for b in blocks]
    loss_fn = _timed(monkeypatch, zm, {"fp32": 10, "bf16": 8, "bf16-weights": 6, "bf16-pure": 4},
                     {"fp32": 5, "bf16": 3, "bf16-weights": 2.5, "bf16-pure": 2.9})
    result = tune(zm.model, opt, batches, loss_fn, capabilities=CPU, candidates=FOUR, steps=3, rounds=2,
                  timed_steps=2)
    assert result.compiled and graphs == ["fw", "bw"] * 2  # the two finalists, with the blocks' backend
    assert result.recipe.name == "bf16-weights" and "timed with the blocks compiled" in result.timing
    assert [b._compiled_call_impl for b in blocks] == impls and _cache_entries() == 0
    graphs.clear()
    zm.loss(zm.model, batches[0]).backward()  # the user's own compiled blocks, as before the tuning
    assert graphs == ["fw", "bw"]


def test_an_eager_out_of_memory_beside_a_checkpointed_finalist_is_timed_compiled_and_can_win(monkeypatch):
    """As on the Llama-3-8B shape on an H200: bf16 autocast ran out of memory in the eager screen, which only
    its checkpointed twin passed; compiled, it fits. It is timed compiled first, takes the twin's agreement (the
    same arithmetic) and is chosen; the twin, which only adds the recomputed forward, is not compiled."""
    zm, opt, batches = _setup()
    before = _state(zm, opt)
    loss_fn = _timed(monkeypatch, zm, {"fp32": 10, "bf16+ckpt": 9},
                     {"fp32": 5, "bf16": 3, "bf16+ckpt": 4}, eager_out_of_memory=("bf16",))
    backend, graphs = _counting()
    result = tune(torch.compile(zm.model, backend=backend), opt, batches, loss_fn, capabilities=CPU,
                  candidates=["fp32", "bf16"], steps=3, rounds=1, timed_steps=1)
    by = {t.name: t for t in result.trials}
    assert list(by) == ["fp32", "bf16", "bf16+ckpt"]
    bf16, twin = by["bf16"], by["bf16+ckpt"]
    assert twin.agrees and twin.step_times_ms == [] and twin.eager_step_times_ms
    assert twin.verdict == ("agrees; not compiled: bf16 ran compiled without checkpointing and fits, and "
                            "checkpointing only adds the recomputed forward")
    assert bf16.error is None and bf16.fits and bf16.agrees and bf16.agreement_from == "bf16+ckpt"
    assert bf16.losses == twin.losses and bf16.grad_cosine == twin.grad_cosine and bf16.step_times_ms == [3]
    assert not bf16.eager_step_times_ms and result.recipe.name == "bf16" and graphs == ["fw", "bw"]
    assert "the loss and gradient agreement are bf16+ckpt's" in result.table()
    assert result.to_dict()["trials"][1]["agreement_from"] == "bf16+ckpt"
    after = _state(zm, opt)
    for k in before:
        assert_bitwise_equal(before[k], after[k], k)
    assert all(m._compiled_call_impl is None for m in zm.model.modules())


@pytest.mark.parametrize("compiled_peak", ["out of memory", "over the budget"])
def test_an_eager_out_of_memory_that_does_not_fit_compiled_either_stays_out(compiled_peak, monkeypatch):
    from adaptive_amp import tune as tune_module

    zm, opt, batches = _setup()
    loss_fn = _timed(monkeypatch, zm, {"fp32": 10, "bf16+ckpt": 9}, {"fp32": 5, "bf16": 3, "bf16+ckpt": 4},
                     eager_out_of_memory=("bf16",))
    real = tune_module.Tuner._time_compiled

    def time_compiled(self, recipe, trial, offset):
        peak = real(self, recipe, trial, offset)
        if recipe.name != "bf16":
            return peak
        if compiled_peak == "out of memory":
            raise torch.OutOfMemoryError("CUDA out of memory (planted: compiled too)")
        return 2**40  # a CUDA peak of 1 TiB

    monkeypatch.setattr(tune_module.Tuner, "_time_compiled", time_compiled)
    result = tune(torch.compile(zm.model, backend="eager"), opt, batches, loss_fn, capabilities=CPU,
                  candidates=["fp32", "bf16"], steps=3, rounds=1, timed_steps=1, memory_budget="100GiB")
    by = {t.name: t for t in result.trials}
    if compiled_peak == "out of memory":
        assert by["bf16"].error.startswith("out of memory eagerly, then out of memory while timed compiled")
        assert by["bf16"].agreement_from is None
    else:
        assert by["bf16"].error is None and by["bf16"].agreement_from == "bf16+ckpt" and not by["bf16"].fits
        assert by["bf16"].verdict == "does not fit the budget compiled: 1024.00 GiB > 100.00 GiB"
    assert by["bf16"].fits is False and result.recipe.name == "bf16+ckpt"


@pytest.mark.parametrize("pure_ms, pure_eager, chosen", [(1.5, 18, "bf16-pure+fp8"), (1.9, 18, "bf16+fp8"),
                                                          (1.5, 19.2, "bf16-pure+fp8")])
def test_fp8_candidates_are_ranked_apart_however_slow_eagerly(pure_ms, pure_eager, chosen, fp8_here, monkeypatch):
    """Eagerly torchao's casts are kernels of their own and fp8 loses; compiled it gains. fp8 candidates are
    ranked among themselves (the lowest bf16 extent's always, and the fastest of those keeping more in bf16 when
    faster at all eagerly: the casts, the same in each, dilute what bf16 gains compiled), and timed compiled
    beside the others' finalists; one keeping more in bf16 is chosen only when more than state_margin faster
    compiled."""
    from conftest import quiet_torchao

    quiet_torchao()
    zm, opt, batches = _setup()
    eager = {"fp32": 10, "bf16": 8, "bf16+fp8": 20, "bf16-weights+fp8": 19.5, "bf16-pure+fp8": pure_eager}
    loss_fn = _timed(monkeypatch, zm, eager, {"fp32": 5, "bf16": 3, "bf16+fp8": 2, "bf16-pure+fp8": pure_ms})
    result = tune(torch.compile(zm.model, backend="eager"), opt, batches, loss_fn, candidates=list(eager),
                  fp8=dict(gain_fn=lambda *a: 1.4), steps=3, rounds=1, timed_steps=1, min_cosine=0.0)
    by = {t.name: t for t in result.trials}
    assert all(by[n].agrees for n in by), [(n, t.verdict) for n, t in by.items()]
    assert [n for n in by if by[n].step_times_ms] == ["bf16", "bf16+fp8", "bf16-pure+fp8"]
    assert by["bf16-weights+fp8"].verdict == (f"agrees; not compiled: eager 19.5 ms/step against {pure_eager:g} for "
                                              "bf16-pure+fp8, compiled instead of it among those keeping more in "
                                              "bf16 than bf16+fp8")
    assert result.recipe.name == chosen


@pytest.mark.parametrize("state_margin, compiled, chosen", [
    (0.1, ["bf16", "bf16+fp8", "bf16-weights+fp8"], "bf16-weights+fp8"),  # within tie: the safer is compiled
    (0.0, ["bf16", "bf16+fp8", "bf16-weights+fp8", "bf16-pure+fp8"], "bf16-pure+fp8")])  # the fastest wins
def test_fp8_finalists_within_tie_and_without_a_state_margin(state_margin, compiled, chosen, fp8_here, monkeypatch):
    from conftest import quiet_torchao

    quiet_torchao()
    zm, opt, batches = _setup()
    eager = {"fp32": 10, "bf16": 8, "bf16+fp8": 20, "bf16-weights+fp8": 19.5, "bf16-pure+fp8": 19.45}
    loss_fn = _timed(monkeypatch, zm, eager, {"fp32": 5, "bf16": 3, "bf16+fp8": 2, "bf16-weights+fp8": 1.6,
                                              "bf16-pure+fp8": 1.5})
    result = tune(torch.compile(zm.model, backend="eager"), opt, batches, loss_fn, candidates=list(eager),
                  fp8=dict(gain_fn=lambda *a: 1.4), steps=3, rounds=1, timed_steps=1, min_cosine=0.0,
                  state_margin=state_margin)
    by = {t.name: t for t in result.trials}
    assert [n for n in by if by[n].step_times_ms] == compiled
    assert result.recipe.name == chosen


def test_an_fp8_candidate_keeping_more_in_bf16_is_not_compiled_when_not_faster_eagerly(fp8_here, monkeypatch):
    from conftest import quiet_torchao

    quiet_torchao()
    zm, opt, batches = _setup()
    eager = {"fp32": 10, "bf16": 8, "bf16+fp8": 20, "bf16-pure+fp8": 20.5}
    loss_fn = _timed(monkeypatch, zm, eager, {"fp32": 5, "bf16": 3, "bf16+fp8": 2, "bf16-pure+fp8": 1.5})
    result = tune(torch.compile(zm.model, backend="eager"), opt, batches, loss_fn, candidates=list(eager),
                  fp8=dict(gain_fn=lambda *a: 1.4), steps=3, rounds=1, timed_steps=1, min_cosine=0.0)
    by = {t.name: t for t in result.trials}
    assert [n for n in by if by[n].step_times_ms] == ["bf16", "bf16+fp8"]
    assert by["bf16-pure+fp8"].verdict == ("agrees; not compiled: eager 20.5 ms/step, not faster than bf16+fp8's "
                                           "20, which keeps less in bf16")
    assert result.recipe.name == "bf16+fp8"


def _saving(monkeypatch, saved_ms):
    """The tuning's fp8 map with its layers' measured saving set to `saved_ms` (gain_fn gives none)."""
    import dataclasses

    from adaptive_amp.fp8 import training

    real = training.tuning_fp8_map
    monkeypatch.setattr(training, "tuning_fp8_map",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), saved_ms=saved_ms))


SIX = {"fp32": 25, "bf16": 8, "bf16-weights": 7, "bf16+fp8": 20, "bf16-weights+fp8": 19.5, "bf16-pure+fp8": 18}


@pytest.mark.parametrize("saved_ms, runs_plain, family", [(5.0, False, "llama"), (0.05, True, "llama"),
                                                          (None, True, "llama"),
                                                          pytest.param(5.0, False, "gpt2", marks=pytest.mark.slow)])
def test_a_recipe_whose_fp8_twin_agrees_and_saves_is_not_run(saved_ms, runs_plain, family, fp8_here, monkeypatch):
    """Its twin computes every other op as it does, and each of the twin's fp8 layers was timed faster than in
    bf16: it cannot be faster. Only when the saving is more than `tie` of the reference's step (25 ms here),
    and measured (not a gain_fn's)."""
    zm, opt, batches = _setup(family)
    _saving(monkeypatch, saved_ms)
    loss_fn = _timed(monkeypatch, zm, SIX, {"fp32": 5, "bf16": 3, "bf16-weights": 2.9, "bf16+fp8": 2,
                                            "bf16-weights+fp8": 1.9, "bf16-pure+fp8": 1.5})
    result = tune(torch.compile(zm.model, backend="eager"), opt, batches, loss_fn, candidates=list(SIX),
                  fp8=dict(gain_fn=lambda *a: 1.4), steps=3, rounds=1, timed_steps=1, min_cosine=0.0)
    by = {t.name: t for t in result.trials}
    skipped = dict(result.skipped)
    assert result.recipe.name == "bf16-pure+fp8"
    if runs_plain:
        assert not skipped and set(by) == set(SIX)
        assert [n for n in by if by[n].step_times_ms] == ["bf16", "bf16-weights", "bf16+fp8", "bf16-pure+fp8"]
        return
    assert list(by) == ["fp32", "bf16+fp8", "bf16-weights+fp8", "bf16-pure+fp8"]
    for plain in ("bf16", "bf16-weights"):
        assert skipped[plain] == (f"{plain}+fp8 agrees and fits, and its fp8 layers were timed 5 ms a step faster "
                                  f"than in bf16 (more than tie=0.01 of the reference's 25 ms): {plain} cannot be "
                                  f"faster; it runs if {plain}+fp8 fails later")
    # bf16+fp8 stands for bf16 (the recipe never to lose to) among those keeping as little in bf16: fp32, slower
    # eagerly, is not compiled. (Faster eagerly, it is: the next test.)
    assert by["fp32"].verdict == ("agrees; not compiled: eager 25 ms/step against 20 for bf16+fp8, which keeps as "
                                  "much in bf16 and stands for bf16")
    assert [n for n in by if by[n].step_times_ms] == ["bf16+fp8", "bf16-pure+fp8"]
    assert any(r == f"trial bf16: skipped: {skipped['bf16']}" for r in result.policy.reasons)


def test_a_recipe_not_run_for_its_fp8_twin_runs_when_no_fp8_candidate_survives_its_timing(fp8_here, monkeypatch):
    from adaptive_amp import tune as tune_module

    zm, opt, batches = _setup()
    _saving(monkeypatch, 5.0)
    loss_fn = _timed(monkeypatch, zm, SIX, {"fp32": 5, "bf16": 3, "bf16-weights": 2.9})
    real = tune_module.Tuner._time_compiled

    def time_compiled(self, recipe, trial, offset):
        if "+fp8" in recipe.name:
            raise RuntimeError("planted: the fp8 graph does not compile here")
        return real(self, recipe, trial, offset)
    monkeypatch.setattr(tune_module.Tuner, "_time_compiled", time_compiled)
    result = tune(torch.compile(zm.model, backend="eager"), opt, batches, loss_fn, candidates=list(SIX),
                  fp8=dict(gain_fn=lambda *a: 1.4), steps=3, rounds=1, timed_steps=1, min_cosine=0.0)
    by = {t.name: t for t in result.trials}
    assert not result.skipped
    assert list(by) == ["fp32", "bf16+fp8", "bf16-weights+fp8", "bf16-pure+fp8", "bf16", "bf16-weights"]
    assert by["bf16+fp8"].error.startswith("could not be timed compiled: RuntimeError: planted")
    # bf16+fp8 stood for bf16 in the first finalists, and fp32 was set aside for it; now it is judged beside bf16.
    assert by["fp32"].verdict == ("agrees; not compiled: eager 25 ms/step against 8 for bf16, which keeps as much "
                                  "in bf16")
    # Screened after the others were timed, then timed compiled beside them: bf16-weights is not more than
    # state_margin faster than bf16 compiled, so torch's recipe is chosen.
    assert by["bf16"].step_times_ms == [3] and by["bf16-weights"].step_times_ms == [2.9]
    assert result.recipe.name == "bf16"


@pytest.mark.parametrize("options, order", [
    # Above 1 only the reference agrees: bf16+fp8 does not, so bf16 runs after it (and does not agree either).
    (dict(min_cosine=1.5, noise_fraction=0.0), ["fp32", "bf16+fp8", "bf16"]),
    # The fp8 layers timed eagerly say nothing of what they save compiled: bf16 runs in its place.
    (dict(min_cosine=0.0, fp8=dict(gain_fn=lambda *a: 1.4, compiled=False)), ["fp32", "bf16", "bf16+fp8"])])
def test_a_recipe_runs_when_its_fp8_twin_disagrees_or_its_saving_was_timed_otherwise(options, order, fp8_here,
                                                                                      monkeypatch):
    zm, opt, batches = _setup()
    _saving(monkeypatch, 5.0)
    eager = {"fp32": 25, "bf16": 8, "bf16+fp8": 20}
    loss_fn = _timed(monkeypatch, zm, eager, {"fp32": 5, "bf16": 3, "bf16+fp8": 2})
    result = tune(torch.compile(zm.model, backend="eager"), opt, batches, loss_fn, candidates=list(eager),
                  **{"fp8": dict(gain_fn=lambda *a: 1.4), **options}, steps=3, rounds=1, timed_steps=1)
    assert [t.name for t in result.trials] == order and not result.skipped


@pytest.mark.parametrize("eager_oom", [("bf16+fp8",), ("bf16+fp8", "bf16")])
def test_only_a_twin_without_checkpointing_stands_for_a_recipe_without(eager_oom, fp8_here, monkeypatch):
    """fp8's casts take a little more memory: a recipe may fit where its fp8 twin needed checkpointing, and then
    run faster than the twin does checkpointed. So it runs; once it too needs checkpointing, the checkpointed twin
    stands for it."""
    zm, opt, batches = _setup()
    _saving(monkeypatch, 5.0)
    eager = {"fp32": 25, "bf16": 8, "bf16+ckpt": 10, "bf16+fp8": 20, "bf16+fp8+ckpt": 22}
    loss_fn = _timed(monkeypatch, zm, eager, {"fp32": 5, "bf16": 3, "bf16+fp8": 2, "bf16+fp8+ckpt": 2.6},
                     eager_out_of_memory=eager_oom)
    result = tune(torch.compile(zm.model, backend="eager"), opt, batches, loss_fn,
                  candidates=["fp32", "bf16", "bf16+fp8"], fp8=dict(gain_fn=lambda *a: 1.4), steps=3, rounds=1,
                  timed_steps=1, min_cosine=0.0)
    by, skipped = {t.name: t for t in result.trials}, dict(result.skipped)
    if eager_oom == ("bf16+fp8",):
        assert list(by) == ["fp32", "bf16+fp8", "bf16+fp8+ckpt", "bf16"] and not skipped
        assert by["bf16"].error is None and by["bf16"].step_times_ms == [3]
    else:
        assert list(by) == ["fp32", "bf16+fp8", "bf16+fp8+ckpt", "bf16"] and list(skipped) == ["bf16+ckpt"]
        assert skipped["bf16+ckpt"].startswith("bf16+fp8+ckpt agrees and fits")
        assert by["bf16"].error.startswith("out of memory")
    # Compiled, bf16+fp8 fits without checkpointing, and is the fastest.
    assert by["bf16+fp8"].agreement_from == "bf16+fp8+ckpt" and result.recipe.name == "bf16+fp8"


def test_eagerly_a_recipe_run_after_its_fp8_twin_failed_gets_its_timing_rounds(fp8_here, monkeypatch):
    from adaptive_amp import tune as tune_module

    zm, opt, batches = _setup()
    _saving(monkeypatch, 5.0)
    eager = {"fp32": 25, "bf16": 8, "bf16+fp8": 20}
    loss_fn = _timed(monkeypatch, zm, eager, {})
    real = tune_module.Tuner._time_round

    def time_round(self, recipe, trial, offset):
        if "+fp8" in recipe.name:
            raise torch.OutOfMemoryError("CUDA out of memory (planted: a timing round)")
        return real(self, recipe, trial, offset)
    monkeypatch.setattr(tune_module.Tuner, "_time_round", time_round)
    result = tune(zm.model, opt, batches, loss_fn, candidates=list(eager), fp8=dict(gain_fn=lambda *a: 1.4),
                  steps=3, rounds=2, timed_steps=2, min_cosine=0.0)
    by = {t.name: t for t in result.trials}
    assert list(by) == ["fp32", "bf16+fp8", "bf16"] and not result.skipped
    assert by["bf16+fp8"].error.startswith("out of memory while timed")
    # The trajectory's two timed steps, then a round of two, as the first contenders had.
    assert by["bf16"].step_times_ms == [8] * 4 and result.recipe.name == "bf16"
