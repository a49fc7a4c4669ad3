"""The detectors' windowed medians: the same events, levels and messages as one np.median call a step (the
former code, kept here as the twin), in one sort a read."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaptive_amp.detectors import Event, GradNormAnomaly, LossSpike, SeriesView, robust_z, window_medians


def _series(seed, n, *, spikes=6, bad=0.05):
    """A falling noisy loss and gradient norm with planted spikes, NaN/inf (at the first and last step too),
    skipped steps and clipped stretches."""
    rng = np.random.default_rng(seed)
    loss = 3.0 * np.exp(-np.arange(n) / 300) + 0.5 + rng.normal(0, 0.02, n)
    norm = np.exp(rng.normal(0, 0.3, n))
    for i in rng.choice(np.arange(30, n), spikes, replace=False):
        loss[i] *= rng.choice([1.5, 4.0, 30.0])
        norm[i:i + rng.integers(1, 8)] *= rng.choice([3.0, 20.0, 200.0])
    for arr in (loss, norm):
        arr[rng.random(n) < bad] = rng.choice([np.nan, np.inf, -np.inf])
        arr[0], arr[-1] = np.nan, np.inf
    if seed % 2:
        loss -= 2.0  # losses that cross zero: compared linearly, not as logarithms
    found = rng.random(n) < 0.03
    clip = np.where(rng.random(n) < 0.5, 1.0, np.nan)
    return loss, norm, found, clip


def _view(loss, norm, found, clip, first_new):
    n = len(loss)
    return SeriesView(steps=np.arange(n), known_loss=np.ones(n, bool), loss=loss, found=found, grad_norm=norm,
                      scale=np.ones(n), first_new=first_new, layer_stats=[], max_grad_norm=clip)


class _LossSpikeTwin(LossSpike):
    """LossSpike as it was: np.median of each step's window."""

    def detect(self, view):
        events = []
        for i in view.new:
            ref = view.loss[max(0, i - self.window):i]
            ref = ref[np.isfinite(ref)]
            value = view.loss[i]
            if ref.size:
                med = float(np.median(ref))
                self._level = max(self._level, abs(med))
            else:
                continue
            log = value > 0 and ref.size and ref.min() > 0
            z = robust_z(np.log(ref), math.log(value), self.min_history) if log else \
                robust_z(ref, value, self.min_history)
            if z <= self.z:
                continue
            rise = value - med
            if rise < self.rel * max(abs(med), 1e-12) or value <= float(ref.max()) or \
                    rise < self.of_level * self._level:
                continue
            events.append(Event(int(view.steps[i]), self.kind,
                                f"loss {value:.4g} is {z:.1f} robust standard deviations"
                                f"{' of the log-losses' if log else ''} above the median {med:.4g} of the "
                                f"previous {ref.size} steps", data={"z": z, "loss": value}))
        return events


class _GradNormTwin(GradNormAnomaly):
    """GradNormAnomaly as it was: the median before the window's maximum."""

    def detect(self, view):
        events = []
        norm, found = view.grad_norm, view.found
        clipped = np.isfinite(view.max_grad_norm)
        usable = ~found & np.isfinite(norm) & (norm > 0)
        for i in view.new:
            if found[i] or math.isnan(norm[i]):
                continue
            if math.isinf(norm[i]):
                events.append(Event(int(view.steps[i]), self.kind, "gradient norm is inf on a step that was "
                                    "not skipped", data={"norm": norm[i]}))
                continue
            if not usable[i]:
                continue
            if self._level is not None:
                if norm[i] >= self._level:
                    continue
                self._level = None
            need = self.persist if clipped[i] else 1
            run = np.flatnonzero(usable[:i + 1])[-need:]
            if run.size < need or not clipped[run].all() and need > 1:
                continue
            first = int(run[0])
            lo = max(0, first - self.window)
            ref = norm[lo:first][usable[lo:first]]
            if ref.size < self.min_history:
                continue
            med = float(np.median(ref))
            low = float(norm[run].min())
            if low < self.factor * med or low <= float(ref.max()):
                continue
            z = robust_z(np.log(ref), math.log(low), self.min_history)
            if z <= self.z:
                continue
            self._level = self.factor * med
            if need == 1:
                message = (f"gradient norm {norm[i]:.4g} is {norm[i] / med:.1f}x the median of the previous "
                           f"{ref.size} steps ({z:.1f} robust standard deviations of the log-norms)")
            else:
                message = (f"gradient norm stayed at least {low / med:.1f}x the median of the previous {ref.size} "
                           f"steps for {need} clipped steps since step {int(view.steps[first])} (now {norm[i]:.4g}, "
                           f"clip {view.max_grad_norm[i]:g}; {z:.1f} robust standard deviations of the log-norms)")
            events.append(Event(int(view.steps[i]), self.kind, message,
                                data={"z": z, "norm": float(norm[i]), "steps": need}))
        return events


@pytest.mark.parametrize("window", [1, 2, 7, 100])
@pytest.mark.parametrize("seed", range(4))
def test_window_medians_are_np_median_and_max_of_each_windows_finite_values(seed, window):
    loss = _series(seed, 157)[0]
    at = np.arange(len(loss))
    med, top, count = window_medians(loss, at, window)
    for i in at:
        ref = loss[max(0, i - window):i]
        ref = ref[np.isfinite(ref)]
        assert count[i] == ref.size
        if ref.size:
            assert med[i] == np.median(ref) and top[i] == ref.max()  # bitwise
        else:
            assert np.isnan(med[i]) and np.isnan(top[i])


def test_window_medians_of_nothing():
    med, top, count = window_medians(np.array([1.0, 2.0]), [], 5)
    assert med.size == top.size == count.size == 0
    med, top, count = window_medians(np.array([np.nan, np.inf, 3.0]), [0, 1, 2], 5)
    assert np.isnan(med).all() and count.tolist() == [0, 0, 0]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("read_every", [1, 13, 50])
def test_loss_spike_and_grad_norm_events_unchanged(seed, read_every):
    """Read by read as the monitor does (each read sees the new steps and the window before them): the same
    events, z-scores and levels as the former code."""
    loss, norm, found, clip = _series(seed, 900)
    pairs = [(LossSpike(), _LossSpikeTwin()), (LossSpike(z=3.0, rel=0.01, window=20, min_history=5),
                                               _LossSpikeTwin(z=3.0, rel=0.01, window=20, min_history=5)),
             (GradNormAnomaly(), _GradNormTwin()),
             (GradNormAnomaly(z=2.0, factor=1.5, window=30, min_history=5, persist=2),
              _GradNormTwin(z=2.0, factor=1.5, window=30, min_history=5, persist=2))]
    seen = {id(d): [] for pair in pairs for d in pair}
    for end in range(read_every, len(loss) + read_every, read_every):
        end = min(end, len(loss))
        first = end - read_every if end % read_every == 0 else end - end % read_every
        base = max(0, first - 100)
        view = _view(loss[base:end], norm[base:end], found[base:end], clip[base:end], first - base)
        view.steps = view.steps + base
        for fast, twin in pairs:
            seen[id(fast)] += [(e, e.data) for e in fast.detect(view)]
            seen[id(twin)] += [(e, e.data) for e in twin.detect(view)]
            assert fast.state_dict() == twin.state_dict()
    for fast, twin in pairs:
        assert seen[id(fast)] == seen[id(twin)]
    assert all(seen[id(fast)] for fast, _ in pairs)  # each found some of the planted spikes


@pytest.mark.parametrize("make, match", [
    (lambda: LossSpike(z=float("nan")), "z must be a finite number > 0"),
    (lambda: LossSpike(window=2.5), "window must be an int >= 1"),
    (lambda: GradNormAnomaly(factor=-5), "factor must be a finite number > 0"),
    (lambda: GradNormAnomaly(persist=0), "persist must be an int >= 1"),
    (lambda: GradNormAnomaly(min_history="20"), "min_history must be an int >= 1")])
def test_bad_detector_thresholds_are_refused_by_name(make, match):
    # (a NaN z made every candidate a spike: no comparison with NaN is true, so none was ruled out)
    with pytest.raises(ValueError, match=match):
        make()
