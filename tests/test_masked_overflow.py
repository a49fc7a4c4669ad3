"""An fp16 overflow that a saturating op downstream masks: no inf or NaN reaches the loss or the gradients, so
no step is skipped and no loss scaler sees it, but the layer's output is wrong. The statistics step that
measures it (step 0 is the first) is read at once, and the layer is promoted to an fp32 island the step after.

The zoo's GPT-2 with a planted layer: transformer.h.1.mlp.c_fc (a transformers Conv1D) has its weights
scaled so that its fp32 output reaches 2e5 (fp16's largest finite value is 65504), and its MLP activation
is tanh, which turns the fp16 infs into +-1.
"""

from __future__ import annotations

import pytest
import torch

from adaptive_amp import zoo
from adaptive_amp.hardware import Capabilities
from adaptive_amp.monitor import StabilityMonitor
from adaptive_amp.ops import tensor_stats
from adaptive_amp.zoo import train as zoo_train
from conftest import requires_cuda

pytest.importorskip("transformers")

CPU_NO_BF16 = Capabilities(device_type="cpu", name="test cpu without bf16", bf16=False, fp16=True)
LAYER = "transformer.h.1.mlp.c_fc"
# Dynamic loss scaling from a scale the gradients fit at (65536 overflows them at step 0 whatever the model
# does, and that skip would expose the overflow the ordinary way).
POLICY = "params=float32,compute=float16,loss_scale=dynamic:1024"


def masked_zoo_model(device="cpu"):
    zm = zoo.build("gpt2", "tiny", seed=0, device=device)
    mlp = dict(zm.model.named_modules())["transformer.h.1.mlp"]
    mlp.act = torch.nn.Tanh()  # saturates: an fp16 inf out of c_fc becomes 1
    zoo.plant_overflow(zm, LAYER, zm.make_batch(8, seed=0, device=device), amax=2e5)
    return zm


def _train(zm, recipe, steps, compile_model=False):
    caps = CPU_NO_BF16 if next(zm.model.parameters()).device.type == "cpu" else None
    kwargs = dict(read_every=10) if caps is None else dict(capabilities=caps, read_every=10)
    return zoo_train.train(zm, recipe, steps, batch=8, lr=3e-3, warmup=10, policy=POLICY,
                           compile_model=compile_model, amp_kwargs=kwargs if recipe == "adaptive" else None)


def _check_repaired(run, fp32_loss, skips_allowed=0):
    amp = run.amp
    seen = [e for e in amp.events if e.kind == "activation_overflow" and e.layer == LAYER]
    assert seen and seen[0].step == 0, [str(e) for e in amp.events]
    promotes = [e for e in amp.events if e.kind == "promote"]
    assert promotes and promotes[0].data["layers"] == [LAYER], [str(e) for e in amp.events]
    assert promotes[0].step - seen[0].step <= 10
    assert LAYER in amp.policy.islands and amp.policy.compute_dtype == torch.float16
    assert run.stepped.count(False) <= skips_allowed, run.stepped
    assert run.final_loss <= 1.05 * fp32_loss, (run.final_loss, fp32_loss)


def test_a_masked_overflow_skips_nothing_and_its_layer_is_promoted_the_next_step():
    steps = 8
    fp32 = _train(masked_zoo_model(), "fp32", steps).final_loss
    run = _train(masked_zoo_model(), "adaptive", steps)
    first = next(e for e in run.amp.events if e.kind == "promote")
    assert first.step == 1 and "no step skipped" in first.message
    assert "loss scale restored" not in first.message  # nothing backed the scale off
    assert all(run.stepped[:first.step + 1])  # the masked overflow skipped nothing
    # Promoted, the layer's planted weights send tanh's unsaturated gradients upstream, which fp16 had zeroed: at
    # the scale of 1024 one of them can overflow an fp16 gradient (on an AVX2 CPU at step 2, not on others), and
    # the scaler skips that step and backs off, as for any overflow.
    _check_repaired(run, fp32, skips_allowed=1)
    assert run.amp.scaler.get_scale() == 1024.0 / 2 ** run.stepped.count(False)  # (and no growth yet)


def test_a_masked_overflow_is_repaired_when_compiled():
    steps = 6
    fp32 = _train(masked_zoo_model(), "fp32", steps).final_loss
    torch._dynamo.reset()
    _check_repaired(_train(masked_zoo_model(), "adaptive", steps, compile_model=True), fp32)


@pytest.mark.cuda
@requires_cuda
def test_a_masked_overflow_is_repaired_on_cuda():
    steps = 30
    fp32 = _train(masked_zoo_model("cuda"), "fp32", steps).final_loss
    for compile_model in (False, True):
        torch._dynamo.reset()
        # (a fused optimizer on CUDA: its result is read a step late, the statistics' read too)
        run = _train(masked_zoo_model("cuda"), "adaptive", steps, compile_model=compile_model)
        _check_repaired(run, fp32, skips_allowed=2)


def test_a_statistics_step_starts_a_read_of_its_own():
    """The monitor reads a step that recorded layer outputs at once (on a device: at the next poll), not at the
    end of its read window, so that the controller judges them without waiting up to read_every steps."""
    mon = StabilityMonitor(read_every=50)
    x = torch.tensor([[1.0, float("inf")]], dtype=torch.float16)
    mon.record_layer_stats(0, "activation", tensor_stats([x], fmt="float16", names=["a"]))
    mon.record_step(0, loss=torch.tensor(1.0))
    events = mon.poll(0)
    assert mon.steps_recorded == 1 and [e.kind for e in events] == ["activation_overflow"]
    mon.record_step(1, loss=torch.tensor(1.0))
    assert mon.poll(1) == [] and mon.steps_recorded == 1  # an ordinary step waits for its window
