"""StepResult: whether a training step's optimizers stepped, read from the device only when asked.

With loss scaling and an optimizer that skips an overflowing step by itself on
the device (``fused=True``, adaptive_amp.optim), whether the step was skipped
is a device value. Reading it at once stalls the host until the device has
finished the step, and the device then idles while the host launches the next
one: 7% of a GPT-2 small fp16 step on an H200 (bench/RESULTS.md). So the value
is copied, in stream order, to pinned host memory with a CUDA event behind the
copy; ``bool()`` waits for that event only, never for work launched after it.
"""

from __future__ import annotations

from typing import Optional

import torch


class StepResult:
    """What :meth:`AdaptiveMixedPrecision.step` returns, whatever the policy: ``bool(result)`` is whether
    every optimizer stepped (False: an overflow or a non-finite loss skipped the step). It behaves as that
    bool: ``result == False``, ``result != True``, ``hash``, ``int`` and pickling all read the value.

    Reading it costs nothing when the host already knows (no loss scaling, or
    an optimizer the scaler steps from the host). For an optimizer that skips
    on the device, the first read waits until the device has finished that
    step, not the steps launched since; the controller reads it itself during
    the next step, after which it is free. :attr:`ready` says whether a read
    would wait.
    """

    __slots__ = ("_stepped", "_found_inf", "_host", "_event")

    def __init__(self, stepped: Optional[bool] = None, *, found_inf: Optional[torch.Tensor] = None,
                 slots: Optional["HostSlots"] = None):
        if (stepped is None) == (found_inf is None):
            raise ValueError("StepResult takes a known `stepped` or a device `found_inf`, exactly one")
        self._stepped = None if stepped is None else bool(stepped)
        self._found_inf = self._host = self._event = None
        if found_inf is None:
            return
        if found_inf.device.type == "cuda":
            if slots is None:
                raise ValueError("StepResult: a CUDA found_inf needs HostSlots to copy it into (slots=)")
            self._host, self._event = slots.take(self, found_inf)
        else:
            # A copy now (the flag's memory may be reused), read when asked, as on CUDA: a step reads it where
            # a CUDA step would wait for it, so that a CPU run shows the same host reads as a GPU run.
            self._host = found_inf.detach().reshape(()).clone()
        self._found_inf = found_inf

    @property
    def deferred(self) -> bool:
        """Whether the device decided (a fused optimizer's skip): the controller judges such a step during
        the next one, so that its own read never stalls the device."""
        return self._found_inf is not None

    @property
    def ready(self) -> bool:
        """Whether reading the value would not wait for the device."""
        return self._stepped is not None or self._event is None or self._event.query()

    @property
    def found_inf(self) -> Optional[torch.Tensor]:
        """The device-side flag the result was read from (nonzero: skipped), for code that stays
        asynchronous; None when the host decided."""
        return self._found_inf

    def __bool__(self) -> bool:
        if self._stepped is None:
            if self._event is not None:
                self._event.synchronize()
            self._stepped = not bool(self._host.item())
            self._host = self._event = None  # the slot is free for a later step
        return self._stepped

    # As the bool it stands for: ``result == False`` is True for a skipped step, hashes and pickles as that
    # bool. Each of these reads the value (a deferred one waits for its step, as bool() does).
    def __eq__(self, other):
        if isinstance(other, StepResult):
            return bool(self) == bool(other)
        return bool(self) == other

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(bool(self))

    def __int__(self) -> int:
        return int(bool(self))

    __index__ = __int__

    def __reduce__(self):
        return (StepResult, (bool(self),))  # the value, read: a device flag does not travel

    def __repr__(self) -> str:
        if self._stepped is None:
            return "StepResult(<on the device, not read yet>)"
        return f"StepResult(stepped={self._stepped})"


class HostSlots:
    """Pinned host buffers and CUDA events for StepResults, used in turn. A slot's previous result is read
    before the slot is written again (the controller has read it already, during the step after it)."""

    def __init__(self, count: int = 2):
        self._count = count
        self._slots = None  # [(pinned buffer, event, the result that used it last)], made on first use
        self._next = 0

    def take(self, result: StepResult, flag: torch.Tensor):
        if self._slots is None:
            self._slots = [[torch.empty((), dtype=torch.float32, pin_memory=True), torch.cuda.Event(), None]
                           for _ in range(self._count)]
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self._count
        if slot[2] is not None:
            bool(slot[2])  # its value into the result before the buffer is overwritten
        host, event = slot[0], slot[1]
        host.copy_(flag.reshape(()), non_blocking=True)
        event.record(torch.cuda.current_stream(flag.device))
        slot[2] = result
        return host, event
