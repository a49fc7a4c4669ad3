"""bench/gap_pool.py: tuned_gap.py results pooled over processes and calls."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import load_bench_script


def _result(path, tuned, alone, tuned_host, alone_host):
    loops = {"tuned": {"round_ms": tuned, "round_host_cpu_ms": tuned_host},
             "alone": {"round_ms": alone, "round_host_cpu_ms": alone_host}}
    path.write_text(json.dumps({"loops": loops}))
    return str(path)


def test_the_pool_is_the_geometric_mean_of_every_pair_and_one_file_is_tuned_gaps_own(tmp_path):
    gp, tg = load_bench_script("gap_pool"), load_bench_script("tuned_gap")
    rng = np.random.default_rng(0)
    alone = [rng.uniform(24, 60, n).tolist() for n in (40, 25)]
    tuned = [(np.asarray(a) * np.exp(rng.normal(0.02, 0.1, len(a)))).tolist() for a in alone]
    host = [(rng.uniform(15, 17, len(a)).tolist(), rng.uniform(14, 16, len(a)).tolist()) for a in alone]
    paths = [_result(tmp_path / f"gap{i}.json", tuned[i], alone[i], *host[i]) for i in range(2)]
    res = gp.pool(paths)
    logs = np.log(np.concatenate(tuned) / np.concatenate(alone))
    se = logs.std(ddof=1) / math.sqrt(len(logs))
    assert res["pooled"]["pairs"] == 65
    assert res["pooled"]["ratio"] == pytest.approx(math.exp(logs.mean()), rel=1e-12)
    bounds = [math.exp(logs.mean() - 1.96 * se), math.exp(logs.mean() + 1.96 * se)]
    assert res["pooled"]["ci95"] == pytest.approx(bounds)
    diff = np.concatenate([np.asarray(t) - np.asarray(a) for t, a in host])
    assert res["pooled"]["host_ms"] == pytest.approx(diff.mean()) and res["pooled"]["host_ms"] > 0.5
    # One file's ratio is the geometric mean tuned_gap.py prints, and its interval is close to the bootstrap's.
    ratios = np.asarray(tuned[0]) / np.asarray(alone[0])
    mean, (lo, hi) = tg.geometric_mean_ci(ratios.tolist())
    one = res["files"][paths[0]]
    assert one["ratio"] == pytest.approx(mean, rel=1e-12)
    assert one["ci95"] == pytest.approx([lo, hi], rel=0.01)


def test_the_baseline_may_be_the_plain_loop_in_its_own_process(tmp_path):
    gp = load_bench_script("gap_pool")
    path = tmp_path / "gap0.json"
    loops = {"tuned": {"round_ms": [33.0, 31.0], "round_host_cpu_ms": [16.0, 16.0]},
             "alone": {"round_ms": [32.0, 30.0], "round_host_cpu_ms": [15.5, 15.5]},
             "plain": {"round_ms": [30.0, 29.0], "round_host_cpu_ms": [15.0, 15.0]}}
    path.write_text(json.dumps({"loops": loops}))
    res = gp.pool([str(path)], baseline="plain")
    assert res["pooled"]["ratio"] == pytest.approx(math.sqrt(33.0 / 30.0 * 31.0 / 29.0))
    assert res["pooled"]["host_ms"] == pytest.approx(1.0)
    assert gp.pool([str(path)], loop="alone", baseline="plain")["pooled"]["ratio"] > 1  # the guards' cost


def test_bad_input_is_refused_naming_the_file_or_the_loop(tmp_path, capsys):
    gp = load_bench_script("gap_pool")
    path = _result(tmp_path / "gap0.json", [1.0, 2.0], [1.0, 2.0], [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="no 'controller' and 'alone' loops"):
        gp.pool([path], loop="controller")
    with pytest.raises(ValueError, match="paths"):
        gp.pool([])
    with pytest.raises(ValueError, match="given more than once"):
        gp.pool([path, path])
    with pytest.raises(SystemExit) as exc:
        gp.main([path, "--loop", "controller"])
    assert exc.value.code == 2 and "gap0.json" in capsys.readouterr().err


def test_the_command_line_prints_each_file_and_the_pool(tmp_path, capsys):
    gp = load_bench_script("gap_pool")
    path = _result(tmp_path / "gap0.json", [31.0, 33.0, 30.0], [30.0, 32.0, 30.5], [16.0, 16.5, 15.0],
                   [15.0, 15.5, 15.5])
    other = _result(tmp_path / "gap1.json", [30.0, 31.0], [30.0, 30.0], [15.0, 15.0], [15.0, 15.0])
    assert gp.main([path, other, "--json", str(tmp_path / "pool.json")]) == 0
    out = capsys.readouterr().out
    assert "pooled: 5 pairs" in out and "gap0.json: 3 pairs" in out and "gap1.json: 2 pairs" in out
    assert json.loads((tmp_path / "pool.json").read_text())["pooled"]["pairs"] == 5


def test_the_command_line_takes_any_loop_as_the_baseline(tmp_path, capsys):
    """--baseline tuned-model-plain: the controller against the plain step on its own model, as RESULTS pools
    it; a loop a file lacks is refused naming the loops it has."""
    gp = load_bench_script("gap_pool")
    path = tmp_path / "gap0.json"
    loops = {"tuned": {"round_ms": [33.0, 31.0], "round_host_cpu_ms": [16.0, 16.0]},
             "tuned-model-plain": {"round_ms": [32.0, 30.0], "round_host_cpu_ms": [15.5, 15.5]},
             "alone": {"round_ms": [34.0, 33.0], "round_host_cpu_ms": [17.0, 17.0]}}
    path.write_text(json.dumps({"loops": loops}))
    out = tmp_path / "pool.json"
    assert gp.main([str(path), "--baseline", "tuned-model-plain", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["pooled"]["ratio"] == pytest.approx(math.sqrt(33.0 / 32.0 * 31.0 / 30.0))
    assert "pooled: 2 pairs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        gp.main([str(path), "--baseline", "plain"])
    assert exc.value.code == 2 and "tuned-model-plain" in capsys.readouterr().err


def test_the_interval_between_processes_counts_each_files_mean_once(tmp_path, capsys):
    """Processes that differ by more than their pairs' scatter: the pooled pairs' interval is narrow, the one
    between files (Student's t over the per-file means) is not; one file has none."""
    gp = load_bench_script("gap_pool")
    rng = np.random.default_rng(1)
    paths, means = [], []
    for i, shift in enumerate((0.0, 0.03, 0.06)):
        alone = rng.uniform(30, 40, 60)
        tuned = alone * np.exp(shift + rng.normal(0, 0.01, 60))
        paths.append(_result(tmp_path / f"gap{i}.json", tuned.tolist(), alone.tolist(), [1.0] * 60, [1.0] * 60))
        means.append(np.log(tuned / alone).mean())
    res = gp.pool(paths)
    half = 4.3027 * np.std(means, ddof=1) / math.sqrt(3)  # t for 2 degrees of freedom
    between = res["between_files"]
    assert between["files"] == 3
    assert between["ratio"] == pytest.approx(math.exp(np.mean(means)), rel=1e-12)
    assert between["ci95"] == pytest.approx([math.exp(np.mean(means) - half), math.exp(np.mean(means) + half)])
    pooled = res["pooled"]["ci95"]
    assert between["ci95"][1] - between["ci95"][0] > 5 * (pooled[1] - pooled[0])
    assert gp.main(paths) == 0
    assert "between processes (each file's mean one measurement): 3 files" in capsys.readouterr().out
    assert gp.pool(paths[:1])["between_files"] is None
    gp.main(paths[:1])
    assert "between processes" not in capsys.readouterr().out


def test_students_t_quantiles():
    gp = load_bench_script("gap_pool")
    table = {1: 12.706, 2: 4.303, 5: 2.571, 30: 2.042, 40: 2.021, 1000: 1.962}  # printed tables' values
    for df, t in table.items():
        assert gp.t975(df) == pytest.approx(t, abs=0.0005)
    with pytest.raises(ValueError, match="df"):
        gp.t975(0)
