"""bench/tuned_gap.py (where a tuned controller's step time goes against its recipe's plain loop) in its CPU
mode: the tiny Llama, aten ops in place of kernels."""

from __future__ import annotations

import json
import math
import sys

import pytest
from conftest import load_bench_script

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_every_loop_of_the_tuned_recipe_timed_and_profiled(tmp_path, capsys):
    import torch

    backward = torch.Tensor.backward
    out = tmp_path / "gap.json"
    assert load_bench_script("tuned_gap").main(
        ["--cpu", "--candidates", "bf16-weights", "--rounds", "2", "--round-steps", "2", "--warmup", "1",
         "--profile-steps", "1", "--json", str(out)]) == 0
    assert torch.Tensor.backward is backward  # the rounds' clocks on it and on the optimizers are taken off
    from adaptive_amp.optim import AdamW

    assert AdamW.step.__qualname__ != "_clocked.<locals>.run"
    res = json.loads(out.read_text())
    assert res["chosen"] == "bf16-weights" and list(res["loops"]) == [
        "tuned", "tuned-no-stats", "tuned-no-norm", "controller", "controller-no-norm", "tuned-model-plain",
        "tuned-model-amp-autocast", "tuned-model-amp-step", "tuned-model-amp-parts", "alone"]
    assert "MainThread" in res["threads"]
    for loop in res["loops"].values():
        assert len(loop["round_ms"]) == len(loop["round_host_cpu_ms"]) == 2 and loop["median_ms"] > 0
        assert loop["launches"] > 0 and loop["round_device_ms"] is None and min(loop["round_host_cpu_ms"]) > 0
        assert "tottime" in loop["host_top"] and len(loop["step_ms"]) == len(loop["step_forward_cpu_ms"]) == 2
        assert min(loop["step_forward_cpu_ms"]) > 0 and set(loop["allocator_counts"]) == {
            "num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams"}
        assert loop["gc_ms_per_step"] >= 0 and len(loop["gc_collections"]) == 3
        # The main thread's CPU in the forward and the backward (both run on it on the CPU), within the round's.
        for fwd, bwd, opt, whole in zip(loop["round_forward_cpu_ms"], loop["round_backward_cpu_ms"],
                                        loop["round_optimizer_cpu_ms"], loop["round_host_cpu_ms"]):
            assert fwd > 0 and bwd > 0 and opt > 0 and fwd + bwd + opt < whole * 1.01
        # Around the forwards: the CPU probe, the context switches a step, no device spans on the CPU.
        assert len(loop["round_probe_us"]) == 2 and min(loop["round_probe_us"]) > 0
        assert loop["round_forward_device_ms"] is None and loop["round_between_device_ms"] is None
        # The other threads' CPU (process minus main thread; the clocks are read microseconds apart).
        assert len(loop["round_other_threads_cpu_ms"]) == 2 and min(loop["round_other_threads_cpu_ms"]) > -0.01
        assert all(len(v) == 2 and min(v) >= 0 for v in loop["round_forward_switches"].values())
    for name in ("tuned", "tuned-no-stats", "tuned-no-norm", "controller", "controller-no-norm", "tuned-model-plain",
                 "tuned-model-amp-autocast", "tuned-model-amp-step", "tuned-model-amp-parts"):
        more = res["loops"][name]["cpu_ms_more_than_alone"]
        assert set(more) == {"all", "forward", "backward", "rest", "optimizer"}
        assert all(d["pairs"] == 2 for d in more.values())
        assert more["all"]["mean"] == pytest.approx(
            more["forward"]["mean"] + more["backward"]["mean"] + more["rest"]["mean"], abs=1e-6)
        loop = res["loops"][name]
        assert loop["probe_us_more_than_alone"]["pairs"] == 2 and "device_ms_more_than_alone" not in loop
        assert loop["other_threads_cpu_ms_more_than_alone"]["pairs"] == 2
        assert set(loop["forward_switches_more_than_alone"]) == {"voluntary", "involuntary"}
    # What the controllers run beyond the plain loop: no second pass for the gradient norm they track
    # (adaptive_amp.optim's step measures it; it was a _foreach_norm a step, 4% of a compiled Llama 1.1B's).
    for name in ("tuned", "controller"):
        extra = {op: (mine[0] - base[0]) for op, base, mine in res["loops"][name]["differs_from_alone"]}
        assert "aten::_foreach_norm" not in extra
    for name in ("tuned", "controller", "controller-no-norm"):
        loop = res["loops"][name]
        assert loop["round_ratio_to_alone"] > 0 and loop["mean_ratio_ci95"][0] <= loop["mean_ratio_to_alone"] \
            <= loop["mean_ratio_ci95"][1]
        assert res["loops"][name]["device_busy_ratio_to_alone"] is None  # no kernels on the CPU
    host = res["loops"]["controller"]["host_differs_from_alone"]
    assert host and all(len(row) == 3 and isinstance(row[0], str) for row in host)
    # Against the plain step on the same model: every loop but that one and the plain loop itself.
    same = [name for name, loop in res["loops"].items() if "host_differs_from_model_plain" in loop]
    assert same == [name for name in res["loops"] if name not in ("tuned-model-plain", "alone")]
    assert all(len(row) == 3 for row in res["loops"]["tuned"]["host_differs_from_model_plain"])
    bare = {op: (mine[0] - base[0]) for op, base, mine in res["loops"]["controller-no-norm"]["differs_from_alone"]}
    assert "aten::_foreach_norm" not in bare
    assert "== alone: median" in capsys.readouterr().out


@pytest.mark.parametrize("n", range(1, 8))
def test_round_orders_balance_places_and_predecessors(n):
    """Each loop takes each place in a round, and directly follows each other loop, equally often (with every
    permutation in turn, five loops' first 24 rounds all began with the same loop)."""
    from collections import Counter

    names = [f"loop{i}" for i in range(n)]
    orders = load_bench_script("tuned_gap").balanced_orders(names)
    assert len(orders) == (n if n % 2 == 0 else 2 * n) and all(sorted(o) == names for o in orders)
    places = Counter((name, i) for o in orders for i, name in enumerate(o))
    assert set(places.values()) == {len(orders) // n}
    if n > 1:
        follows = Counter(pair for o in orders for pair in zip(o, o[1:]))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_geometric_mean_and_its_bootstrap_interval():
    gm = load_bench_script("tuned_gap").geometric_mean_ci
    mean, (lo, hi) = gm([1.1] * 5)
    assert mean == pytest.approx(1.1) and lo == pytest.approx(1.1) and hi == pytest.approx(1.1)
    mean, (lo, hi) = gm([0.5, 2.0, 1.0, 1.0])
    assert mean == pytest.approx(1.0) and lo < 1.0 < hi and lo >= 0.5 and hi <= 2.0


@pytest.mark.parametrize("layer_stats", [True, False])
def test_the_controllers_take_the_options_given(tmp_path, layer_stats):
    """--amp-kwargs reaches every controller loop: statistics at every step, with or without per-layer ones
    (the statistics hooks' record() in the profile of each controller's round)."""
    out = tmp_path / "gap.json"
    kwargs = json.dumps({"read_every": 1, "stats_every": 1, "layer_stats": layer_stats})
    assert load_bench_script("tuned_gap").main(
        ["--cpu", "--candidates", "bf16-weights", "--rounds", "1", "--round-steps", "2", "--warmup", "1",
         "--profile-steps", "1", "--amp-kwargs", kwargs, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for name in ("tuned", "controller", "controller-no-norm"):
        assert ("(record)" in res["loops"][name]["host_top"]) == layer_stats
        # The controller's phases, timed on the host: a read every step, layer statistics when asked for.
        phases = res["loops"][name]["phase_ms"]
        assert phases["step (all of it)"] > 0 and phases["poll, reads included"] > 0 and phases["read: detectors"] > 0
        assert phases["read: copy to the host queued"] > 0 and phases["read: copy taken (waits for the device)"] > 0
        assert (phases["layer statistics gathered"] > 0) == layer_stats
        assert phases["poll, reads included"] < phases["all steps"]
    # The tuned controller with its statistics turned off for the loop's steps records none.
    assert "(record)" not in res["loops"]["tuned-no-stats"]["host_top"]
    assert res["loops"]["tuned-no-stats"]["phase_ms"]["layer statistics gathered"] == 0
    assert "(record)" not in res["loops"]["alone"]["host_top"]
    alone = res["loops"]["alone"]["phase_ms"]
    assert alone["all steps"] > 0 and not any(v for k, v in alone.items() if k != "all steps")


def test_the_toggled_loops_turn_a_setting_off_for_their_steps_only():
    """tuned-no-norm steps the tuned controller without its gradient norm (none recorded for its steps), and
    tuned-no-stats without its per-layer statistics (none at a statistics step); each gives the setting back."""
    from adaptive_amp import zoo

    script = load_bench_script("tuned_gap")
    zm = zoo.build("llama", "tiny", seed=0)
    batches = [zm.make_batch(2, seed=i) for i in range(2)]
    loops, _, (tuned, _alone) = script._loops(zm, batches, False, ["bf16-weights"], 1e-4,
                                              {"read_every": 1, "stats_every": 1},
                                              names=("tuned", "tuned-no-stats", "tuned-no-norm", "alone"),
                                              tune_kwargs={"steps": 2, "rounds": 1, "timed_steps": 1})
    assert tuned.monitor.stats_every == 1 and tuned.layer_stats and tuned.track_grad_norm
    steps = {}
    for name in ("tuned-no-norm", "tuned-no-stats", "tuned"):
        steps[name] = tuned.step_count
        loops[name](batches[0])
        assert tuned.layer_stats and tuned.track_grad_norm  # given back
    tuned.monitor.read()
    history = tuned.monitor.history()
    norm = dict(zip(history["step"], history["grad_norm"]))
    assert math.isnan(norm[steps["tuned-no-norm"]])  # (none recorded)
    assert norm[steps["tuned-no-stats"]] > 0 and norm[steps["tuned"]] > 0
    with_stats = {ls.step for ls in tuned.monitor.layer_stats}
    assert steps["tuned-no-stats"] not in with_stats and {steps["tuned-no-norm"], steps["tuned"]} <= with_stats


def test_host_diff_ranks_functions_by_own_time_a_step_against_the_plain_loop():
    diff = load_bench_script("tuned_gap").host_diff
    base = {"a": (1.0, 10e-6), "b": (2.0, 5e-6)}
    mine = {"a": (1.0, 11e-6), "b": (2.0, 5e-6), "c": (3.0, 40e-6)}
    rows = diff(mine, base, top=2)
    assert [r[0] for r in rows] == ["c", "a"] and rows[0][1:] == [3.0, pytest.approx(40.0)]
    assert rows[1][2] == pytest.approx(1.0) and diff(base, mine, top=1)[0][2] == pytest.approx(-40.0)


def test_device_spans_split_the_elapsed_time_at_the_forwards():
    """PhaseClock.device_spans: the mean of each forward's span and of the spans from one forward's end to the
    next one's start (events here are times in ms, as CUDA events' elapsed_time gives them)."""
    class At:
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, later):
            return later.t - self.t

    clock = load_bench_script("tuned_gap").PhaseClock()
    assert clock.device_spans() == (None, None)
    clock.events = [(At(0.0), At(10.0)), (At(30.0), At(42.0)), (At(60.0), At(71.0))]
    assert clock.device_spans() == (pytest.approx(11.0), pytest.approx(19.0))


def test_gc_clock_times_the_collections_made_while_installed():
    import gc

    clock = load_bench_script("tuned_gap").GcClock()
    with clock:
        gc.collect(0)
        gc.collect(2)
    assert clock.collections == [1, 0, 1] and clock.ms > 0
    gc.collect(1)  # after the block: not counted
    assert clock.collections == [1, 0, 1] and clock not in gc.callbacks


def test_two_loops_only_and_rounds_stopped_by_time(tmp_path, capsys):
    """--loops tuned,alone times just those (more rounds of each in a call's time); --rounds-seconds stops
    starting rounds once that much time went to them (the first round always runs). --pin-main pins the main
    thread to one core for the rounds only; --bare-forward takes only the forward's CPU time around it."""
    import os

    cores = os.sched_getaffinity(0)
    out = tmp_path / "gap.json"
    assert load_bench_script("tuned_gap").main(
        ["--cpu", "--candidates", "bf16-weights", "--loops", "tuned,alone", "--rounds", "50", "--rounds-seconds",
         "0", "--round-steps", "2", "--warmup", "1", "--profile-steps", "1", "--pin-main", "--bare-forward",
         "--tune-kwargs", '{"steps": 4, "rounds": 2}', "--json", str(out)]) == 0
    assert f"main thread pinned to core {min(cores)} for the rounds" in capsys.readouterr().out
    assert os.sched_getaffinity(0) == cores
    # --bare-forward: the forward's CPU clock only.
    tuned = json.loads(out.read_text())["loops"]["tuned"]
    assert tuned["round_probe_us"] is None and tuned["round_forward_switches"] is None
    assert "probe_us_more_than_alone" not in tuned and min(tuned["round_forward_cpu_ms"]) > 0
    res = json.loads(out.read_text())
    assert list(res["loops"]) == ["tuned", "alone"]
    assert len(res["loops"]["tuned"]["round_ms"]) == len(res["loops"]["alone"]["round_ms"]) == 1
    assert res["loops"]["tuned"]["mean_ratio_to_alone"] > 0


@pytest.mark.parametrize("loops", ["tuned", "tuned,controller", "alone,alone", "tuned,alone,other"])
def test_bad_loops_are_refused_naming_the_option(loops, capsys):
    with pytest.raises(SystemExit):
        load_bench_script("tuned_gap").main(["--cpu", "--loops", loops])
    assert "--loops" in capsys.readouterr().err


@pytest.mark.parametrize("value", ['{"no_such_setting": 1}', '[1]'])
def test_bad_dynamo_config_is_refused_naming_the_option(value, capsys):
    with pytest.raises(SystemExit):
        load_bench_script("tuned_gap").main(["--cpu", "--dynamo-config", value])
    assert "--dynamo-config" in capsys.readouterr().err


def test_bad_tune_kwargs_are_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        load_bench_script("tuned_gap").main(["--cpu", "--tune-kwargs", "[4]"])
    assert "--tune-kwargs" in capsys.readouterr().err
    # The options reach the tuning, which names a bad one.
    with pytest.raises(ValueError, match="rounds"):
        load_bench_script("tuned_gap").main(["--cpu", "--candidates", "bf16-weights", "--tune-kwargs",
                                             '{"rounds": 0}'])


def test_the_plain_loop_in_its_own_process_has_no_hook_guards_and_takes_its_turn(tmp_path, monkeypatch):
    """--plain-process: the recipe's plain loop in a spawned process that made no controller (so no dynamo hook
    guards), its rounds in turn with the others; each loop's ratio to it."""
    import importlib
    import os

    # Spawned processes find the child's function by module name: import the script as `tuned_gap`.
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "bench"))
    monkeypatch.delitem(sys.modules, "tuned_gap", raising=False)
    script = importlib.import_module("tuned_gap")
    out = tmp_path / "gap.json"
    from torch._dynamo import config

    # A dynamo setting for every loop, the child's too (a CPU run compiles nothing: any setting will do). Put
    # back by hand: pytest's monkeypatch deletes a torch config entry when it undoes (later compiles then fail).
    before = config.use_recursive_dict_tags_for_guards
    try:
        assert script.main(["--cpu", "--candidates", "bf16-weights", "--loops", "tuned,alone", "--plain-process",
                            "--rounds", "3", "--round-steps", "2", "--warmup", "1", "--profile-steps", "1",
                            "--dynamo-config", json.dumps({"use_recursive_dict_tags_for_guards": not before}),
                            "--json", str(out)]) == 0
        assert config.use_recursive_dict_tags_for_guards == (not before)
    finally:
        config.use_recursive_dict_tags_for_guards = before
    res = json.loads(out.read_text())
    plain = res["loops"]["plain"]
    assert plain["hook_guards"] is False
    assert res["dynamo_config"] == plain["dynamo_config"] == {"use_recursive_dict_tags_for_guards": not before}
    assert len(plain["round_ms"]) == len(plain["round_host_cpu_ms"]) == 3 and min(plain["round_ms"]) > 0
    for name in ("tuned", "alone"):
        assert len(res["loops"][name]["round_ms"]) == 3
        lo, hi = res["loops"][name]["to_plain"]["ci95"]
        assert lo <= res["loops"][name]["to_plain"]["mean_ratio"] <= hi
