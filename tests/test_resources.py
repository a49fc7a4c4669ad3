"""Resource safety: long runs do not grow host memory or live Python objects; the ops are thread-safe.

10,000 GradScaler steps on a tiny CPU model and 10,000 stochastic_round calls,
measured after a warm-up: RSS (from /proc/self/statm) may grow by less than
RSS_SLACK_MB and the number of gc-tracked objects by less than OBJ_SLACK.
Then 4 Python threads each make 200 calls of unscale_and_check_,
stochastic_round(seed=...) and tensor_stats on distinct inputs; their results
must equal serial calls bitwise. ``AAMP_RESOURCE_STEPS`` changes the loop length.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

import adaptive_amp
from adaptive_amp import GradScaler
from conftest import assert_bitwise_equal, requires_cuda

STEPS = int(os.environ.get("AAMP_RESOURCE_STEPS", "10000"))
WARMUP = 500
RSS_SLACK_MB = 20
OBJ_SLACK = 2000


def cuda_test(fn):
    return pytest.mark.cuda(requires_cuda(fn))


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux: fall back to the peak, which still catches steady growth
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def live_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def _measure(loop, n):
    loop(WARMUP)
    obj0, rss0 = live_objects(), rss_mb()
    loop(n)
    obj1, rss1 = live_objects(), rss_mb()
    return rss1 - rss0, obj1 - obj0


def test_10k_gradscaler_steps_do_not_leak():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=50)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    step_no = [0]

    def loop(n):
        for _ in range(n):
            step_no[0] += 1
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step_no[0] % 97 == 0:  # an overflow now and then: the skip/back-off path too
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            if step_no[0] % 5 == 0:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()

    d_rss, d_obj = _measure(loop, STEPS)
    assert d_rss < RSS_SLACK_MB, f"RSS grew by {d_rss:.1f} MB over {STEPS} scaler steps"
    assert d_obj < OBJ_SLACK, f"{d_obj} more live Python objects after {STEPS} scaler steps"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert 0 < scaler.get_scale() < float("inf")


def test_10k_stochastic_round_calls_do_not_leak():
    x = torch.randn(64)
    bits = torch.randint(-2**31, 2**31 - 1, (64,), dtype=torch.int32)
    out = torch.empty(64, dtype=torch.float16)
    g = torch.Generator().manual_seed(1)
    targets = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
    count = [0]

    def loop(n):
        for _ in range(n):
            i = count[0] = count[0] + 1
            kind = i % 4
            if kind == 0:
                adaptive_amp.stochastic_round(x, targets[i % 3], seed=i, return_amax=True)
            elif kind == 1:
                adaptive_amp.stochastic_round(x, torch.float8_e4m3fn, generator=g, scale=0.5)
            elif kind == 2:
                adaptive_amp.stochastic_round(x, torch.float16, random_bits=bits, out=out)
            else:
                adaptive_amp.stochastic_round(x, torch.bfloat16)

    d_rss, d_obj = _measure(loop, STEPS)
    assert d_rss < RSS_SLACK_MB, f"RSS grew by {d_rss:.1f} MB over {STEPS} stochastic_round calls"
    assert d_obj < OBJ_SLACK, f"{d_obj} more live Python objects after {STEPS} stochastic_round calls"


def test_errors_do_not_leak():
    """Refused calls (validation errors) release what they took, too."""
    x = torch.randn(16)
    ts = [torch.randn(8), torch.randn(8)]

    def loop(n):
        for i in range(n // 4):
            for call in (
                lambda: adaptive_amp.stochastic_round(x, torch.bfloat16, seed=1, out=torch.empty(16)),
                lambda: adaptive_amp.unscale_and_check_([ts[0], ts[0]], torch.zeros(1), torch.ones(1)),
                lambda: adaptive_amp.tensor_stats([x], fmt="float7"),
                lambda: adaptive_amp.update_scale_(torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.zeros(1),
                                                   1.0, 0.5, 1),
            ):
                try:
                    call()
                except (ValueError, TypeError):
                    pass
                else:
                    raise AssertionError("expected an error")

    d_rss, d_obj = _measure(loop, STEPS // 2)
    assert d_rss < RSS_SLACK_MB, f"RSS grew by {d_rss:.1f} MB over refused calls"
    assert d_obj < OBJ_SLACK, f"{d_obj} more live Python objects after refused calls"


# --------------------------------------------------------------------------- threads

THREADS, CALLS = 4, 200
TARGETS = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def _inputs(worker, call):
    g = torch.Generator().manual_seed(worker * 100_003 + call)
    n = int(torch.randint(1, 3000, (1,), generator=g))
    dtype = [torch.float32, torch.float16, torch.bfloat16][call % 3]
    grads = [(torch.randn(n, generator=g) * 100).to(dtype), (torch.randn(n // 3 + 1, generator=g)).to(dtype)]
    if call % 7 == 0:
        grads[1][0] = float("inf")
    x = torch.randn(n, generator=g) * 10
    return grads, x, TARGETS[call % 4], worker * 1_000_000 + call


def _work(worker, device="cpu"):
    """One worker's calls -> every result, as CPU tensors."""
    results = []
    for call in range(CALLS):
        grads, x, target, seed = _inputs(worker, call)
        grads = [g.to(device) for g in grads]
        f = torch.zeros(1, device=device)
        sumsq, amax = adaptive_amp.unscale_and_check_(grads, f, torch.tensor([1 / 1024], device=device),
                                                      return_stats=True)
        r = adaptive_amp.stochastic_round(x.to(device), target, seed=seed)
        st = adaptive_amp.tensor_stats(grads + [x.to(device)], fmt="float16").to_dict()
        results.append(([g.cpu() for g in grads], f.cpu(), sumsq.cpu(), amax.cpu(), r.cpu(), st))
    return results


def _compare(got, exp, worker):
    for call, (a, e) in enumerate(zip(got, exp)):
        where = f"worker {worker} call {call}"
        for i, (ga, ge) in enumerate(zip(a[0], e[0])):
            assert_bitwise_equal(ga, ge, f"{where} grads[{i}]")
        for k, name in ((1, "found_inf"), (2, "sumsq"), (3, "amax")):
            assert_bitwise_equal(a[k], e[k], f"{where} {name}")
        assert torch.equal(a[4].view(torch.uint8), e[4].view(torch.uint8)), f"{where} stochastic_round"
        assert repr(a[5]) == repr(e[5]), f"{where} tensor_stats"  # repr: NaN == NaN, bitwise floats


def _threaded(device):
    serial = {w: _work(w, device) for w in range(THREADS)}
    threaded, errors = {}, []
    barrier = threading.Barrier(THREADS)

    def run(w):
        try:
            barrier.wait()
            threaded[w] = _work(w, device)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((w, exc))

    threads = [threading.Thread(target=run, args=(w,)) for w in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    assert not errors, f"worker errors: {errors!r}"
    for w in range(THREADS):
        _compare(threaded[w], serial[w], w)


def test_ops_from_several_threads_match_serial_calls():
    _threaded("cpu")


def test_generator_draws_from_threads_are_consistent():
    """Each thread with its own generator reproduces its serial sequence bitwise."""
    x = torch.randn(257)

    def seq(seed):
        g = torch.Generator().manual_seed(seed)
        return [adaptive_amp.stochastic_round(x, torch.bfloat16, generator=g).view(torch.int16) for _ in range(100)]

    serial = {w: seq(w) for w in range(THREADS)}
    got, errors = {}, []

    def run(w):
        try:
            got[w] = seq(w)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    for w in range(THREADS):
        assert all(torch.equal(a, b) for a, b in zip(got[w], serial[w])), f"thread {w} differs"


@cuda_test
def test_cuda_ops_from_several_threads_match_serial_calls():
    _threaded("cuda")


@cuda_test
def test_cuda_10k_scaler_steps_do_not_grow_device_memory():
    model = torch.nn.Linear(16, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler("cuda", growth_interval=50)
    x = torch.randn(8, 16, device="cuda")

    def loop(n):
        for i in range(n):
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean() * (float("inf") if i % 97 == 96 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        torch.cuda.synchronize()

    loop(WARMUP)
    before = torch.cuda.memory_allocated()
    d_rss, d_obj = _measure(loop, STEPS)
    assert torch.cuda.memory_allocated() - before <= 1 << 20
    assert d_rss < RSS_SLACK_MB and d_obj < OBJ_SLACK
