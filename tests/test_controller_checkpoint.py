"""AdaptiveMixedPrecision.load_state_dict refuses a bad checkpoint by name and changes nothing.

Oracle: the controller's own state_dict() before and after a refused load, and a run continued from the
good checkpoint afterwards.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from adaptive_amp import GradScaler
from adaptive_amp.controller import AdaptiveMixedPrecision
from adaptive_amp.hardware import Capabilities

FP16 = "params=float32,compute=float16,loss_scale=dynamic:1024"
CPU_BF16 = Capabilities(device_type="cpu", name="test cpu with bf16", bf16=True, fp16=True)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _trained(steps=7, read_every=5):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = AdaptiveMixedPrecision(model, torch.optim.AdamW(model.parameters()), policy=FP16,
                                     capabilities=CPU_BF16, progress=False, read_every=read_every)
    for i in range(steps):
        with amp.autocast():
            loss = model(torch.randn(4, 8)).float().square().mean()
        amp.backward(loss)
        amp.step()
        amp.zero_grad()
    return amp


def _set(state, path, value):
    *head, last = path
    for key in head:
        state = state[key]
    if value is _DELETE:
        del state[last]
    else:
        state[last] = value


_DELETE = object()

BAD = [
    (("step",), -1, r"state\['step'\]"),
    (("step",), 2.5, r"state\['step'\]"),
    (("step",), True, r"state\['step'\]"),
    (("step",), 3, r"state\['monitor'\] has recorded step"),  # fewer steps than the monitor recorded
    (("policy",), "params=float32,compute=float16", r"state\['policy'\]"),
    (("policy", "compute_dtype"), "float8", r"state\['policy'\]"),
    (("policy", "loss_scale"), {"mode": "sideways"}, r"state\['policy'\]"),
    (("policy", "colour"), "red", r"state\['policy'\]"),
    (("scaler_enabled",), "yes", r"state\['scaler_enabled'\]"),
    (("scaler", "scale"), -4.0, r"state\['scaler'\].*scale"),
    (("scaler", "scale"), "big", r"state\['scaler'\].*scale"),
    (("scaler", "_growth_tracker"), _DELETE, r"state\['scaler'\].*_growth_tracker"),
    (("monitor", "pending", 0, 1, "loss"), "junk", r"state\['monitor'\].*pending\[0\]\[1\]\['loss'\]"),
    (("monitor", "pending", 0, 0), -3, r"state\['monitor'\].*pending\[0\]\[0\]"),
    (("monitor", "pending", 0), "junk", r"state\['monitor'\].*pending\[0\]"),
    (("monitor", "steps", 0), "zero", r"state\['monitor'\].*steps\[0\]"),
    (("adapt", "last_change"), -2, r"state\['adapt'\]\['last_change'\]"),
    (("adapt", "promotions"), "two", r"state\['adapt'\]\['promotions'\]"),
    (("adapt", "first_overflow"), 99, r"state\['adapt'\]\['first_overflow'\]"),
    (("adapt", "scale_before_storm"), float("nan"), r"state\['adapt'\]\['scale_before_storm'\]"),
    (("adapt", "pending"), [6, "no", False], r"state\['adapt'\]\['pending'\]"),
    (("adapt", "promoted"), "layer", r"state\['adapt'\]\['promoted'\]"),
    (("policy_history",), [[0, 5]], r"state\['policy_history'\]"),
]


@pytest.mark.parametrize("path,value,match", BAD, ids=[f"{'.'.join(map(str, p))}={v!r}"[:40] for p, v, _ in BAD])
def test_a_bad_checkpoint_is_refused_by_name_and_changes_nothing(path, value, match):
    source = _trained()
    state = copy.deepcopy(source.state_dict())
    assert state["monitor"]["pending"], "the checkpoint has pending monitor values to corrupt"
    _set(state, path, value)
    target = _trained(steps=3)
    before = copy.deepcopy(target.state_dict())
    policy, scaler, monitor = target.policy, target.scaler, target.monitor
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(state)
    assert repr(target.state_dict()) == repr(before)  # (repr: NaN statistics compare equal)
    assert target.policy is policy and target.scaler is scaler and target.monitor is monitor
    # and the good checkpoint still loads and runs
    target.load_state_dict(source.state_dict())
    assert target.step_count == source.step_count
    target.backward(target.model(torch.randn(4, 8)).square().mean())
    assert target.step() and target.step_count == source.step_count + 1


@pytest.mark.parametrize("key,value", [("scale", "big"), ("_growth_tracker", _DELETE), ("adaptive_amp", 3)])
def test_a_scaler_refuses_a_bad_checkpoint_with_a_value_error_too(key, value):
    scaler = GradScaler("cpu")
    state = scaler.state_dict()
    _set(state, (key,), value)
    with pytest.raises(ValueError, match=key):
        scaler.load_state_dict(state)
    with pytest.raises((TypeError, KeyError)):  # (the types it raised before, for code that catches them)
        scaler.load_state_dict(state)
    assert scaler.state_dict() == GradScaler("cpu").state_dict()
