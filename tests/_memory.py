"""Live CPU tensor bytes over named phases, from torch.profiler's memory events (no GPU needed).

torch's CPU allocator reports every allocation and free to the profiler while
``profile_memory`` is on, so the running sum of those events is the number of
bytes of tensor memory alive (among what was allocated while tracking). A
phase's *transient peak* is its highest running sum minus the sum at its start;
what it *leaves* is the sum at its end minus the sum at its start. Frees of
memory allocated before tracking began are not reported: start tracking before
building what is measured.

Usage::

    with LiveBytes() as live:
        with live.phase("plain"):
            step()
    live.peak("plain"), live.left("plain")
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Tuple

from torch.profiler import ProfilerActivity, profile, record_function

_PREFIX = "live_bytes:"


class LiveBytes:
    def __init__(self):
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._phases: Dict[str, Tuple[int, int, int]] = {}  # name -> (at start, at end, highest)

    def __enter__(self) -> "LiveBytes":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self._phases = _phases(self._prof)
        return False

    @contextlib.contextmanager
    def phase(self, name: str):
        with record_function(_PREFIX + name):
            yield

    def peak(self, name: str) -> int:
        """Highest live bytes during the phase, over those at its start."""
        start, _, high = self._phases[name]
        return high - start

    def left(self, name: str) -> int:
        """Live bytes at the phase's end, over those at its start (what it left allocated)."""
        start, end, _ = self._phases[name]
        return end - start


def _phases(prof) -> Dict[str, Tuple[int, int, int]]:
    points: List[tuple] = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name == "[memory]":
            points.append((e.start_ns(), 1, e.nbytes()))
        elif name.startswith(_PREFIX):
            points.append((e.start_ns(), 0, name[len(_PREFIX):]))
            points.append((e.start_ns() + e.duration_ns(), 2, name[len(_PREFIX):]))
    points.sort(key=lambda p: (p[0], p[1]))  # at one instant: phase starts, then allocations, then phase ends
    live, open_, done = 0, {}, {}
    for _, kind, value in points:
        if kind == 1:
            live += value
            for name, (start, high) in open_.items():
                open_[name] = (start, max(high, live))
        elif kind == 0:
            open_[value] = (live, live)
        else:
            start, high = open_.pop(value)
            done[value] = (start, live, high)
    return done
