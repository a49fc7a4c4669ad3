"""What AdaptiveMixedPrecision's step does beyond the plain loop it replaces (the claim: overhead <= 3%).

The plain twin is the e2e benchmark's (adaptive_amp.bench.e2e.build_loops: same model, dtypes, optimizer and
clipping). On the zoo's tiny GPT-2, eager, every aten op of one step is recorded (a TorchDispatchMode: the
ops as they reach the kernels, with their tensors' sizes) and the two loops' lists compared:

* an ordinary step of the controller runs no op on a tensor of more than one element that the plain loop
  does not run (no extra pass over parameters, gradients or activations: no cast, copy, norm, zeroing or
  finite check), and reads nothing more to the host (``.item()``, ``bool(tensor)``, ``float(tensor)``) than
  the plain loop does (transformers' GPT-2 itself reads one value a forward);
* a statistics step adds one ``tensor_stats`` launch per layer and one for all the gradients, and otherwise
  only bookkeeping on the statistics rows;
* with an optimizer that skips on the device (fused), whether it stepped is taken once, after everything the
  step launches: a copy (on CUDA to pinned memory behind an event) that the controller reads during the next
  step, after that step's launches (tests/test_step_result.py: on CUDA that wait ignores the work queued
  since). A CPU result is read where a CUDA one would be waited for, so the reads counted here are those.

A ``.cpu()`` of a CPU tensor dispatches nothing, so the monitor's one transfer per read window is not seen
here; the monitor's own tests cover when it reads.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

from adaptive_amp import ops, zoo  # noqa: E402
from adaptive_amp.bench.e2e import build_loops  # noqa: E402
from adaptive_amp.controller import AdaptiveMixedPrecision  # noqa: E402

_READS = ("_local_scalar_dense", "item", "is_nonzero")


def _numel(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return max((_numel(v) for v in value), default=0)
    if isinstance(value, dict):
        return max((_numel(v) for v in value.values()), default=0)
    return 0


class _Ops(TorchDispatchMode):
    """Every aten op in order, with the largest tensor it reads or writes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func.overloadpacket.__name__, max(_numel(args), _numel(kwargs), _numel(out))))
        return out

    def big(self, smallest: int) -> Counter:
        """(op, size) of the ops on a tensor of at least `smallest` elements (the model's smallest parameter):
        the passes over parameters, gradients and activations. The others work on scalars and on per-tensor
        statistics (one value per parameter: 28 in the tiny GPT-2, whose smallest parameter has 32)."""
        return Counter((name, n) for name, n in self.calls if n >= smallest)

    def reads(self) -> int:
        return sum(name in _READS for name, _ in self.calls)


def _recorded(fn):
    with _Ops() as rec:
        fn()
    return rec


@pytest.fixture(scope="module")
def gpt2():
    zm = zoo.build("gpt2", "tiny", seed=0)
    return zm, [zm.make_batch(4, seed=i) for i in range(3)]


@pytest.fixture
def count_stats(monkeypatch):
    """Counts tensor_stats launches (the hooks and the gradient statistics import it from adaptive_amp.ops
    when they run)."""
    calls = []
    real = ops.tensor_stats

    def counting(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(ops, "tensor_stats", counting)
    return calls


@pytest.mark.parametrize("recipe", ["bf16-pure", "fp16", "auto"])
def test_an_ordinary_step_adds_no_pass_and_no_host_read(recipe, gpt2, count_stats):
    zm, batches = gpt2
    plain, ctl = build_loops(recipe, zm, "cpu", False, batches[0])
    try:
        for loop in (plain, ctl):
            loop.step(batches[0])  # step 0: the controller's first statistics step
        assert ctl.amp.step_count == 1 and not ctl.amp._stats_due()
        count_stats.clear()
        p = _recorded(lambda: plain.step(batches[1]))
        c = _recorded(lambda: ctl.step(batches[1]))
        assert count_stats == []  # no statistics outside statistics steps
        smallest = min(q.numel() for q in zm.model.parameters())
        assert sum(1 for _ in zm.model.parameters()) < smallest  # (what big() tells apart)
        extra = c.big(smallest) - p.big(smallest)
        assert extra == Counter(), f"{recipe}: the controller's step runs ops the plain loop does not: {extra}"
        # The same host reads as the plain loop's: transformers' GPT-2 reads one in its forward (whether the
        # position ids pack several sequences, when no attention mask is given); the fp16 loops' GradScaler.step
        # reads found_inf (a non-fused optimizer on the CPU, as torch's GradScaler does). One more where, without
        # loss scaling, an optimizer cannot skip a step on the device ("auto" here: bf16 autocast with torch's
        # non-fused AdamW, which the e2e loops use on the CPU): a step whose loss is not finite is skipped from the
        # host, as torch's GradScaler skips such an optimizer's overflowing step, so the controller reads the
        # loss's finiteness (copied behind the forward: on CUDA the read waits for the forward only).
        host_skip = int(ctl.amp._decides_skip_on_host())
        assert host_skip == (recipe == "auto")
        assert c.reads() == p.reads() + host_skip, \
            f"{recipe}: {c.reads()} host reads against the plain loop's {p.reads()}"
    finally:
        ctl.amp.remove()


def test_an_optimizer_that_skips_on_the_device_adds_no_host_read_without_loss_scaling(gpt2):
    """bf16 autocast with a fused AdamW: a non-finite loss's skip is handed to the optimizer on the device, so
    an ordinary step reads nothing more to the host than the plain loop (its result is read when asked)."""
    zm, batches = gpt2
    models = [copy.deepcopy(zm.model) for _ in range(2)]
    plain_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for m in models)
    amp = AdaptiveMixedPrecision(models[1], opt, policy="params=float32,compute=bfloat16", progress=False)

    def plain(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = zm.loss(models[0], batch)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def controlled(batch):
        with amp.autocast():
            loss = zm.loss(models[1], batch)
        amp.backward(loss)
        result = amp.step()
        amp.zero_grad()
        return result

    try:
        plain(batches[0])
        controlled(batches[0])  # (the first step: statistics, the optimizer's state)
        assert not amp._decides_skip_on_host()
        p = _recorded(lambda: plain(batches[1]))
        results = []
        c = _recorded(lambda: results.append(controlled(batches[1])))
        assert c.reads() == p.reads(), f"{c.reads()} host reads against the plain loop's {p.reads()}"
        assert results[0].deferred and bool(results[0])
    finally:
        amp.remove()


def test_a_statistics_step_adds_one_launch_per_layer_and_one_for_the_gradients(gpt2, count_stats):
    zm, batches = gpt2
    plain, ctl = build_loops("bf16-pure", zm, "cpu", False, batches[0])
    amp = ctl.amp
    try:
        assert amp._stats_due()  # step 0 is a statistics step (both loops' first: the optimizer's state too)
        p = _recorded(lambda: plain.step(batches[0]))
        c = _recorded(lambda: ctl.step(batches[0]))
        # A launch per layer (its output, and its input where that is a float tensor: not the embeddings'
        # token ids), then one for all the gradients.
        assert len(count_stats) == len(amp.layers) + 1 and set(count_stats[:-1]) <= {1, 2}
        assert count_stats[-1] == sum(1 for _ in zm.model.parameters())
        # Beyond those launches: the statistics rows gathered in forward order (one concatenation of the rows and
        # two index_selects), nothing over the model's tensors.
        smallest = min(q.numel() for q in zm.model.parameters())
        extra = {name for name, _ in (c.big(smallest) - p.big(smallest))}
        assert extra <= {"cat", "index_select", "view", "detach", "as_strided", "empty"}, extra
        assert c.reads() == p.reads()
    finally:
        amp.remove()


def test_the_host_read_of_a_device_skip_comes_after_the_steps_launches(gpt2):
    """fp16 with a fused optimizer: whether the step was skipped is known on the device only; the controller
    copies it after launching the scale update and the monitor's copy of the scale, and reads the last step's
    during this one, once this step's work is launched."""
    zm, batches = gpt2
    model = zm.model.__class__(zm.config)
    model.load_state_dict(zm.model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    amp = AdaptiveMixedPrecision(model, opt, policy="params=float32,compute=float16,loss_scale=dynamic:65536",
                                 progress=False)
    try:
        for i in range(2):
            with amp.autocast():
                loss = zm.loss(model, batches[i])
            amp.backward(loss)
            rec = _recorded(lambda: amp.step(max_grad_norm=1.0))
            amp.zero_grad()
        names = [name for name, _ in rec.calls]
        assert rec.reads() == 1 and names[-1] in _READS, names[-8:]
    finally:
        amp.remove()


def test_the_input_cast_of_bf16_pure_leaves_a_call_without_float_inputs_alone():
    """bf16-pure casts floating-point inputs to bf16 in a forward pre-hook; a call with none (token ids) goes on
    untouched (the hook returns None: torch does not rebuild the call's arguments)."""
    from collections import namedtuple

    from adaptive_amp.recipes import cast_floats_hook

    hook = cast_floats_hook(torch.bfloat16)
    ids = torch.arange(4)
    assert hook(None, (ids,), {"input_ids": ids, "mask": [ids], "flag": True}) is None
    Pair = namedtuple("Pair", "a b")
    x = torch.ones(2)
    args, kwargs = hook(None, (ids, Pair(x, ids)), {"pixels": {"left": x}, "ids": ids})
    assert type(args[1]) is Pair and args[1].a.dtype == torch.bfloat16 and args[1].b is ids and args[0] is ids
    assert kwargs["pixels"]["left"].dtype == torch.bfloat16 and kwargs["ids"] is ids


def test_an_eager_model_without_statistics_steps_carries_no_hook_of_ours(gpt2):
    """layer_stats=False: the collector's hooks are out of the modules from the controller's creation on (no
    statistics step ever puts them back), so no step pays nn.Module's general path."""
    zm, batches = gpt2
    model = zm.model.__class__(zm.config)
    model.load_state_dict(zm.model.state_dict())
    amp = AdaptiveMixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-4), policy="float32",
                                 layer_stats=False, progress=False)
    ours = {h.id for h in amp._collector._handles}
    carried = []
    for i in range(2):
        carried.append(sum(k in ours for m in model.modules() for k in m._forward_hooks))
        amp.train_step(lambda: zm.loss(model, batches[i]))
    carried.append(sum(k in ours for m in model.modules() for k in m._forward_hooks))
    assert ours and carried == [0, 0, 0]
    amp.remove()


def test_layers_carry_no_hook_of_ours_between_statistics_steps(gpt2):
    """An eager module call with a forward hook takes nn.Module's general path (~3 us a layer on the host):
    between statistics steps the collector's hooks are out of the modules, and a statistics step has them."""
    zm, batches = gpt2
    model = zm.model.__class__(zm.config)
    model.load_state_dict(zm.model.state_dict())
    before = {name: len(m._forward_hooks) for name, m in model.named_modules()}
    amp = AdaptiveMixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-4), policy="float32",
                                 read_every=4, stats_every=4, progress=False)
    seen = []

    def count_ours(module, args, output):  # a hook of the test's own, on the first layer: it stays
        seen.append(len(first._forward_hooks) - 1)

    first = amp._module.get_submodule(amp.layers[0][0])
    first.register_forward_hook(count_ours)
    try:
        for i in range(5):  # statistics at steps 0 and 4
            with amp.autocast():
                loss = zm.loss(model, batches[i % 3])
            amp.backward(loss)
            amp.step()
            amp.zero_grad()
            now = {name: len(m._forward_hooks) for name, m in model.named_modules()}
            assert now == {n: k + (m is first) for (n, k), m in zip(before.items(), model.modules())}, i
        assert seen == [1, 0, 0, 0, 1]  # ours ran on the statistics steps only
        amp.monitor.read()  # (step 4's window is still open)
        assert [ls.step for ls in amp.monitor.layer_stats if ls.kind == "activation"] == [0, 4]
    finally:
        amp.remove()
    assert {name: len(m._forward_hooks) for name, m in model.named_modules()} == \
        {n: k + (m is first) for (n, k), m in zip(before.items(), model.modules())}
