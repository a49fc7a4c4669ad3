"""Shared fixtures and helpers for the adaptive_amp test suite.

CPU tests run everywhere; tests that need a GPU carry the ``cuda`` marker
(declared in pyproject.toml) and skip cleanly unless both this build of
adaptive_amp and torch can use a CUDA device.
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import shutil
import tempfile

# torch.compile's on-disk caches, private to this run: a cache shared with other processes compiling at the
# same time crashed a compiled backward while it saved its entry (segfault in AOT autograd's cache pickling).
# Removed when the run ends, so that repeated runs do not fill the temporary directory (tens of MB each).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="adaptive_amp_tests_inductor_")
    atexit.register(functools.partial(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True))

import pytest  # noqa: E402
import torch  # noqa: E402

import adaptive_amp


def _leaves_out_slow(config) -> bool:
    """The README's plain `pytest` (no paths, no -m) leaves out the tests marked `slow`; naming a file, a
    folder or a -m expression runs what was asked for (`pytest -m slow`: only them)."""
    if config.option.markexpr:
        return False
    source = getattr(config, "args_source", None)  # pytest >= 7.2
    if source is not None:
        return source == pytest.Config.ArgsSource.TESTPATHS
    return list(config.args) == list(config.getini("testpaths"))


def pytest_collection_modifyitems(config, items):
    if not _leaves_out_slow(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


def pytest_report_header(config):
    if _leaves_out_slow(config):
        return "tests marked slow are left out: `pytest -m slow` runs them, `pytest -m \"slow or not slow\"` runs all"


@pytest.fixture(autouse=True)
def _dynamo_hook_guards_restored():
    """A controller that missed a statistics step turns dynamo's hook guards on for the process
    (adaptive_amp/collect.py): each test starts with the setting the one before it found."""
    from torch._dynamo import config

    saved = config.skip_nnmodule_hook_guards
    yield
    config.skip_nnmodule_hook_guards = saved


@pytest.fixture(autouse=True)
def _environment_restored():
    """Lightning's DDP strategy sets MASTER_ADDR, WORLD_SIZE, LOCAL_RANK and the like in os.environ and leaves
    them; the transformers Trainer that runs next reads them, starts a process group and wraps its model in DDP.
    Each test starts with the environment the one before it found."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def cuda_ok() -> bool:
    """True when adaptive_amp's CUDA kernels and torch's CUDA are both usable."""
    try:
        return bool(adaptive_amp.cuda_available()) and torch.cuda.is_available()
    except Exception:  # pragma: no cover - a broken driver is a skip, not an error
        return False


CUDA_OK = cuda_ok()
NO_CUDA_REASON = "needs a CUDA GPU, a CUDA build of adaptive_amp and a CUDA build of torch"

#: Decorator for tests that need CUDA: the ``cuda`` marker plus a clean skip.
requires_cuda = pytest.mark.skipif(not CUDA_OK, reason=NO_CUDA_REASON)


def cuda_param():
    return pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda], id="cuda")


@pytest.fixture(params=["cpu", cuda_param()])
def device(request):
    """The device a test runs on: "cpu" always, "cuda" when a GPU can be used."""
    if request.param == "cuda" and not CUDA_OK:  # belt and braces: the skipif mark covers it
        pytest.skip(NO_CUDA_REASON)
    return request.param


def defer_reads(monkeypatch):
    """The monitor's reads of host values deferred to the next poll, as its reads from a CUDA device are (the
    one device-dependent switch), so that CPU tests run the logic of a read in flight."""
    from adaptive_amp import monitor

    monkeypatch.setattr(monitor._HostCopy, "deferred", property(lambda self: self._values is None))


_INT_VIEW = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float64: torch.int64,
}


def assert_bitwise_equal(actual, expected, msg: str = ""):
    """Bit-for-bit equality of two float tensors, NaN compared as a class.

    Shapes and dtypes must match; every NaN of one must be a NaN of the other
    (the payload and sign of a NaN may differ); every other element must have
    the identical bit pattern (so -0.0 != +0.0 and subnormals are exact).
    Accepts torch tensors on any device and numpy arrays.
    """
    actual = _as_cpu_tensor(actual)
    expected = _as_cpu_tensor(expected)
    prefix = f"{msg}: " if msg else ""
    assert actual.dtype == expected.dtype, f"{prefix}dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{prefix}shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a_nan = torch.isnan(actual)
    e_nan = torch.isnan(expected)
    if not torch.equal(a_nan, e_nan):
        idx = torch.nonzero(a_nan != e_nan).flatten()[:5].tolist()
        raise AssertionError(f"{prefix}NaN positions differ (first flat indices {idx})")
    int_dtype = _INT_VIEW[actual.dtype]
    a_bits = actual.reshape(-1).view(int_dtype)
    e_bits = expected.reshape(-1).view(int_dtype)
    keep = ~a_nan.reshape(-1)
    diff = (a_bits != e_bits) & keep
    if bool(diff.any()):
        idx = torch.nonzero(diff).flatten()[:5].tolist()
        a_flat, e_flat = actual.reshape(-1), expected.reshape(-1)
        shown = ", ".join(
            f"[{i}] {a_flat[i].item()!r} (0x{a_bits[i].item() & _mask(int_dtype):x}) != "
            f"{e_flat[i].item()!r} (0x{e_bits[i].item() & _mask(int_dtype):x})"
            for i in idx
        )
        raise AssertionError(f"{prefix}{int(diff.sum())} element(s) differ bitwise: {shown}")


def _mask(int_dtype):
    return {torch.int16: 0xFFFF, torch.int32: 0xFFFFFFFF, torch.int64: 0xFFFFFFFFFFFFFFFF}[int_dtype]


def _as_cpu_tensor(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    import numpy as np

    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":  # ml_dtypes: reinterpret the bits
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(arr.copy())


def assert_lists_bitwise_equal(actual, expected, msg: str = ""):
    assert len(actual) == len(expected), f"{msg}: list lengths {len(actual)} != {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bitwise_equal(a, e, f"{msg} tensors[{i}]" if msg else f"tensors[{i}]")


@pytest.fixture
def bitwise():
    """The bitwise comparison helper as a fixture (also importable from conftest)."""
    return assert_bitwise_equal


# ----------------------------------------------------------------- tensor_stats
STATS_EXACT = ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "amax", "min_abs_nonzero",
               "overflow_count", "underflow_count", "subnormal_count")
STATS_RTOL = 1e-5


def assert_stats_match(got: dict, exp: dict, msg=""):
    """tensor_stats results against the reference: counts and extrema exact, moments within STATS_RTOL."""
    assert set(got) == set(exp), f"{msg}: keys {sorted(got)} != {sorted(exp)}"
    n = len(exp["numel"])
    for key in exp:
        assert len(got[key]) == n, f"{msg}: {key} has {len(got[key])} entries, expected {n}"
    for i in range(n):
        where = f"{msg} tensor {i}"
        for key in STATS_EXACT:
            if key not in exp:
                continue
            g, e = got[key][i], exp[key][i]
            if isinstance(e, float) and math.isnan(e):
                assert math.isnan(g), f"{where} {key}: {g} != nan"
            else:
                assert g == e, f"{where} {key}: {g} != {e}"
        amax = exp["amax"][i]
        for key in ("mean", "std", "l2_norm", "dynamic_range"):
            g, e = got[key][i], exp[key][i]
            if math.isnan(e):
                assert math.isnan(g), f"{where} {key}: {g} != nan"
                continue
            if math.isinf(e):
                assert g == e, f"{where} {key}: {g} != {e}"
                continue
            # mean: relative to the spread of the data (its own size may be ~0)
            tol = STATS_RTOL * (abs(e) + (amax if key == "mean" else 0.0)) + (1e-12 if key == "dynamic_range" else 0.0)
            assert abs(g - e) <= tol, f"{where} {key}: {g} vs {e} (diff {g - e:.3g}, tol {tol:.3g})"


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Tiny tensors: one intra-op thread is as fast, and immune to a busy 2-core machine's thread stalls."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def quiet_torchao():
    """Skip without torchao; keep its import-time warnings (no GPU kernels on this machine) out of the output."""
    import logging

    pytest.importorskip("torchao")
    logging.getLogger("torchao").setLevel(logging.ERROR)


@pytest.fixture
def fp8_here(monkeypatch):
    """fp8 allowed on the CPU, as on a GPU with fp8 matmuls (torch._scaled_mm runs on the CPU)."""
    quiet_torchao()
    from adaptive_amp.fp8 import eligibility

    monkeypatch.setattr(eligibility, "device_unsupported", lambda device=None: None)


def out_of_memory_in_first_backward(before=None):
    """``apply(tensor)``: the tensor as it is, whose first backward raises CUDA's out-of-memory error (after
    `before()`, when given) and later ones pass the gradient through; ``failed()``: whether it has raised.
    Returns (apply, failed)."""
    raised = []

    class Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            if not raised:
                raised.append(True)
                if before is not None:
                    before()
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return grad
    return Backward.apply, lambda: bool(raised)


def controller_losses(amp, zm, model, steps: int, device="cpu", batch: int = 8) -> list:
    """`steps` steps of a zoo model `zm` (run through `model`, compiled or not) under controller `amp`, on four
    batches in turn: the losses."""
    losses = []
    for step in range(steps):
        with amp.autocast():
            loss = zm.loss(model, zm.make_batch(batch, seed=step % 4, device=device))
        amp.backward(loss)
        amp.step()
        amp.zero_grad()
        losses.append(loss.item())
    return losses


def counting_aot_eager(graphs: list):
    """A torch.compile backend that runs as "aot_eager" (dynamo and AOT autograd as with inductor, without code
    generation) and appends each graph's node count to `graphs`: how many graphs compiled, and how large."""
    from torch._dynamo.backends.registry import lookup_backend

    aot_eager = lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return aot_eager(gm, example_inputs)
    return backend
