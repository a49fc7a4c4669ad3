"""adaptive_amp.distributed in one process (the two-process behaviour: test_multi_gpu_integrations_script.py)."""

from __future__ import annotations

import math

import pytest
import torch

from adaptive_amp.distributed import CollectiveAdaptiveMixedPrecision, agree_on_layers, agree_on_rows, world_group
from adaptive_amp.layers import is_sharded

dist = torch.distributed
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_agree_on_layers_keeps_candidate_order(one_rank_group):
    candidates = ["a", "b.c", "d"]
    assert agree_on_layers(["d", "a"], candidates, one_rank_group) == ["a", "d"]
    assert agree_on_layers([], candidates, one_rank_group) == []


def test_agree_on_layers_refuses_an_unknown_layer(one_rank_group):
    with pytest.raises(ValueError, match=r"\['x'\] are not among the model's candidate layers"):
        agree_on_layers(["x"], ["a"], one_rank_group)


def test_one_rank_is_not_distributed(one_rank_group):
    assert world_group() is None  # a single rank needs no collective controller


def test_collective_controller_needs_a_group():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        CollectiveAdaptiveMixedPrecision(model, opt, "params=float32,compute=float32")


def test_collective_controller_gives_its_scalers_the_group(one_rank_group):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = CollectiveAdaptiveMixedPrecision(model, opt, "params=float32,compute=float16,loss_scale=dynamic",
                                           process_group=one_rank_group, progress=False)
    assert amp.process_group is one_rank_group
    assert amp._scaler_kwargs["process_group"] is one_rank_group  # kept for the scalers made after a switch


def test_the_collective_loss_flag_is_agreed_before_each_backward(one_rank_group, monkeypatch):
    """With an optimizer that cannot skip on the device and no loss scaling, the ranks agree on whether the loss
    was finite before backward is queued (behind the forward only), and step() reads that agreed flag: no
    collective of its own, and no wait for the backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)  # not fused: skipped from the host
    amp = CollectiveAdaptiveMixedPrecision(model, opt, "params=float32,compute=float32",
                                           process_group=one_rank_group, read_every=50, progress=False)
    assert amp._decides_skip_on_host()
    order = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: order.append("all_reduce") or real(*a, **k))
    for i, factor in enumerate((1.0, float("nan"))):
        order.clear()
        with amp.autocast():
            loss = model(torch.randn(4, 8)).pow(2).mean() * factor
        loss.register_hook(lambda g: order.append("backward"))
        amp.backward(loss)
        assert order == ["all_reduce", "backward"]
        before = [p.detach().clone() for p in model.parameters()]
        assert bool(amp.step()) == (i == 0)
        assert order == ["all_reduce", "backward"], "step() ran a collective of its own"
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) == (i == 1)
        amp.zero_grad()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_on_zoo_models_the_collective_loss_flag_is_agreed_before_backward(one_rank_group, monkeypatch, family, mode):
    pytest.importorskip("transformers")
    from adaptive_amp import zoo
    from adaptive_amp.hardware import Capabilities

    zm = zoo.build(family, "tiny", seed=0)
    torch._dynamo.reset()
    model = torch.compile(zm.model, backend="aot_eager") if mode == "compiled" else zm.model
    amp = CollectiveAdaptiveMixedPrecision(
        model, torch.optim.AdamW(zm.model.parameters(), lr=1e-3), "params=float32,compute=bfloat16",
        capabilities=Capabilities(device_type="cpu", name="test cpu with bf16", bf16=True, fp16=True),
        process_group=one_rank_group, read_every=50, progress=False)
    order = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: order.append("all_reduce") or real(*a, **k))
    try:
        for i, factor in enumerate((1.0, float("nan"))):
            order.clear()
            with amp.autocast():
                loss = zm.loss(model, zm.make_batch(2, seed=i)) * factor
            loss.register_hook(lambda g: order.append("backward"))
            amp.backward(loss)
            assert bool(amp.step()) == (factor == 1.0)
            assert order == ["all_reduce", "backward"], (i, order)
            amp.zero_grad()
    finally:
        amp.remove()


def _nan_loss_on_one_rank(rank, store, out, steps):
    """FSDP2 over two gloo ranks. Rank 1's loss (and so every gradient) is NaN at steps 2-4; no layer's
    output overflows. After the switch torch clips (no scaler): its total norm is a DTensor."""
    import datetime
    import json

    from torch.distributed.fsdp import fully_shard

    from adaptive_amp.bench._dist_exit import finish

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        amp = CollectiveAdaptiveMixedPrecision(model, opt, "params=float32,compute=float16,loss_scale=dynamic",
                                               read_every=50, progress=False)
        gen = torch.Generator().manual_seed(rank)
        norms, stepped = {}, []
        for i in range(steps):
            with amp.autocast():
                loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).mean()
            if rank == 1 and 2 <= i <= 4:
                loss = loss * float("nan")
            if rank == 1 and i == steps - 1:  # without the scaler, a NaN the gradients do not see
                loss = loss + float("nan")
            amp.backward(loss)
            if not amp.scaler.is_enabled():  # the global norm, gathered by hand
                norms[i] = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor().item()
            stepped.append(bool(amp.step(max_grad_norm=100.0)))
            amp.zero_grad()
        amp.monitor.read()
        history = amp.monitor.history()
        recorded = dict(zip(history["step"], history["grad_norm"]))
        policies = [(s, str(p)) for s, p in amp.policy_history]
        decisions = [(e.step, e.kind) for e in amp.events if e.kind in ("promote", "switch_compute")]
        with open(out / f"rank{rank}.json", "w") as f:
            json.dump({"history": policies, "decisions": decisions, "norms": norms, "stepped": stepped,
                       "recorded": {str(s): recorded[s] for s in norms}}, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    # Both ranks leave together, and not through the interpreter's shutdown: a gloo worker still releasing
    # a collective's tensors then aborts the process (SIGABRT; adaptive_amp/bench/_dist_exit.py says why).
    finish(0)


def test_a_nan_loss_on_one_rank_is_decided_on_by_every_rank(tmp_path):
    """The per-step diagnosis asks whether the loss was finite when no layer is to blame: a per-rank value.
    Collectively, every rank must switch at the same step (alone, rank 1 switched and rank 0 then hung in
    the scaler's all-reduce). Then, under FSDP2 without a scaler, the monitor records torch's clip norm (a
    DTensor) as the global norm on every rank (it raised mixing DTensors with tensors)."""
    import json

    torch.multiprocessing.spawn(_nan_loss_on_one_rank, args=(tmp_path / "store", tmp_path, 8), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert [kind for _, kind in ranks[0]["decisions"]] == ["switch_compute"], ranks[0]
    assert ranks[0]["norms"], "no step ran without the scaler"
    assert ranks[0]["stepped"][-1] is False  # rank 1's NaN loss skipped the last step on both ranks
    for step, norm in ranks[0]["norms"].items():
        assert ranks[0]["recorded"][step] == pytest.approx(norm, rel=1e-5)


def _sharded_steps(rank, store, out, cls, dtype):
    """Our optimizer over FSDP2's shards on two gloo ranks, both ranks on the same batches (so that the
    reduce-scattered mean is the single process's gradient): the full params, norms and state after 3 steps."""
    import datetime

    from torch.distributed.fsdp import fully_shard

    from adaptive_amp import optim
    from adaptive_amp.bench._dist_exit import finish

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        model = _sharded_model(dtype)
        fully_shard(model)
        opt = _optimizer(optim, cls, model)
        norms = _train(model, opt)
        state = {k: v.full_tensor() for k, v in opt.state[model[0].weight].items() if k != "step"}
        full = [p.full_tensor() for p in model.parameters()]
        if rank == 0:
            torch.save({"params": full, "norms": norms, "state": state,
                        "sharded": type(opt.state[model[0].weight][next(iter(state))]).__name__}, out)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish(0)  # (both ranks leave together: adaptive_amp/bench/_dist_exit.py says why)


def _sharded_model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def _optimizer(optim, cls, model):
    kw = dict(momentum=0.9) if cls == "SGD" else {}
    return getattr(optim, cls)(model.parameters(), lr=0.05, track_grad_norm=True, **kw)


def _train(model, opt):
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(3):
        x = torch.randn(6, 8, generator=gen).to(next(model.parameters()).dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        norms.append(float(opt.last_grad_norm))
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("cls", ["AdamW", "SGD"])
def test_fused_optimizers_step_fsdp2_shards_as_the_whole_model_steps(tmp_path, cls):
    """FSDP2 hands the optimizer DTensors: each rank steps its shards, the state sharded as the params, and
    the tracked gradient norm is the whole model's. In float32 (round to nearest) the result is the single
    process's, bitwise; the norm to float rounding (another order of summation)."""
    from adaptive_amp import optim

    out = tmp_path / "rank0.pt"
    torch.multiprocessing.spawn(_sharded_steps, args=(tmp_path / "store", out, cls, torch.float32), nprocs=2)
    got = torch.load(out)
    model = _sharded_model(torch.float32)
    opt = _optimizer(optim, cls, model)
    norms = _train(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(got["params"], model.parameters()))
    assert got["norms"] == pytest.approx(norms, rel=1e-5)
    assert got["sharded"] == "DTensor"
    assert all(torch.equal(v, opt.state[model[0].weight][k]) for k, v in got["state"].items())


def test_bf16_shards_train_with_stochastic_rounding(tmp_path):
    out = tmp_path / "rank0.pt"
    torch.multiprocessing.spawn(_sharded_steps, args=(tmp_path / "store", out, "AdamW", torch.bfloat16), nprocs=2)
    got = torch.load(out)
    start = _sharded_model(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in got["params"])
    assert all(not torch.equal(p, q) for p, q in zip(got["params"], start.parameters()))
    assert all(n > 0 for n in got["norms"])


def test_a_gradient_sharded_otherwise_than_its_param_is_refused_by_name(one_rank_group):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    from adaptive_amp import optim

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(model)
    opt = optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    w = model[0].weight
    w.grad = distribute_tensor(w.grad.full_tensor(), w.device_mesh, [Replicate()])
    before = [p.detach().to_local().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"params\[0\] is sharded as .* but its gradient as .*sharded alike"):
        opt.step()
    assert all(torch.equal(p.detach().to_local(), b) for p, b in zip(model.parameters(), before))
    assert not opt.state


@pytest.mark.parametrize("policy, cast_first, message", [
    ("bf16-weights", False, "two dtypes in one sharded unit, which FSDP2 refuses"),
    ("bf16-pure", False, "cast the model before sharding it"),
])
def test_a_cast_fsdp2_cannot_take_is_refused_before_anything_changes(one_rank_group, policy, cast_first, message):
    """FSDP2 fixes each parameter's dtype when fully_shard runs (a later cast broke its all-gather, or left
    the shards float32 under bf16 DTensors): the controller says so at construction."""
    from torch.distributed.fsdp import fully_shard

    from adaptive_amp import optim

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 1))
    fully_shard(model)
    opt = optim.AdamW(model.parameters(), lr=0.1)
    before = [(p.dtype, p.detach().to_local().clone()) for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        CollectiveAdaptiveMixedPrecision(model, opt, policy, process_group=one_rank_group, progress=False)
    assert all(p.dtype == d and torch.equal(p.detach().to_local(), v) for p, (d, v) in zip(model.parameters(), before))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules() if m is not model)


def test_bf16_pure_trains_a_model_cast_before_fully_shard(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    from adaptive_amp import optim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    model.to(torch.bfloat16)
    fully_shard(model)
    amp = CollectiveAdaptiveMixedPrecision(model, optim.AdamW(model.parameters(), lr=1e-2), "bf16-pure",
                                           process_group=one_rank_group, progress=False)
    x = torch.randn(16, 8)
    losses = [float(amp.train_step(lambda: model(x).float().pow(2).mean())) for _ in range(5)]
    assert losses[-1] < losses[0] and all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_agree_on_rows_keeps_each_watched_layers_row_in_order(one_rank_group):
    rows = [{"name": "b", "amax": math.nan, "underflow": 0.0, "saturated": 0.0},
            {"name": "a", "amax": 2.0, "underflow": 0.5, "saturated": 0.25, "error": 0.05}]
    got = agree_on_rows(rows, ["a", "c", "b"], one_rank_group)
    assert [r["name"] for r in got] == ["a", "b"]  # the watched order; c was read by no rank
    assert got[0] == {"name": "a", "amax": 2.0, "underflow": 0.5, "saturated": 0.25, "error": 0.05}
    assert got[1]["amax"] == math.inf and math.isnan(got[1]["error"])  # still not finite; still not measured
    # A row without amax (the guard reads it as not measured) does not become a non-finite input.
    bare = agree_on_rows([{"name": "a", "underflow": 0.5}], ["a"], one_rank_group)[0]
    assert "amax" not in bare and bare["underflow"] == 0.5 and math.isnan(bare["error"])
    with pytest.raises(ValueError, match=r"rows of layers \['x'\] are not among the watched layers"):
        agree_on_rows([{"name": "x", "amax": 1.0}], ["a"], one_rank_group)


def _fp8_under_fsdp2(rank, store, out, steps):
    """Two gloo ranks, a model sharded by FSDP2, policy "bf16+fp8" measured with a gain only rank 0 sees, and
    the guard at every step. From step 4 rank 1's inputs carry an outlier channel; rank 0's do not."""
    import datetime
    import json
    import logging

    from torch.distributed.fsdp import fully_shard

    from adaptive_amp.bench._dist_exit import finish
    from adaptive_amp.fp8 import Fp8Guard, eligibility

    logging.getLogger("torchao").setLevel(logging.ERROR)
    eligibility.device_unsupported = lambda device=None: None  # torch._scaled_mm runs on the CPU
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        gen = torch.Generator().manual_seed(rank)
        batches = [torch.randn(16, 32, generator=gen) for _ in range(steps)]
        amp = CollectiveAdaptiveMixedPrecision(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16+fp8", progress=False, stats_every=1,
            fp8=dict(batches=batches[:1], gain_fn=lambda layer, shape, kind: 2.0 if rank == 0 else 0.5,
                     guard=Fp8Guard(min_history=2, window=4)))
        rows = []
        for step, x in enumerate(batches):
            if rank == 1 and step >= 4:
                x = x.clone()
                x[:, 3] *= 1e4
            amp.train_step(lambda: model(x).float().pow(2).mean())
            rows.append(amp._fp8_watch.rows)
        with open(out / f"rank{rank}.json", "w") as f:
            json.dump({"policies": [p for _, p in amp.policy_history], "rows": rows,
                       "events": [(e.step, e.kind, e.layer) for e in amp.events if e.kind.startswith("fp8")],
                       "sharded": all(is_sharded(p) for p in model.parameters())}, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish(0)  # (both ranks leave together: adaptive_amp/bench/_dist_exit.py says why)


def test_fp8_layers_of_a_sharded_model_train_and_decide_together(tmp_path):
    """FSDP2 and fp8: the measured map is rank 0's on every rank (rank 1 alone measured no gain); the guard's
    recompute gathers each layer's whole weight after the step; its rows are the worst over ranks, so an
    outlier only rank 1 sees demotes the layer on both ranks at the same step."""
    pytest.importorskip("torchao")
    import json

    torch.multiprocessing.spawn(_fp8_under_fsdp2, args=(tmp_path / "store", tmp_path, 6), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    first = ranks[0]["policies"][0]
    assert first.endswith("layers=*:fp8-tensorwise"), first  # both layers (0 and 2), as one pattern
    assert ranks[0]["sharded"]
    assert all(math.isfinite(row["error"]) and row["error"] < 0.15 for row in ranks[0]["rows"][0])
    events = ranks[0]["events"]  # (the controller counts steps from 1: the loop's step 4 is its 5th)
    assert events and events[0] == [5, "fp8_demote", "0"] and all(e[:2] == [5, "fp8_demote"] for e in events), events
    assert "0:bf16" in ranks[0]["policies"][-1]


def _tune_under_ddp(rank, store, out, family=None, compiled=False):
    """Two gloo ranks, a DDP model (a small MLP, or the zoo's `family` tiny, compiled or not), policy="tune" over
    fp32 and bf16 with three timing rounds: every rank runs
    the trials. Rank 1's clock reads every trial after the first 1e9x slower, which alone would leave it fewer
    candidates to time again, and so fewer DDP steps than rank 0 (whose collectives would then wait for steps
    rank 1 never runs). Rank 1's own result is marked, so that which result each rank applied shows."""
    import datetime
    import itertools
    import json

    from adaptive_amp import tune as tune_module
    from adaptive_amp.bench._dist_exit import finish
    from adaptive_amp.hardware import Capabilities
    from adaptive_amp.policy import AdaptivePrecisionSelector

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        if rank == 1:
            real_times, calls = tune_module._Timer.times_ms, itertools.count()

            def skewed(self):
                factor = 1e9 if next(calls) else 1.0  # (one call a trajectory or round)
                return [t * factor for t in real_times(self)]
            tune_module._Timer.times_ms = skewed
        real_tune = AdaptivePrecisionSelector.tune

        def marked_tune(self, *args, **kwargs):
            result = real_tune(self, *args, **kwargs)
            result.device = f"tuned on rank {rank}"
            return result
        AdaptivePrecisionSelector.tune = marked_tune
        if family is None:
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
            gen = torch.Generator().manual_seed(rank)
            batches = [torch.randn(8, 16, generator=gen) for _ in range(3)]

            def loss_fn(m, b):
                return m(b).float().pow(2).mean()
        else:
            from adaptive_amp import zoo

            zm = zoo.build(family, "tiny", seed=0)
            net, loss_fn = zm.model, zm.loss
            batches = [zm.make_batch(4, seed=10 * rank + k) for k in range(3)]
        model = torch.nn.parallel.DistributedDataParallel(net)
        if compiled:
            model = torch.compile(model, backend="aot_eager")
        forwards = []
        net.register_forward_pre_hook(lambda module, args: forwards.append(1))
        amp = CollectiveAdaptiveMixedPrecision(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), "tune", progress=False,
            capabilities=Capabilities(device_type="cpu", name="test cpu", bf16=True),
            tune=dict(batches=batches, loss_fn=loss_fn, candidates=["fp32", "bf16"], steps=3, rounds=3,
                      timed_steps=1, contenders=1e6, loss_tolerance=1.0, min_cosine=0.0))
        tuning_forwards = len(forwards)  # (each a DDP step's forward, or a probe's: the same count on each rank)
        losses = [float(amp.train_step(lambda b=b: loss_fn(model, b))) for b in batches]
        with open(out / f"rank{rank}.json", "w") as f:
            json.dump({"device": amp.tuning.device, "tuning_forwards": tuning_forwards,
                       "chosen": amp.tuning.recipe.name, "policy": str(amp.policy),
                       "timed": {t.name: len(t.step_times_ms) for t in amp.tuning.trials},
                       "finite": all(map(math.isfinite, losses)),
                       "weights": [p.detach().float().sum().item() for p in net.parameters()]}, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish(0)  # (both ranks leave together: adaptive_amp/bench/_dist_exit.py says why)


def test_a_tuning_under_ddp_applies_rank_zeros_choice_on_every_rank(tmp_path):
    """Each rank runs the tuning's trials (their steps all-reduce under DDP) and times them itself; what each
    trial measured is rank 0's on both as soon as it is measured, so both run the same timing rounds, and the
    result applied is rank 0's, so both train one recipe and their replicas stay equal."""
    import json

    torch.multiprocessing.spawn(_tune_under_ddp, args=(tmp_path / "store", tmp_path), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["device"] == ranks[1]["device"] == "tuned on rank 0"
    assert ranks[0] == ranks[1] and ranks[0]["finite"] and ranks[0]["chosen"] in ("fp32", "bf16")
    assert ranks[0]["timed"] == {"fp32": 4, "bf16": 4}  # two steps of the trajectory, two more rounds each


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_tuning_of_the_zoos_gpt2_under_ddp_takes_the_same_steps_on_every_rank(tmp_path, compiled):
    """The same with transformers' GPT-2 (Conv1D) from the zoo, eager and compiled (the eager screen, then the
    compiled finalists): every rank runs the same tuning steps and applies one choice."""
    import json

    torch.multiprocessing.spawn(_tune_under_ddp, args=(tmp_path / "store", tmp_path, "gpt2", compiled), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["device"] == ranks[1]["device"] == "tuned on rank 0"
    assert ranks[0] == ranks[1] and ranks[0]["finite"] and ranks[0]["chosen"] in ("fp32", "bf16")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_zoo_models_under_fsdp2_bf16_pure_trains_and_bf16_weights_is_refused(one_rank_group, family, compiled):
    """The zoo's GPT-2 (Conv1D) and Llama sharded per block and at the root, eager and compiled: bf16-pure on
    the model cast before fully_shard trains with our optimizer; bf16-weights is refused, nothing changed."""
    from torch.distributed.fsdp import fully_shard

    from adaptive_amp import optim, zoo
    from adaptive_amp.recipes import find_blocks

    def sharded(cast):
        zm = zoo.build(family, "tiny", seed=0)
        if cast:
            zm.model.to(torch.bfloat16)
        for _, block in find_blocks(zm.model):
            fully_shard(block)
        fully_shard(zm.model)
        return zm, (torch.compile(zm.model, backend="aot_eager") if compiled else zm.model)

    zm, model = sharded(cast=False)
    before = {n: (p.dtype, p.detach().to_local().clone()) for n, p in zm.model.named_parameters()}
    with pytest.raises(ValueError, match="two dtypes in one sharded unit"):
        CollectiveAdaptiveMixedPrecision(model, optim.AdamW(zm.model.parameters(), lr=1e-3), "bf16-weights",
                                         process_group=one_rank_group, progress=False)
    assert all(p.dtype == before[n][0] and torch.equal(p.detach().to_local(), before[n][1])
               for n, p in zm.model.named_parameters())

    zm, model = sharded(cast=True)
    amp = CollectiveAdaptiveMixedPrecision(model, optim.AdamW(zm.model.parameters(), lr=1e-2), "bf16-pure",
                                           process_group=one_rank_group, progress=False, stats_every=2)
    batch = zm.make_batch(4, seed=0)
    losses = [float(amp.train_step(lambda: zm.loss(model, batch))) for _ in range(4)]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    assert all(p.dtype == torch.bfloat16 and is_sharded(p) for p in zm.model.parameters())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_zoo_llama_under_fsdp2_trains_measured_fp8_layers_and_guards_them(one_rank_group, fp8_here, compiled):
    """The zoo's Llama sharded per block and at the root, eager and compiled: "bf16+fp8" measures its layers
    on the sharded model (each weight gathered), trains them in fp8, and the guard reads every fp8 layer at
    statistics steps, its recompute on the gathered weight."""
    from torch.distributed.fsdp import fully_shard

    from adaptive_amp import zoo
    from adaptive_amp.recipes import find_blocks

    zm = zoo.build("llama", "tiny", seed=0)
    for _, block in find_blocks(zm.model):
        fully_shard(block)
    fully_shard(zm.model)
    model = torch.compile(zm.model, backend="aot_eager") if compiled else zm.model
    batch = zm.make_batch(4, seed=0)
    amp = CollectiveAdaptiveMixedPrecision(
        model, torch.optim.AdamW(zm.model.parameters(), lr=1e-2), "bf16+fp8", process_group=one_rank_group,
        progress=False, stats_every=2,
        fp8=dict(batches=[batch], run=lambda m, b: zm.loss(m, b), gain_fn=lambda layer, shape, kind: 2.0))
    fp8_layers = [n for n, k in amp.adjuster.layer_kinds.items() if k.startswith("fp8-")]
    assert len(fp8_layers) >= 4, amp.policy.reasons
    losses = [float(amp.train_step(lambda: zm.loss(model, batch))) for _ in range(4)]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    rows = amp._fp8_watch.rows
    assert sorted(r["name"] for r in rows) == sorted(fp8_layers)
    assert all(math.isfinite(r["error"]) and r["error"] < 0.15 for r in rows), rows
    assert all(is_sharded(p) for p in zm.model.parameters())


def test_tuning_a_model_sharded_by_fsdp2_is_refused_by_name(one_rank_group):
    """A trial's snapshot restore would copy whole tensors into FSDP2's shards (every candidate failed with
    "mixed torch.Tensor and DTensor"): refused at construction, naming the parameter, nothing changed."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    fully_shard(model)
    before = [p.detach().to_local().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [torch.randn(4, 8) for _ in range(2)]
    with pytest.raises(ValueError, match=r"model: 0.weight is sharded by FSDP2 .* tune the model unsharded"):
        CollectiveAdaptiveMixedPrecision(model, opt, "tune", process_group=one_rank_group, progress=False,
                                         tune=dict(batches=batches, loss_fn=lambda m, b: m(b).pow(2).mean()))
    assert all(torch.equal(p.detach().to_local(), b) for p, b in zip(model.parameters(), before))
    assert not opt.state and all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("policy, how", [("bf16-pure", r"model.to\(torch.bfloat16\)"),
                                         ("bf16-weights", r"cast_matmul_weights\(model, torch.bfloat16\)")])
@pytest.mark.parametrize("given", ["ddp", "its module"])
def test_a_bf16_cast_of_a_model_ddp_wraps_is_refused_before_anything_changes(one_rank_group, policy, how, given):
    """DDP averages gradients in the dtypes the parameters had when it wrapped the model: cast afterwards, two
    ranks' gradients were no longer averaged, and their replicas parted silently. The controller refuses, naming
    the parameter and the cast to make first, whether it is given the DDP wrapper or the module it wraps (as the
    framework integrations give it); a tuning lists such candidates as skipped, with why."""
    from adaptive_amp import optim
    from adaptive_amp.hardware import Capabilities
    from adaptive_amp.policy import AdaptivePrecisionSelector

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1)))
    model = ddp if given == "ddp" else ddp.module
    name = "module.0.weight" if given == "ddp" else "0.weight"
    before = [p.detach().clone() for p in model.parameters()]
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=rf"{name} is in torch.float32 in a model DistributedDataParallel "
                                         rf"wraps.*{how}"):
        CollectiveAdaptiveMixedPrecision(model, opt, policy, process_group=one_rank_group, progress=False)
    assert all(p.dtype == torch.float32 and torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())

    batches = [torch.randn(4, 8) for _ in range(2)]
    result = AdaptivePrecisionSelector().tune(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches, lambda m, b: m(b).float().pow(2).mean(),
        candidates=["fp32", policy], steps=2, capabilities=Capabilities(device_type="cpu", name="cpu", bf16=True))
    assert result.recipe.name == "fp32" and [t.name for t in result.trials] == ["fp32"]
    assert [(n, "DistributedDataParallel wraps" in why) for n, why in result.skipped] == [(policy, True)]


def test_the_refusal_under_ddp_names_the_islands_to_keep_in_float32(one_rank_group):
    """bf16-weights with an fp32 island: the cast to make before DDP wraps the model keeps the island's weights
    float32 (without keep=, the island's float32 input met a bf16 weight at the first step)."""
    from adaptive_amp.policy import PrecisionPolicy
    from adaptive_amp.recipes import cast_refusal

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
    policy = PrecisionPolicy.from_string("bf16-weights").replace(islands=("module.1",))
    assert "cast_matmul_weights(model, torch.bfloat16, keep=['1'])" in cast_refusal(ddp, policy)
    inner = PrecisionPolicy.from_string("bf16-weights").replace(islands=("1",))
    assert "keep=['1']" in cast_refusal(ddp.module, inner)


def _bf16_pure_cast_before_ddp(rank, store, out):
    import datetime
    import json

    from adaptive_amp import optim
    from adaptive_amp.bench._dist_exit import finish

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
        net.to(torch.bfloat16)
        model = torch.nn.parallel.DistributedDataParallel(net)
        amp = CollectiveAdaptiveMixedPrecision(model, optim.AdamW(model.parameters(), lr=1e-2), "bf16-pure",
                                               progress=False)
        gen = torch.Generator().manual_seed(rank)  # each rank its own batches
        for _ in range(3):
            x = torch.randn(16, 8, generator=gen)
            amp.train_step(lambda: model(x).float().pow(2).mean())
        with open(out / f"rank{rank}.json", "w") as f:
            json.dump([p.detach().float().flatten().tolist() for p in net.parameters()], f)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish(0)


def test_bf16_pure_keeps_ddp_replicas_equal_when_the_model_is_cast_before_ddp_wraps_it(tmp_path):
    """The way the refusal above names: cast, then wrap. Two gloo ranks on their own batches, stochastic rounding
    drawn from each rank's generator, seeded alike: the replicas stay equal."""
    import json

    torch.multiprocessing.spawn(_bf16_pure_cast_before_ddp, args=(tmp_path / "store", tmp_path), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
