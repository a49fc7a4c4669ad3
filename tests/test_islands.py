"""Islands and checkpointing applied through adaptive_amp.layer_precision: they compose with each other and with
other controllers, survive copies and pickling, and leave nothing on the model once their owner is gone."""

from __future__ import annotations

import copy
import gc
import io
import pickle

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from adaptive_amp import AdaptiveMixedPrecision, optim, zoo  # noqa: E402
from adaptive_amp.adjust import DynamicPrecisionAdjuster, graphs_traced  # noqa: E402
from adaptive_amp.hardware import Capabilities  # noqa: E402
from adaptive_amp.layer_precision import (OwnedHandles, applied_kinds, apply_kind, base_class,  # noqa: E402
                                          register_kind)
from adaptive_amp.policy import PrecisionPolicy  # noqa: E402
from adaptive_amp.pressure import MemoryGuard  # noqa: E402

CPU = Capabilities(device_type="cpu", name="test cpu", bf16=True, fp16=True)
FP16 = "params=float32,compute=float16,loss_scale=dynamic"
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
         "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
         "_load_state_dict_pre_hooks")


def _setup(family="gpt2"):
    zm = zoo.build(family, "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    return zm, opt, [zm.make_batch(4, seed=i) for i in range(2)]


def _on_model(model):
    """Everything we could leave on a model: each module's class, hooks and instance attributes."""
    return {name: (type(m), [list(getattr(m, h).keys()) for h in HOOKS], sorted(m.__dict__))
            for name, m in model.named_modules()}


def _dtype_seen(module):
    """A forward hook recording the dtype of `module`'s output; returns (the record, the handle)."""
    seen = []
    return seen, module.register_forward_hook(lambda m, args, out: seen.append(out.dtype))


def test_undoing_the_checkpoint_move_keeps_an_island_promoted_since():
    zm, opt, batches = _setup()
    amp = AdaptiveMixedPrecision(zm.model, opt, policy=FP16, capabilities=CPU, progress=False,
                                 memory_guard=MemoryGuard(min_free=0, ladder=("checkpoint",)))
    guard, block = amp.memory_guard, zm.model.transformer.h[0]
    assert guard.lighter(amp, "pressure")
    amp._decide("promote", "block 0 in fp32", amp.policy.replace(islands=("transformer.h.0",)))
    assert guard.heavier(amp, "room")  # the checkpointing undone: the island stays
    seen, hook = _dtype_seen(block.mlp.c_fc)
    with amp.autocast():
        zm.loss(zm.model, batches[0])
    assert seen == [torch.float32]  # fp16 before
    assert applied_kinds(block) == (("fp32", {"device_type": "cpu"}),)
    amp._decide("demote", "block 0 back", amp.policy.replace(islands=()))  # raised RuntimeError before
    assert type(block) is base_class(block) and amp.adjuster.islands == ()
    with amp.autocast():
        zm.loss(zm.model, batches[0])
    assert seen == [torch.float32, torch.float16]
    hook.remove()
    amp.remove()


@pytest.mark.parametrize("order", ["island first", "checkpoint first"])
def test_an_island_and_checkpointing_on_one_block_compose_in_any_order(order):
    zm, _, batches = _setup("llama")
    block = zm.model.model.layers[0]
    zm.loss(zm.model, batches[0]).backward()
    ref = [p.grad.clone() for p in zm.model.parameters()]
    zm.model.zero_grad(set_to_none=True)
    island = checkpoint = None
    if order == "island first":
        island = apply_kind(block, "fp32", device_type="cpu")
    checkpoint = apply_kind(block, "checkpoint")
    if island is None:
        island = apply_kind(block, "fp32", device_type="cpu")
    zm.loss(zm.model, batches[0]).backward()  # fp32 without autocast: the same gradients, recomputed
    for p, r in zip(zm.model.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-5, atol=1e-7)
    checkpoint.remove()
    assert [k for k, _ in applied_kinds(block)] == ["fp32"]
    island.remove()
    assert type(block) is base_class(block) and applied_kinds(block) == ()


def test_two_controllers_each_keep_their_own_island():
    zm, opt, batches = _setup()
    first = AdaptiveMixedPrecision(zm.model, opt, policy=FP16 + ",islands=lm_head;transformer.h.0.mlp.c_fc",
                                   capabilities=CPU, progress=False)
    second = AdaptiveMixedPrecision(zm.model, opt, policy=FP16 + ",islands=lm_head", capabilities=CPU,
                                    progress=False)
    first.remove()  # before, this took the second's lm_head island with it
    head, seen_head = zm.model.lm_head, None
    seen_head, h1 = _dtype_seen(head)
    seen_fc, h2 = _dtype_seen(zm.model.transformer.h[0].mlp.c_fc)
    with second.autocast():
        zm.loss(zm.model, batches[0])
    assert seen_head == [torch.float32] and seen_fc == [torch.float16]
    assert second.adjuster.islands == ("lm_head",)
    second.remove()
    with second.autocast():
        zm.loss(zm.model, batches[0])
    assert seen_head[-1] == torch.float16 and type(head) is nn.Linear
    h1.remove(), h2.remove()


def test_a_deep_copy_runs_its_own_weights():
    zm, opt, batches = _setup()
    amp = AdaptiveMixedPrecision(zm.model, opt, policy=FP16 + ",islands=lm_head;transformer.h.0.mlp.c_fc",
                                 capabilities=CPU, progress=False)
    teacher = copy.deepcopy(zm.model)
    with torch.no_grad():
        teacher.lm_head.weight.zero_()  # (tied: the copy's embeddings too)
        logits = teacher(**{k: v for k, v in batches[0].items() if k != "labels"}).logits
        ours = zm.model(**{k: v for k, v in batches[0].items() if k != "labels"}).logits
    assert torch.count_nonzero(logits) == 0  # before, the copy's lm_head ran the original's weight
    assert torch.count_nonzero(ours) > 0
    # A copy is of the layers' own classes: the islands belong to the controller, on the model it holds.
    assert type(teacher.lm_head) is nn.Linear and applied_kinds(teacher.lm_head) == ()
    assert type(zm.model.lm_head) is not nn.Linear
    amp.remove()


@pytest.mark.parametrize("policy", [FP16 + ",islands=lm_head", "bf16-pure"])
def test_torch_save_of_the_whole_model(policy):
    zm, _, batches = _setup()
    opt = optim.AdamW(zm.model.parameters(), lr=1e-3, stochastic_rounding=True)
    amp = AdaptiveMixedPrecision(zm.model, opt, policy=policy, capabilities=CPU, progress=False,
                                 memory_guard=MemoryGuard(min_free=0, ladder=("checkpoint",)))
    amp.memory_guard.lighter(amp, "pressure")
    buffer = io.BytesIO()
    torch.save(zm.model, buffer)  # a PicklingError before (the island's closure, bf16-pure's input hook)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert all(type(m) is base_class(m) for m in loaded.modules())
    inputs = {k: v for k, v in batches[0].items() if k != "labels"}
    with torch.no_grad(), amp.autocast():
        want = zm.model(**inputs).logits
        got = loaded(**inputs).logits
    if policy == "bf16-pure":  # its input cast is a hook, which the whole-model pickle keeps
        torch.testing.assert_close(got, want)
    else:  # the copy has no island: its head computes in fp16
        assert got.dtype == torch.float16 and want.dtype == torch.float32
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert pickle.loads(pickle.dumps(zm.model.lm_head)).__class__ is nn.Linear
    amp.remove()


def _one_step(model, opt, batch, zm):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = zm.loss(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.mark.parametrize("policy", [FP16 + ",islands=lm_head;transformer.h.0.mlp.c_fc", "bf16-pure",
                                    "bf16-weights"])
@pytest.mark.parametrize("how", ["remove", "garbage collected"])
def test_nothing_of_ours_stays_on_the_model(policy, how):
    zm, _, batches = _setup()
    before = _on_model(zm.model)
    reference = copy.deepcopy(zm.model)
    opt = optim.AdamW(zm.model.parameters(), lr=1e-3, stochastic_rounding=True)
    amp = AdaptiveMixedPrecision(zm.model, opt, policy=policy, capabilities=CPU, progress=False,
                                 memory_guard=MemoryGuard(min_free=0, ladder=("checkpoint",)))
    amp.train_step(lambda: zm.loss(zm.model, batches[0]))
    amp.memory_guard.lighter(amp, "pressure")  # blocks checkpointed: ours to take off too
    assert _on_model(zm.model) != before
    if how == "remove":
        amp.remove()
    else:
        del amp
        gc.collect()
    assert _on_model(zm.model) == before
    if policy.startswith("params=float32"):  # (a bf16 policy keeps its bf16 parameters: the only copy)
        # The model trains as it would have without us, under plain autocast: the same step on both.
        ref_opt = optim.AdamW(reference.parameters(), lr=1e-3, stochastic_rounding=True)
        with torch.no_grad():
            for p, r in zip(zm.model.parameters(), reference.parameters()):
                r.copy_(p)
        a = _one_step(zm.model, optim.AdamW(zm.model.parameters(), lr=1e-3, stochastic_rounding=True),
                      batches[1], zm)
        b = _one_step(reference, ref_opt, batches[1], zm)
        assert torch.equal(a, b)
        assert all(torch.equal(p, r) for p, r in zip(zm.model.parameters(), reference.parameters()))


def test_an_adjuster_garbage_collected_takes_its_islands_off():
    zm, _, batches = _setup()
    adj = DynamicPrecisionAdjuster(zm.model, PrecisionPolicy.from_string(FP16 + ",islands=lm_head"))
    del adj
    gc.collect()
    seen, hook = _dtype_seen(zm.model.lm_head)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        zm.loss(zm.model, batches[0])
    assert seen == [torch.float16] and type(zm.model.lm_head) is nn.Linear
    hook.remove()


# ---------------------------------------------------------------------------- the mechanism


class _Scale(nn.Linear):
    pass


def _doubled(forward, factor=2.0):
    def doubled_forward(self, *args, **kwargs):
        return forward(self, *args, **kwargs) * factor
    return doubled_forward


def test_kinds_are_an_extensible_registry_with_owners():
    register_kind("test-doubled", _doubled)
    layer = _Scale(4, 4)
    x = torch.randn(2, 4)
    plain = layer(x)
    first = apply_kind(layer, "test-doubled", factor=3.0)
    second = apply_kind(layer, "test-doubled", factor=3.0)  # another owner of the same application
    island = apply_kind(layer, "fp32", device_type="cpu")
    assert type(layer).__name__ == "_Scale" and isinstance(layer, _Scale) and base_class(layer) is _Scale
    assert applied_kinds(layer) == (("test-doubled", {"factor": 3.0}), ("fp32", {"device_type": "cpu"}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, 3 * plain)
    first.remove()
    first.remove()  # idempotent
    assert not first.active and second.active
    torch.testing.assert_close(layer(x), 3 * plain)
    second.remove()
    torch.testing.assert_close(layer(x), plain)
    island.remove()
    assert type(layer) is _Scale and applied_kinds(layer) == ()
    with pytest.raises(ValueError, match="kind is 'nope'; registered kinds"):
        apply_kind(layer, "nope")
    with pytest.raises(ValueError, match="refused its options"):
        apply_kind(layer, "fp32", device="cpu")
    assert type(layer) is _Scale and applied_kinds(layer) == ()


def test_owned_handles_go_when_their_owner_does():
    class Owner:
        pass

    layer, owner = _Scale(4, 4), Owner()
    owned = OwnedHandles(owner)
    owned.add(apply_kind(layer, "fp32", device_type="cpu"), key="layer")
    undone = []
    owned.add(lambda: undone.append(True))
    assert "layer" in owned and len(owned) == 2
    del owner
    gc.collect()
    assert type(layer) is _Scale and undone == [True]


class _Breaking(nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        torch._dynamo.graph_break()  # the island's autocast must hold across it
        return y + 1


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), _Breaking(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_compiled_island_with_a_graph_break_inside_stays_fp32_and_retraces_only_on_change():
    torch.manual_seed(0)
    torch._dynamo.reset()
    model, x = _Net(), torch.randn(4, 8)
    seen, hook = _dtype_seen(model.b)
    compiled = torch.compile(model, backend="aot_eager")  # compiled before the adjuster
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(x)
    adj = DynamicPrecisionAdjuster(model, PrecisionPolicy.from_string("params=float32,compute=bf16,islands=b"))
    with torch.no_grad(), adj.autocast():
        eager = model(x)
        traced = graphs_traced()
        out = compiled(x)
        changed = graphs_traced()
        compiled(x)
        assert graphs_traced() == changed > traced  # retraced for the island, once
    assert seen[-2:] == [torch.float32, torch.float32]
    torch.testing.assert_close(out, eager)
    adj.remove()
    hook.remove()
