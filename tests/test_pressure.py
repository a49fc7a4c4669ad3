"""MemoryGuard: the user's optimizer stays the live one through a move, moves are collective under several
processes, and bad readings are refused by name. (Moves and their undo on the zoo: tests/test_tune.py.)"""

from __future__ import annotations

import io
import math
import re
import warnings

import pytest
import torch

from adaptive_amp import optim
from adaptive_amp.controller import AdaptiveMixedPrecision
from adaptive_amp.hardware import Capabilities
from adaptive_amp.pressure import MemoryGuard

from conftest import out_of_memory_in_first_backward

CPU = Capabilities(device_type="cpu", name="test cpu with bf16", bf16=True, fp16=True)
dist = torch.distributed


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def _batch(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


def _loss(model, i):
    x, y = _batch(i)
    return torch.nn.functional.mse_loss(model(x).float(), y)


def test_bf16_moments_move_converts_the_users_optimizer_in_place_and_back():
    """After the move the optimizer object the user holds (and an LR scheduler holds) is the one that steps:
    its state_dict() has every moment and step count, so a checkpoint saved the usual way loses nothing
    (before, the controller stepped a new object and the user's state_dict() was empty)."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    headroom = [10**9]
    amp = AdaptiveMixedPrecision(model, opt, policy="params=float32,compute=bfloat16", capabilities=CPU,
                                 progress=False, memory_guard=MemoryGuard(
                                     min_free=1000, check_every=1, reader=lambda: headroom[0], allow_recover=True,
                                     recover_after=1, ladder=("bf16-moments",)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scheduler must see its optimizer step ("step() before ...")
        for i in range(2):
            amp.train_step(lambda i=i: _loss(model, i))
            sched.step()
        headroom[0] = 10  # pressure: the move comes after this step
        amp.train_step(lambda: _loss(model, 2))
        sched.step()
        assert [m.name for m in amp.memory_guard.moves] == ["bf16-moments"]
        assert amp.optimizers[0] is opt and isinstance(opt, optim.AdamW)
        amp.train_step(lambda: _loss(model, 3))
        sched.step()
    params = list(model.parameters())
    saved = opt.state_dict()
    assert sorted(saved["state"]) == list(range(len(params)))
    for st in saved["state"].values():
        assert float(st["step"]) == 4.0 and st["exp_avg"].dtype == torch.bfloat16
        assert {"exp_avg", "exp_avg_sq"} <= set(st)
    assert saved["param_groups"][0]["lr"] == pytest.approx(1e-2 * 0.9**4)
    # The checkpoint, saved and loaded as usual, restores a twin that continues identically.
    buf = io.BytesIO()
    torch.save(saved, buf)
    twin_model = _mlp()
    twin_model.load_state_dict(model.state_dict())
    twin = optim.AdamW(twin_model.parameters(), lr=1e-2, moment_dtype=torch.bfloat16)
    twin.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for a, b in zip(twin.state_dict()["state"].values(), saved["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    headroom[0] = 10**9  # memory frees up: the move is undone, the same object is torch's AdamW again
    for i in range(3):
        amp.train_step(lambda i=i: _loss(model, i))
    assert not amp.memory_guard.moves and type(opt) is torch.optim.AdamW and amp.optimizers[0] is opt
    back = opt.state_dict()["state"]
    assert sorted(back) == list(range(len(params)))
    assert all(float(st["step"]) == 7.0 and st["exp_avg"].dtype == torch.float32 for st in back.values())
    assert "moment_dtype" not in opt.param_groups[0] and math.isfinite(float(_loss(model, 0).detach()))


@pytest.mark.parametrize("bad", ["lots", float("nan"), True, [1]])
def test_a_reader_that_returns_no_number_is_refused_by_name(bad):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = AdaptiveMixedPrecision(model, opt, policy="params=float32,compute=bfloat16", capabilities=CPU,
                                 progress=False, memory_guard=MemoryGuard(min_free=1000, check_every=1,
                                                                          reader=lambda: bad))
    with pytest.raises(TypeError, match=r"reader\(\) must return the headroom in bytes"):
        amp.train_step(lambda: _loss(model, 0))


def test_a_reader_that_is_not_callable_is_refused_at_construction():
    with pytest.raises(TypeError, match="reader must be a callable"):
        MemoryGuard(reader=10**9)


def test_an_infinite_or_unknown_headroom_makes_no_move():
    for value in (float("inf"), None):
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        amp = AdaptiveMixedPrecision(model, opt, policy="params=float32,compute=bfloat16", capabilities=CPU,
                                     progress=False, memory_guard=MemoryGuard(min_free=1000, check_every=1,
                                                                              reader=lambda: value))
        amp.train_step(lambda: _loss(model, 0))
        assert not amp.memory_guard.moves and type(opt) is torch.optim.AdamW


# ---------------------------------------------------------------- several processes
def _two_ranks(rank, store, out):
    """Rank 1 reads low headroom at step 2; rank 0 runs out of memory in its forward at step 4. Every rank must
    make both moves at the same steps and rerun the same batch, so both train identically; a rank left alone
    in a collective would time out (30 s)."""
    import datetime
    import json

    from adaptive_amp.bench._dist_exit import finish
    from adaptive_amp.distributed import CollectiveAdaptiveMixedPrecision

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        steps = [0]
        guard = MemoryGuard(min_free=1000, check_every=1, ladder=("bf16-moments", "bf16-weights"),
                            reader=lambda: 10 if rank == 1 and steps[0] == 2 else 10**9)
        amp = CollectiveAdaptiveMixedPrecision(model, opt, "params=float32,compute=float16,loss_scale=dynamic",
                                               capabilities=CPU, progress=False, memory_guard=guard)
        runs = []

        def closure():
            runs.append(steps[0])
            if rank == 0 and steps[0] == 4 and runs.count(4) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return _loss(model, steps[0])

        for steps[0] in range(7):
            amp.train_step(closure)
        result = {"moves": [(m.name, m.step) for m in guard.moves], "runs": runs, "policy": str(amp.policy),
                  "params": [p.detach().float().sum().item() for p in model.parameters()],
                  "same_object": amp.optimizers[0] is opt}
        with open(out / f"rank{rank}.json", "w") as f:
            json.dump(result, f)
    except BaseException:
        import traceback

        traceback.print_exc()
        dist.destroy_process_group()
        raise
    finish(0)


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_moves_are_collective_and_an_oom_on_one_rank_moves_every_rank(tmp_path):
    import json

    torch.multiprocessing.spawn(_two_ranks, args=(tmp_path / "store", tmp_path), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1], ranks
    # bf16-moments after step 2 (rank 1's pressure), bf16-weights at step 4 (rank 0's out-of-memory error),
    # step 4's batch run again on both ranks.
    assert ranks[0]["moves"] == [["bf16-moments", 3], ["bf16-weights", 4]]
    assert ranks[0]["runs"] == [0, 1, 2, 3, 4, 4, 5, 6]
    assert ranks[0]["policy"].startswith("params=bfloat16,compute=bfloat16") and ranks[0]["same_object"]


def test_guard_settings():
    assert MemoryGuard(ladder="checkpoint").ladder == ("checkpoint",)  # one move by its name, not its letters
    with pytest.raises(ValueError, match="check_every must be an int >= 1"):
        MemoryGuard(check_every=1.5)
    with pytest.raises(ValueError, match="recover_after must be an int >= 1"):
        MemoryGuard(recover_after="2")
    with pytest.raises(ValueError, match=re.escape("min_free is -1; pass a finite number of bytes > 0")):
        MemoryGuard(min_free=-1)


def test_a_step_run_again_after_running_out_of_memory_records_its_own_layer_statistics():
    """An out-of-memory error in backward, at a statistics step, after the forward recorded each layer: the step
    run again collects its layers again, and the monitor keeps one set of them (the retry's), not the failed
    attempt's nor none."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = AdaptiveMixedPrecision(model, opt, "params=float32,compute=bfloat16", capabilities=CPU, progress=False,
                                 stats_every=1, read_every=1)
    oom, failed = out_of_memory_in_first_backward()

    def closure():  # (the failed attempt's batch differs, so that its statistics would show)
        x, y = _batch(0)
        return oom(torch.nn.functional.mse_loss(model(x * (1.0 if failed() else 100.0)).float(), y))

    with pytest.raises(torch.OutOfMemoryError, match="no memory guard"):
        amp.train_step(closure)
    assert amp.step_count == 0 and all(p.grad is None for p in model.parameters())
    amp.train_step(closure)
    amp.monitor.read()
    activation = [ls for ls in amp.monitor.layer_stats if ls.kind == "activation"]
    assert [ls.step for ls in activation] == [0] and [r["name"] for r in activation[0].rows] == ["0", "2"]
    assert 0 < activation[0].rows[0]["amax"] < 10  # the retry's (the failed attempt's input was 100x larger)
