"""Where a tuned controller's step time goes, against its recipe's plain loop (issue 21: the tuned compiled
Llama 1.1B ran at 44.9 ms a step, the bf16-weights plain loop at 31.0 ms, in separate calls).

    python bench/tuned_gap.py [--model llama-1b] [--compiled] [--candidates bf16,bf16-weights] [--json PATH]
    python bench/tuned_gap.py --cpu --compiled    # the tiny Llama on the CPU (tests/test_tuned_gap_script.py)

Ten loops of one recipe, on copies of the model (compiled with --compiled):
``tuned`` (``AdaptiveMixedPrecision(..., policy="tune", tune=dict(candidates=...))``; its choice is the recipe),
``tuned-no-stats`` and ``tuned-no-norm`` (the same controller, model and graphs, with its per-layer statistics
or its gradient norm turned off for its steps: what each costs),
``controller`` (the controller given that recipe's policy and an optimizer made as the recipe makes it),
``controller-no-norm`` (the same with ``track_grad_norm=False``: what the gradient norm it measures costs),
``tuned-model-plain`` (the plain step on the tuned controller's own model and optimizer, not through the
controller: the controller's per-step code told from the state its model runs in; ``tuned-model-amp-autocast``
the same with its forward in the controller's ``autocast()``, ``tuned-model-amp-step`` with the controller's
backward, step and zero_grad, ``tuned-model-amp-parts`` with all of them: ``tuned`` but for
``pressure.train_step``'s retry loop) and
``alone`` (recipes.AppliedRecipe's plain loop: what a trial times); ``--loops tuned,alone`` times only those
(more round pairs in a call's time). ``--plain-process`` adds ``plain``: the plain loop in a process of its own,
which never made a controller (see PlainProcess); every loop's ratio to it is the whole cost of the controller,
costs it adds to its process included. All step through ``train_step`` or the plain step, on the same
batches. They are timed in interleaved rounds (medians: clock drift hits all alike; the rounds take every order
of the loops in turn, so each loop follows each other as often), then each is profiled for --profile-steps
steps: wall time, device busy time (the sum of its kernels' times: a gap with equal busy
time is host time) and launches per step, the ops whose count or device time differs from ``alone``'s, and the
Python functions that take the most host time (cProfile).

A round is --round-steps steps, by default the controller's ``read_every`` (50): each controller round then
holds one read, and one round in four a statistics step (every 200 steps by default), their cost spread over
the steps as in training. Per round: the wall time, the main thread's CPU time (the whole, and in the loop's
forward, in ``Tensor.backward`` and in its optimizers' ``step``: PhaseClock), the other threads' CPU time
(autograd's device thread runs the backward's host work) and the device's elapsed time between CUDA events;
around each forward, the core's speed (a fixed piece of Python timed just before it), the main thread's context
switches and the device's time split into the forwards and the spans between them (``--bare-forward`` leaves
only the CPU clock; ``--pin-main`` pins the main thread to one core). Each controller loop's ratio to the plain
loop is given per round pair, as their median and as the geometric mean with a 95% bootstrap interval. After the
rounds, one more round of each loop is timed step by step, and one with the host time inside the controller's
phases (PHASES: its step, the statistics gathered, the read (its copy to the host queued, then taken a step
later), the detectors, the adaptation), which is where a host-bound gap goes.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import io
import json
import os
import pstats
import resource
import statistics
import sys
import threading
import time
from typing import Optional

import numpy as np
import torch

from adaptive_amp import AdaptiveMixedPrecision, GradScaler, zoo
from adaptive_amp.bench.e2e import MODELS
from adaptive_amp.bench.op_profile import profile_steps
from adaptive_amp.collect import hooks_guarded
from adaptive_amp.recipes import AppliedRecipe


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


#: The loops timed side by side: the tuned controller, the controller given its policy (with and without the
#: gradient norm it measures), the plain loop stepping the tuned controller's own model and optimizer (as it is,
#: with its forward in the controller's autocast(), with the controller's backward and step, with both), and
#: the recipe alone.
LOOPS = ("tuned", "tuned-no-stats", "tuned-no-norm", "controller", "controller-no-norm", "tuned-model-plain",
         "tuned-model-amp-autocast", "tuned-model-amp-step", "tuned-model-amp-parts", "alone")
#: The tuned controller's own settings turned off for its steps in these loops' rounds (same model, graphs and
#: optimizer as "tuned"): what its per-layer statistics and its gradient norm cost.
TOGGLED = {"tuned-no-stats": "layer_stats", "tuned-no-norm": "track_grad_norm"}


def _loops(zm, batches, compiled: bool, candidates, lr, amp_kwargs=None, names=LOOPS, tune_kwargs=None):
    """{name: step(batch)} of the LOOPS in `names` (the tuned one is always built: it holds the recipe); the
    tuning's result; the controllers and the plain loop's AppliedRecipe, kept alive."""
    def copy_of():
        m = copy.deepcopy(zm.model)
        return m, (torch.compile(m) if compiled else m), torch.optim.AdamW(m.parameters(), lr=lr)

    loops, keep = {}, []
    m, fwd, opt = copy_of()
    amp_kwargs = amp_kwargs or {}
    tuned = AdaptiveMixedPrecision(fwd, opt, policy="tune", progress=False, **amp_kwargs,
                                   tune=dict(batches=batches, loss_fn=zm.loss, candidates=candidates,
                                             progress=lambda s: print(s, flush=True), **(tune_kwargs or {})))
    recipe = tuned.tuning.recipe
    loss = _clocked("forward", zm.loss)
    loops["tuned"] = lambda b, a=tuned, f=fwd: a.train_step(lambda: loss(f, b))
    keep.append(tuned)
    for name, setting in TOGGLED.items():
        def toggled_step(b, a=tuned, f=fwd, setting=setting):
            was = getattr(a, setting)
            setattr(a, setting, False)
            try:
                return a.train_step(lambda: loss(f, b))
            finally:
                setattr(a, setting, was)
        loops[name] = toggled_step
    # The plain loop's step (as AppliedRecipe.train_step) on the tuned controller's model and optimizer, not
    # through the controller, and with some or all of the controller's parts: tells the controller's own per-step
    # work from what the model, its graphs and its optimizer carry from being tuned and controlled. (They train
    # the same model as "tuned", in other rounds: only the timing matters.)
    scaler = GradScaler(next(m.parameters()).device.type, enabled=False)

    def plain_rest(value, o=tuned.optimizers[0]):
        """The plain step after its forward (as AppliedRecipe.train_step), on the tuned controller's optimizer."""
        scaler.scale(value).backward()
        scaler.step(o)
        scaler.update()
        o.zero_grad(set_to_none=True)
        return value.detach()

    def amp_rest(value, a=tuned):
        """The controller's backward, step and zero_grad after a forward (as pressure.train_step calls them)."""
        a.backward(value)
        a.step()
        a.zero_grad(set_to_none=True)
        return value.detach()

    # name: (the forward's context, the rest of the step). The controller's autocast() holds a statistics step
    # when its step count is at one: with the plain rest, which does not count steps, once a round at most.
    # "tuned-model-amp-parts" is "tuned" but for pressure.train_step's out-of-memory retry loop.
    variants = {"tuned-model-plain": (tuned.adjuster.autocast, plain_rest),
                "tuned-model-amp-autocast": (tuned.autocast, plain_rest),
                "tuned-model-amp-step": (tuned.adjuster.autocast, amp_rest),
                "tuned-model-amp-parts": (tuned.autocast, amp_rest)}
    for name, (context, rest) in variants.items():
        if name in names:
            def tuned_model_step(b, context=context, rest=rest, f=fwd):
                with context():
                    value = loss(f, b)
                return rest(value)
            loops[name] = tuned_model_step

    def controller(name, **kwargs):
        m, f, o = copy_of()
        # The optimizer as the tuned controller's: the recipe's conversion of the user's, without its casts.
        a = AdaptiveMixedPrecision(f, AppliedRecipe(recipe, m, o, precision=False).optimizer, policy=tuned.policy,
                                   progress=False, **{**amp_kwargs, **kwargs})
        loops[name] = lambda b: a.train_step(lambda: loss(f, b))
        keep.append(a)

    if "controller" in names:
        controller("controller")
    if "controller-no-norm" in names:
        # The same without the gradient norm it measures when nothing else does: what that norm costs.
        controller("controller-no-norm", track_grad_norm=False)

    m3, fwd3, opt3 = copy_of()
    alone = AppliedRecipe(recipe, m3, opt3)
    keep.append(alone)
    loops["alone"] = lambda b, r=alone, f=fwd3: r.train_step(lambda: loss(f, b))
    return loops, tuned.tuning, keep


def balanced_orders(names) -> list:
    """A Williams design: orders of `names` in which each name takes each place, and each name directly
    follows each other name, equally often (n orders for an even number of names, 2n for an odd one)."""
    n = len(names)
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(i + r) % n for i in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [tuple(names[i] for i in row) for row in rows]


def _cpu_phases(loop: dict) -> dict:
    """A loop's main-thread CPU ms a step, by round: all of it, its forward, its backward, the rest, and of the
    rest its optimizer step (the two loops that share an optimizer run the same step: a difference there is
    the state it runs in, not the controller's code)."""
    whole, fwd, bwd = loop["round_host_cpu_ms"], loop["round_forward_cpu_ms"], loop["round_backward_cpu_ms"]
    return {"all": whole, "forward": fwd, "backward": bwd, "rest": [a - f - b for a, f, b in zip(whole, fwd, bwd)],
            "optimizer": loop["round_optimizer_cpu_ms"]}


def _paired_difference(mine, base) -> dict:
    """The mean of round-paired differences and its standard error."""
    d = [a - b for a, b in zip(mine, base)]
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return {"mean": statistics.fmean(d), "se": se, "pairs": len(d)}


def geometric_mean_ci(ratios, draws: int = 2000, seed: int = 0):
    """The geometric mean of paired ratios and its 95% bootstrap interval (percentiles of resampled means)."""
    logs = np.log(np.asarray(ratios, dtype=np.float64))
    rng = np.random.default_rng(seed)
    means = logs[rng.integers(0, len(logs), size=(draws, len(logs)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(np.exp(logs.mean())), [float(np.exp(lo)), float(np.exp(hi))]


class GcClock:
    """The interpreter's garbage-collection pauses (gc.callbacks) while it is installed: ms and collections
    by generation. A host-bound loop waits for every pause, and a loop that makes more objects collects more
    often. (On the compiled Llama 1.1B, H200: 0.01 ms a step, no full collection; not the gap.)"""

    def __init__(self):
        self.ms, self.collections, self._t0 = 0.0, [0, 0, 0], None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.collections[info["generation"]] += 1
            self._t0 = None

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


class PhaseClock:
    """The main thread's CPU ms in the loops' forward (their closure), backward (``Tensor.backward``) and
    optimizer step (their optimizers' ``step``, part of the rest) while entered: with the round's whole CPU
    time, where a loop's host time goes (the rest is its optimizer step and its own code). The loops run the
    same compiled graphs, so a difference in their forward or backward is not the controller's code but the state
    it runs them in.

    Around each forward it also takes what tells a slower host from more host work and from a device that
    waits: the main thread's context switches in it (voluntary: it blocked; involuntary: it was preempted),
    the time of a fixed piece of Python just before it (``cpu_probe``: the core's speed then, not the
    forward's work), and with ``cuda`` two CUDA events, so that the device's elapsed time splits into each
    forward's span and the span from one forward's end to the next one's start (backward, optimizer step,
    the loop's own work). The same kernels run in both spans of every loop, so a longer span is device time
    spent waiting for the host."""

    current: Optional["PhaseClock"] = None

    def __init__(self, cuda: bool = False, around: bool = True):
        self.ms = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.cuda = cuda
        self.around = around  # False: the CPU clocks alone (--bare-forward)
        self.switches = [0, 0]  # the main thread's voluntary and involuntary context switches in the forwards
        self.probe_us: list = []
        self.events: list = []  # (start, end) of each forward, on the current stream

    def __enter__(self):
        PhaseClock.current = self
        return self

    def __exit__(self, *exc):
        PhaseClock.current = None

    def device_spans(self):
        """After a synchronization: the device's mean ms a step in the forwards, and between one forward's
        end and the next one's start (None without CUDA events or with fewer than two forwards)."""
        if len(self.events) < 2:
            return None, None
        fwd = statistics.fmean(a.elapsed_time(b) for a, b in self.events)
        between = statistics.fmean(self.events[i][1].elapsed_time(self.events[i + 1][0])
                                   for i in range(len(self.events) - 1))
        return fwd, between


def cpu_probe(n: int = 400) -> float:
    """µs of a fixed piece of pure Python: how fast the core runs the main thread at that moment."""
    t0 = time.perf_counter_ns()
    x = 0
    for i in range(n):
        x += i * i
    return (time.perf_counter_ns() - t0) / 1e3


def _switches():
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_nvcsw, r.ru_nivcsw


def _clocked(phase: str, fn):
    """`fn`, its main-thread CPU time added to the entered PhaseClock's `phase` (and for the forward, what
    PhaseClock takes around it)."""
    def run(*args, **kwargs):
        clock = PhaseClock.current
        if clock is None:
            return fn(*args, **kwargs)
        forward = phase == "forward" and clock.around
        if forward:
            clock.probe_us.append(cpu_probe())
            sw = _switches()
            if clock.cuda:
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.ms[phase] += (time.thread_time() - t0) * 1e3
            if forward:
                if clock.cuda:
                    events[1].record()
                    clock.events.append(events)
                clock.switches = [c + b - a for c, a, b in zip(clock.switches, sw, _switches())]
    return run


#: The CUDA caching allocator's counts a round's difference is kept of: device allocations and frees (each a
#: driver call; a free synchronizes the device), retries after a failed allocation, and synchronizations.
ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _allocator_counts(cuda) -> dict:
    if not cuda:
        return {k: 0 for k in ALLOCATOR_COUNTS}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ALLOCATOR_COUNTS}


def timed_round(step, batches, n, cuda, gc_clock, other_threads=None):
    """One round of n steps: (wall ms, the main thread's CPU ms, the device's elapsed ms or None) a step. With
    a list for `other_threads`, appends the CPU ms a step of the process's other threads (autograd's device
    thread runs the backward's host work there)."""
    _sync(cuda)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    if cuda:
        events[0].record()
    with gc_clock:
        for i in range(n):
            step(batches[i % len(batches)])
    if cuda:
        events[1].record()
    c1, p1 = time.thread_time(), time.process_time()
    if other_threads is not None:
        other_threads.append(((p1 - p0) - (c1 - c0)) * 1e3 / n)
    _sync(cuda)
    return ((time.perf_counter() - t0) * 1e3 / n, (c1 - c0) * 1e3 / n,
            events[0].elapsed_time(events[1]) / n if cuda else None)


def apply_dynamo_config(settings: dict) -> dict:
    """Set torch._dynamo.config's `settings` (--dynamo-config); returns them as dynamo now has them."""
    from torch._dynamo import config

    for k, v in settings.items():
        setattr(config, k, v)
    return {k: getattr(config, k) for k in settings}


def _plain_child(conn, spec):
    """The recipe's plain loop in a process that never made a controller (see PlainProcess). Times a round
    whenever the parent asks."""
    torch.set_num_threads(spec["threads"])  # as the parent's (a spawned process starts with torch's default)
    applied = apply_dynamo_config(spec.get("dynamo_config", {}))
    torch.manual_seed(0)
    cuda = spec["device"] == "cuda"
    zm = zoo.build(spec["family"], spec["size"], seed=0, device=spec["device"])  # the parent's weights
    batches = [zm.make_batch(spec["batch"], seed=i, device=spec["device"], seq_len=spec["seq"]) for i in range(8)]
    fwd = torch.compile(zm.model) if spec["compiled"] else zm.model
    plain = AppliedRecipe(spec["recipe"], zm.model, torch.optim.AdamW(zm.model.parameters(), lr=spec["lr"]))

    def step(b):
        return plain.train_step(lambda: zm.loss(fwd, b))

    for i in range(spec["warmup"]):
        step(batches[i % len(batches)])
    _sync(cuda)
    conn.send({"hook_guards": hooks_guarded(), "dynamo_config": applied})
    clock = GcClock()
    while conn.recv() == "round":
        conn.send(timed_round(step, batches, spec["round_steps"], cuda, clock))
    conn.send({"gc_ms": clock.ms, "gc_collections": clock.collections})


class PlainProcess:
    """The recipe's plain loop, as a user runs it without a controller, in a process of its own on the same
    device, its rounds taken in turn with the parent's.

    What a controller costs its whole process, the plain loop beside it ("alone") pays too. Until 2026-11-27
    the first controller turned on dynamo's hook guards for the process: every compiled call checked each
    module's hook dictionaries, +0.66 ms a training forward of a 22-layer Llama on an H200 host's CPU
    (bench/hook_guard_cost.py). A controller now turns them on only when it missed a statistics step
    (adaptive_amp/collect.py), and the parent reports whether they are on; this process never makes a
    controller, so its ratio is the controller's whole cost. The parent waits while it runs a round, and it
    waits while the parent runs one.
    """

    def __init__(self, spec):
        import multiprocessing

        # Spawned (CUDA cannot fork): the child finds _plain_child by its module's name, as this script's main
        # module or as `tuned_gap` imported from bench/ (not as a module loaded from its path alone).
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_plain_child, args=(child, spec), daemon=True)
        self._proc.start()
        self.info = self._recv()  # after its warm-up

    def _recv(self):
        while not self._conn.poll(5.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"the plain loop's process died (exit code {self._proc.exitcode}); its "
                                   "error is above")
        return self._conn.recv()

    def round(self):
        self._conn.send("round")
        return self._recv()

    def close(self) -> dict:
        self._conn.send("stop")
        info = self._recv()
        self._proc.join(60)
        return info


def _profile(step, batches, n, cuda):
    ops, _, wall = profile_steps(lambda i: step(batches[i % len(batches)]), n, cuda)
    busy = sum(us for _, us in ops.values()) / 1e3
    return {"wall_ms": wall, "device_busy_ms": busy, "launches": sum(c for c, _ in ops.values())}, ops


def _step_times(step, batches, n, cuda):
    """Each of n steps' wall ms, unsynchronized (a host-bound loop's host time a step: statistics steps and
    reads stand out), and the main thread's CPU ms in each step's forward."""
    _sync(cuda)
    times, forward = [], []
    for i in range(n):
        with PhaseClock() as clock:
            t0 = time.perf_counter()
            step(batches[i % len(batches)])
            times.append((time.perf_counter() - t0) * 1e3)
        forward.append(clock.ms["forward"])
    _sync(cuda)
    return times, forward


#: The controller's host phases `phase_times` times: (owner, attribute, label). The forward (the closure, run
#: inside the controller's autocast) is what "all steps" leaves besides backward and step.
PHASES = (("adaptive_amp.controller", "AdaptiveMixedPrecision.backward", "backward"),
          ("adaptive_amp.controller", "AdaptiveMixedPrecision.step", "step (all of it)"),
          ("adaptive_amp.controller", "AdaptiveMixedPrecision._record_gradient_stats", "gradient statistics"),
          ("adaptive_amp.collect", "ActivationCollector.stats", "layer statistics gathered"),
          ("adaptive_amp.monitor", "StabilityMonitor.poll", "poll, reads included"),
          ("adaptive_amp.monitor", "StabilityMonitor.read", "read at once (an adapting controller's)"),
          ("adaptive_amp.monitor", "_HostCopy.__init__", "read: copy to the host queued"),
          ("adaptive_amp.monitor", "_HostCopy.values", "read: copy taken (waits for the device)"),
          ("adaptive_amp.monitor", "StabilityMonitor._detect", "read: detectors"),
          ("adaptive_amp.controller", "AdaptiveMixedPrecision._adapt", "adapt after a read"),
          ("adaptive_amp.controller", "AdaptiveMixedPrecision._judge", "judge a step's result"))


def phase_times(step, batches, n, cuda):
    """Host ms spent in each of PHASES over n steps of `step` (wall time inside the function, callees included;
    no synchronization added), and the steps' total."""
    import importlib

    totals = {label: 0.0 for _, _, label in PHASES}
    undo = []
    for module_name, path, label in PHASES:
        owner = importlib.import_module(module_name)
        *outer, attr = path.split(".")
        for name in outer:
            owner = getattr(owner, name)
        real = getattr(owner, attr)

        def timed(*args, _real=real, _label=label, **kwargs):
            t0 = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                totals[_label] += (time.perf_counter() - t0) * 1e3
        setattr(owner, attr, timed)
        undo.append((owner, attr, real))
    try:
        _sync(cuda)
        t0 = time.perf_counter()
        for i in range(n):
            step(batches[i % len(batches)])
        _sync(cuda)
        totals["all steps"] = (time.perf_counter() - t0) * 1e3
    finally:
        for owner, attr, real in reversed(undo):
            setattr(owner, attr, real)
    return totals


def _host_profile(step, batches, n, cuda, top=12):
    """cProfile over n steps: its text (the functions with the most own host time, and adaptive_amp's by
    cumulative time) and {function: (calls, own seconds)} per step."""
    _sync(cuda)
    pr = cProfile.Profile()
    pr.enable()
    for i in range(n):
        step(batches[i % len(batches)])
    _sync(cuda)
    pr.disable()
    s = io.StringIO()
    stats = pstats.Stats(pr, stream=s)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("adaptive_amp", top)
    own = {f"{path.split('site-packages/')[-1]}:{line}({fn})": (calls / n, seconds / n)
           for (path, line, fn), (_, calls, seconds, _, _) in stats.stats.items()}
    return s.getvalue(), own


def host_diff(mine, base, top=20):
    """The functions whose own host time a step differs most from `base`'s: [function, calls a step more,
    own µs a step more]."""
    rows = [[k, mine.get(k, (0, 0.0))[0] - base.get(k, (0, 0.0))[0],
             (mine.get(k, (0, 0.0))[1] - base.get(k, (0, 0.0))[1]) * 1e6] for k in set(mine) | set(base)]
    return sorted(rows, key=lambda r: -abs(r[2]))[:top]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--candidates", default="bf16,bf16-weights")
    p.add_argument("--loops", default=",".join(LOOPS),
                   help="the loops to time (alone and at least one other): fewer loops, more rounds of each")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--rounds-seconds", type=float, default=None,
                   help="stop starting rounds after this many seconds of them (--rounds is then the most)")
    p.add_argument("--round-steps", type=int, default=50, help="steps a round (default: the controller's read_every)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--amp-kwargs", type=json.loads, default={}, metavar="JSON",
                   help='the controllers\' options, e.g. \'{"layer_stats": false}\' or \'{"read_every": 1000}\'')
    p.add_argument("--tune-kwargs", type=json.loads, default={}, metavar="JSON",
                   help='the tuning\'s options (AdaptivePrecisionSelector.tune), e.g. \'{"steps": 4, "rounds": 2}\': '
                        "a shorter tuning, so that a larger batch fits a call")
    p.add_argument("--plain-process", action="store_true",
                   help="also time the recipe's plain loop in a process of its own, which never made a controller "
                        "(loop 'plain'; rounds only)")
    p.add_argument("--dynamo-config", type=json.loads, default={}, metavar="JSON",
                   help="torch._dynamo.config settings for every loop (the plain process's too), e.g. "
                        "'{\"use_recursive_dict_tags_for_guards\": false}'")
    p.add_argument("--pin-main", action="store_true",
                   help="pin the main thread to one core for the rounds (the other threads keep theirs): whether "
                        "the scheduler moving it between cores makes the difference")
    p.add_argument("--bare-forward", action="store_true",
                   help="around each forward only its CPU clock, as until 2026-11-27 (no probe, context switches or "
                        "CUDA events): whether taking them changes what is measured")
    p.add_argument("--cpu", action="store_true", help="the tiny model on the CPU (aten ops instead of kernels)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    names = args.loops.split(",")
    if "alone" not in names or len(names) < 2 or set(names) - set(LOOPS) or len(set(names)) != len(names):
        p.error(f"--loops: name 'alone' and at least one of {', '.join(LOOPS[:-1])}, each once "
                f"(got {args.loops!r})")
    from torch._dynamo import config as dynamo_config

    if not isinstance(args.dynamo_config, dict):
        p.error(f"--dynamo-config: a JSON object of torch._dynamo.config names to values (got "
                f"{args.dynamo_config!r})")
    unknown = [k for k in args.dynamo_config if not hasattr(dynamo_config, k)]
    if unknown:
        p.error(f"--dynamo-config: torch {torch.__version__}'s torch._dynamo.config has no {', '.join(unknown)}")
    if not isinstance(args.tune_kwargs, dict):
        p.error(f"--tune-kwargs: a JSON object of the tuning's options (got {args.tune_kwargs!r})")
    apply_dynamo_config(args.dynamo_config)
    cuda = not args.cpu
    device = "cuda" if cuda else "cpu"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench/tuned_gap.py needs a CUDA GPU (or --cpu)")
    family, size = MODELS[args.model]
    zm = zoo.build(family, "tiny" if args.cpu else size, seed=0, device=device)
    batches = [zm.make_batch(2 if args.cpu else args.batch, seed=i, device=device,
                             seq_len=None if args.cpu else args.seq) for i in range(8)]
    loops, tuning, _keep = _loops(zm, batches, args.compiled, args.candidates.split(","), args.lr, args.amp_kwargs,
                                  names, args.tune_kwargs)
    loops = {name: loops[name] for name in LOOPS if name in names}
    print(tuning.table(), flush=True)
    for name, step in loops.items():  # warm-up: compiles (the controllers' statistics graph too)
        t0 = time.perf_counter()
        for i in range(args.warmup):
            step(batches[i % len(batches)])
        _sync(cuda)
        print(f"warm-up {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    plain = None
    if args.plain_process:
        t0 = time.perf_counter()
        plain = PlainProcess({"family": family, "size": "tiny" if args.cpu else size, "device": device,
                              "batch": 2 if args.cpu else args.batch, "seq": None if args.cpu else args.seq,
                              "compiled": args.compiled, "lr": args.lr, "recipe": tuning.recipe,
                              "warmup": args.warmup, "round_steps": args.round_steps,
                              "threads": torch.get_num_threads(), "dynamo_config": args.dynamo_config})
        print(f"warm-up plain (its own process): {time.perf_counter() - t0:.1f} s; {plain.info}", flush=True)
    timed = list(loops) + (["plain"] if plain else [])
    # Orders in which each loop takes each place, and follows each other loop, equally often (with three loops,
    # rotating one order made "tuned" follow the other process's "plain" in two rounds of three, "alone" in one;
    # every permutation in turn put "tuned" first in each of the first 24 rounds of five loops).
    orders = balanced_orders(timed)
    times, host, device_ms = ({name: [] for name in timed} for _ in range(3))
    gc_clocks = {name: GcClock() for name in loops}
    # Main-thread CPU ms a step, by round.
    phase_cpu = {name: {"forward": [], "backward": [], "optimizer": []} for name in loops}
    # By round: the device's ms a step in the forwards and between them, the CPU probe's median µs, and the
    # main thread's voluntary and involuntary context switches a step in the forwards (PhaseClock).
    spans = {name: {"forward": [], "between": []} for name in loops}
    probe = {name: [] for name in loops}
    switches = {name: {"voluntary": [], "involuntary": []} for name in loops}
    cores = os.sched_getaffinity(0)
    if args.pin_main:
        # The main thread only (Linux applies it to the calling thread); after the warm-up, so the threads
        # made there (autograd's, inductor's) keep every core. Given back after the rounds.
        os.sched_setaffinity(0, {min(cores)})
        print(f"main thread pinned to core {min(cores)} for the rounds", flush=True)
    allocator = {name: {} for name in loops}  # the CUDA caching allocator's counts over the rounds
    other_cpu = {name: [] for name in loops}  # the other threads' CPU ms a step (the backward's host work), by round
    threads = sorted(t.name for t in threading.enumerate())  # Python threads besides the main one take its GIL
    rounds_start = time.perf_counter()
    backward = torch.Tensor.backward
    torch.Tensor.backward = _clocked("backward", backward)
    # The optimizers' step, clocked on their classes as the backward is on Tensor (torch's Optimizer wraps each
    # class's step once, for its hooks; the clock goes around that and comes off after the rounds).
    steps = {cls: cls.__dict__.get("step") for cls in {type(o) for k in _keep for o in
                                                        (k.optimizers if hasattr(k, "optimizers") else [k.optimizer])}}
    for cls in steps:
        cls.step = _clocked("optimizer", cls.step)
    try:
        for r in range(args.rounds):
            if args.rounds_seconds is not None and r and time.perf_counter() - rounds_start > args.rounds_seconds:
                break
            for name in orders[r % len(orders)]:
                if name == "plain":
                    wall, cpu_ms, dev = plain.round()
                else:
                    before = _allocator_counts(cuda)
                    with PhaseClock(cuda, around=not args.bare_forward) as clock:
                        wall, cpu_ms, dev = timed_round(loops[name], batches, args.round_steps, cuda,
                                                        gc_clocks[name], other_cpu[name])
                    for phase, ms in clock.ms.items():
                        phase_cpu[name][phase].append(ms / args.round_steps)
                    fwd_span, between = clock.device_spans()  # (timed_round synchronized at its end)
                    if fwd_span is not None:
                        spans[name]["forward"].append(fwd_span)
                        spans[name]["between"].append(between)
                    if clock.around:
                        probe[name].append(statistics.median(clock.probe_us))
                        for kind, count in zip(switches[name], clock.switches):
                            switches[name][kind].append(count / args.round_steps)
                    for k, v in _allocator_counts(cuda).items():
                        allocator[name][k] = allocator[name].get(k, 0) + v - before[k]
                times[name].append(wall)
                host[name].append(cpu_ms)
                if dev is not None:
                    device_ms[name].append(dev)
    finally:
        torch.Tensor.backward = backward
        for cls, step in steps.items():
            if step is None:
                del cls.step  # (it was inherited)
            else:
                cls.step = step
        os.sched_setaffinity(0, cores)
    names = list(loops)
    res = {"model": args.model if cuda else f"{family}-tiny", "compiled": args.compiled, "chosen": tuning.recipe.name,
           "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
           # on if a controller missed a statistics step (a graph without its hooks ran): then every loop pays them
           "hook_guards": hooks_guarded(), "dynamo_config": args.dynamo_config,
           "threads": threads, "loops": {}}
    print(f"dynamo's hook guards in this process after the rounds: {'on' if res['hook_guards'] else 'off'}; "
          f"Python threads: {', '.join(threads)}", flush=True)
    ops, own = {}, {}
    for name, step in loops.items():
        summary, ops[name] = _profile(step, batches, args.profile_steps, cuda)
        res["loops"][name] = {"median_ms": statistics.median(times[name]), "round_ms": times[name],
                              "round_host_cpu_ms": host[name], "round_device_ms": device_ms[name] or None,
                              "allocator_counts": allocator[name],
                              "round_forward_cpu_ms": phase_cpu[name]["forward"],
                              "round_backward_cpu_ms": phase_cpu[name]["backward"],
                              "round_optimizer_cpu_ms": phase_cpu[name]["optimizer"],
                              "round_other_threads_cpu_ms": other_cpu[name],
                              "round_forward_device_ms": spans[name]["forward"] or None,
                              "round_between_device_ms": spans[name]["between"] or None,
                              "round_probe_us": probe[name] or None,
                              "round_forward_switches": switches[name] if probe[name] else None,
                              "gc_ms_per_step": gc_clocks[name].ms / (len(times[name]) * args.round_steps),
                              "gc_collections": gc_clocks[name].collections,
                              **summary, **dict(zip(("step_ms", "step_forward_cpu_ms"),
                                                    _step_times(step, batches, args.round_steps, cuda))),
                              "phase_ms": phase_times(step, batches, args.round_steps, cuda)}
        res["loops"][name]["host_top"], own[name] = _host_profile(step, batches, args.round_steps, cuda)
    if plain:
        res["loops"]["plain"] = {"median_ms": statistics.median(times["plain"]), "round_ms": times["plain"],
                                 "round_host_cpu_ms": host["plain"], "round_device_ms": device_ms["plain"] or None,
                                 **plain.info, **plain.close()}
        for name in names:  # alone's too: what the controllers cost the plain loop beside them
            ratios = [a / b for a, b in zip(times[name], times["plain"])]
            mean, ci = geometric_mean_ci(ratios)
            res["loops"][name]["to_plain"] = {"round_ratio": statistics.median(ratios), "mean_ratio": mean,
                                              "ci95": ci}
    alone = res["loops"]["alone"]
    for name in names[:-1]:
        # The rounds drift (24 to 43 ms a step within one call on an H200): each round's ratio to the plain
        # loop's round next to it cancels that; the device's busy time does not drift with the host.
        loop = res["loops"][name]
        ratios = [a / b for a, b in zip(times[name], times["alone"])]
        loop["round_ratio_to_alone"] = statistics.median(ratios)
        loop["mean_ratio_to_alone"], loop["mean_ratio_ci95"] = geometric_mean_ci(ratios)
        busy = alone["device_busy_ms"]  # (0 on the CPU: no kernels)
        loop["device_busy_ratio_to_alone"] = loop["device_busy_ms"] / busy if busy else None
        # The main thread's CPU a step against the plain loop's, by phase, paired by round: same graphs, so a
        # difference in forward or backward is the state they run in, in "rest" the controller's own code.
        mine, base = _cpu_phases(loop), _cpu_phases(alone)
        loop["cpu_ms_more_than_alone"] = {phase: _paired_difference(mine[phase], base[phase]) for phase in mine}
        loop["other_threads_cpu_ms_more_than_alone"] = _paired_difference(loop["round_other_threads_cpu_ms"],
                                                                          alone["round_other_threads_cpu_ms"])
        # The device's spans (same kernels in each): a longer one waited for the host. The probe: a slower core.
        if loop["round_forward_device_ms"]:
            loop["device_ms_more_than_alone"] = {
                span: _paired_difference(loop[f"round_{span}_device_ms"], alone[f"round_{span}_device_ms"])
                for span in ("forward", "between")}
        if loop["round_probe_us"]:
            loop["probe_us_more_than_alone"] = _paired_difference(loop["round_probe_us"], alone["round_probe_us"])
            loop["forward_switches_more_than_alone"] = {
                kind: _paired_difference(loop["round_forward_switches"][kind], alone["round_forward_switches"][kind])
                for kind in ("voluntary", "involuntary")}
        # Host time under cProfile over a round (the statistics step and the read included), by function.
        loop["host_differs_from_alone"] = host_diff(own[name], own["alone"])
        if "tuned-model-plain" in own and name != "tuned-model-plain":
            # The same model and graphs: what is left is the controller's own code.
            loop["host_differs_from_model_plain"] = host_diff(own[name], own["tuned-model-plain"])
        base, mine = ops["alone"], ops[name]
        res["loops"][name]["differs_from_alone"] = sorted(
            ([k, base.get(k, [0, 0.0]), mine.get(k, [0, 0.0])] for k in set(base) | set(mine)
             if abs(base.get(k, [0, 0])[0] - mine.get(k, [0, 0])[0]) > 1e-9
             or abs(base.get(k, [0, 0.0])[1] - mine.get(k, [0, 0.0])[1]) > 20.0),
            key=lambda row: -abs(row[2][1] - row[1][1]))[:25]
    for name, r in res["loops"].items():
        if name == "plain":
            print(f"== plain (its own process, hook guards {r['hook_guards']}): median {r['median_ms']:.2f} ms/step "
                  f"(rounds {', '.join(f'{t:.1f}' for t in r['round_ms'])})", flush=True)
            continue
        print(f"== {name}: median {r['median_ms']:.2f} ms/step (rounds {', '.join(f'{t:.1f}' for t in r['round_ms'])});"
              f" profiled wall {r['wall_ms']:.2f} ms, device busy {r['device_busy_ms']:.2f} ms, "
              f"{r['launches']:.0f} launches a step", flush=True)
        if "round_ratio_to_alone" in r:
            busy = r["device_busy_ratio_to_alone"]
            lo, hi = r["mean_ratio_ci95"]
            print(f"   against the plain loop: median round ratio {r['round_ratio_to_alone']:.3f}, geometric mean "
                  f"{r['mean_ratio_to_alone']:.3f} [95% {lo:.3f}, {hi:.3f}], device busy ratio "
                  f"{'n/a' if busy is None else f'{busy:.3f}'}", flush=True)
        if "to_plain" in r:
            lo, hi = r["to_plain"]["ci95"]
            print(f"   against the plain loop in its own process: median round ratio "
                  f"{r['to_plain']['round_ratio']:.3f}, geometric mean {r['to_plain']['mean_ratio']:.3f} "
                  f"[95% {lo:.3f}, {hi:.3f}]", flush=True)
        steps = r["step_ms"]
        top = sorted(range(len(steps)), key=lambda i: -steps[i])[:3]
        print(f"   one round step by step: median {statistics.median(steps):.2f} ms, above it in all "
              f"{sum(steps) - statistics.median(steps) * len(steps):.1f} ms; slowest "
              + ", ".join(f"step {i} {steps[i]:.1f} ms" for i in top), flush=True)
        print("   host ms in the controller's phases over one round: " + ", ".join(
            f"{k} {v:.1f}" for k, v in r["phase_ms"].items() if v or k == "all steps"), flush=True)
        print(f"   host CPU {statistics.median(r['round_host_cpu_ms']):.2f} ms/step (median round)"
              + (f", device elapsed {statistics.median(r['round_device_ms']):.2f} ms/step" if r["round_device_ms"]
                 else "") + f"; garbage collection {r['gc_ms_per_step']:.3f} ms/step (collections by generation "
              f"{r['gc_collections']})", flush=True)
        fwd, bwd = statistics.median(r["round_forward_cpu_ms"]), statistics.median(r["round_backward_cpu_ms"])
        print(f"   main thread CPU a step (median round): forward {fwd:.2f} ms, backward {bwd:.2f} ms; in the round "
              f"step by step, forwards {statistics.median(r['step_forward_cpu_ms']):.2f} ms (median), "
              f"{max(r['step_forward_cpu_ms']):.2f} ms (most); allocator over the rounds: {r['allocator_counts']}",
              flush=True)
        if r["round_probe_us"]:
            print(f"   the forwards (median round): CPU probe {statistics.median(r['round_probe_us']):.1f} us; context "
                  "switches a step " + ", ".join(f"{k} {statistics.median(v):.2f}"
                                                 for k, v in r["round_forward_switches"].items())
                  + ("" if not r["round_forward_device_ms"] else
                     f"; device ms a step in the forwards {statistics.median(r['round_forward_device_ms']):.2f}, "
                     f"between them {statistics.median(r['round_between_device_ms']):.2f}"), flush=True)
        if "cpu_ms_more_than_alone" in r:
            print("   main thread CPU a step more than the plain loop's (mean of round pairs, its standard error): "
                  + ", ".join(f"{phase} {d['mean']:+.2f} ({d['se']:.2f}) ms"
                              for phase, d in r["cpu_ms_more_than_alone"].items()), flush=True)
            d = r["other_threads_cpu_ms_more_than_alone"]
            print(f"   the other threads' CPU a step more than the plain loop's: {d['mean']:+.2f} ({d['se']:.2f}) ms",
                  flush=True)
            more = [f"CPU probe {d['mean']:+.2f} ({d['se']:.2f}) us" for d in [r.get("probe_us_more_than_alone")] if d]
            more += [f"{kind} switches {d['mean']:+.2f} ({d['se']:.2f})"
                     for kind, d in r.get("forward_switches_more_than_alone", {}).items()]
            more += [f"device {span} {d['mean']:+.2f} ({d['se']:.2f}) ms"
                     for span, d in r.get("device_ms_more_than_alone", {}).items()]
            if more:
                print("   more than the plain loop's, a step: " + ", ".join(more), flush=True)
        for k, (bc, bu), (mc, mu) in r.get("differs_from_alone", []):
            print(f"   {k[:80]:80} count {bc:6.1f} -> {mc:6.1f}  device {bu:9.1f} -> {mu:9.1f} us")
        for key, against in (("host_differs_from_alone", "the plain loop's"),
                             ("host_differs_from_model_plain", "the plain step on the same model")):
            if key in r:
                print(f"   host, own time a step against {against} (cProfile, {args.round_steps} steps):")
                for k, calls, us in r[key]:
                    print(f"   {us:+9.1f} us {calls:+8.2f} calls  {k[-110:]}")
        print(r["host_top"], flush=True)
    from torch._dynamo.utils import counters

    res["dynamo"] = {k: {str(a): b for a, b in v.items()} for k, v in counters.items()
                     if k in ("stats", "recompiles", "graph_break")}
    print("dynamo:", res["dynamo"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
