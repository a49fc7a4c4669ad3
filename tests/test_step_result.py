"""StepResult: what AdaptiveMixedPrecision.step returns.

Its truth is whether the optimizers stepped; a device-decided one is read
without waiting for work launched after its step, and a later step reusing
its pinned buffer does not change what it says.
"""

from __future__ import annotations

import pytest
import torch

from adaptive_amp import StepResult
from adaptive_amp.step_result import HostSlots
from conftest import cuda_param, requires_cuda


def test_known_results_are_free_and_say_what_they_were_given():
    for stepped in (True, False):
        r = StepResult(stepped)
        assert bool(r) is stepped and r.ready and not r.deferred and r.found_inf is None
        assert repr(r) == f"StepResult(stepped={stepped})"


@pytest.mark.parametrize("device", ["cpu", cuda_param()])
def test_device_flags_are_deferred_and_read_right(device):
    slots = HostSlots()
    flags = [torch.tensor(v, device=device) for v in (0.0, 1.0, 3.0, 0.0, 0.0, 2.0)]
    results = [StepResult(found_inf=f, slots=slots) for f in flags]
    for f in flags:
        f.fill_(7.0)  # the result is what the flag was at its step, in stream order
    assert all(r.deferred for r in results) and results[0].found_inf is flags[0]
    # Six results through two slots: the older ones were read before their buffer was written again.
    assert [bool(r) for r in results] == [True, False, False, True, True, False]
    assert all(r.ready for r in results)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="stepped.*found_inf"):
        StepResult()
    with pytest.raises(ValueError, match="stepped.*found_inf"):
        StepResult(True, found_inf=torch.zeros(()))


@pytest.mark.cuda
@requires_cuda
def test_a_cuda_result_needs_slots():
    with pytest.raises(ValueError, match="slots="):
        StepResult(found_inf=torch.zeros((), device="cuda"))


@pytest.mark.cuda
@requires_cuda
def test_reading_waits_for_its_step_only():
    """The point of StepResult: reading the last step's flag must not wait for the work queued after it (the
    next step's forward and backward), or the device would idle while the host launches the step after."""
    slots = HostSlots()
    flag = torch.ones((), device="cuda")
    result = StepResult(found_inf=flag, slots=slots)
    torch.cuda.synchronize()
    later = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued work after the step
    later.record()
    assert bool(result) is False
    assert not later.query()  # read while the later work still runs
    torch.cuda.synchronize()


@pytest.mark.parametrize("stepped", [True, False])
def test_a_result_compares_hashes_and_pickles_as_its_bool(stepped):
    import pickle

    for r in (StepResult(stepped), StepResult(found_inf=torch.tensor(0.0 if stepped else 1.0))):
        assert (r == stepped) and (stepped == r) and not (r != stepped) and not (stepped != r)
        assert (r == (not stepped)) is False and (r != (not stepped)) is True
        assert (r == False) is (not stepped) and (r == True) is stepped  # noqa: E712 - the point of the test
        assert r == int(stepped) and r == StepResult(stepped) and r != StepResult(not stepped)
        assert hash(r) == hash(stepped) and int(r) == int(stepped) and [10, 20][r] == [10, 20][stepped]
        assert len({r, stepped}) == 1 and {stepped: "x"}[r] == "x"
        back = pickle.loads(pickle.dumps(r))
        assert type(back) is StepResult and bool(back) is stepped and back == r and not back.deferred
