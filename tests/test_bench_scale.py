"""``python -m adaptive_amp bench scale`` in its CPU smoke mode: a tiny Llama of the same structure, a few steps."""

from __future__ import annotations

import json
import os
import re

import pytest
from conftest import requires_cuda

pytest.importorskip("transformers")

from adaptive_amp.bench import main  # noqa: E402
from adaptive_amp.bench import scale  # noqa: E402


def test_scale_smoke_compares_our_recipe_with_torch_and_says_so(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert main(["scale", "--tiny", "--device", "cpu", "--steps", "4", "--seeds", "2",
                 "--recipes", "torch-bf16,torchao-rowwise,bf16-weights", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = {(r["recipe"], r["seed"]): r for r in report["runs"]}
    assert set(runs) == {(r, s) for r in ("torch-bf16", "bf16-weights") for s in (0, 1)}
    # The same weights and batches for every recipe: the first losses agree to bf16's rounding.
    assert abs(runs["torch-bf16", 0]["first_loss"] - runs["bf16-weights", 0]["first_loss"]) < 0.05
    assert runs["bf16-weights", 0]["policy"].startswith("params=bfloat16") and runs["bf16-weights", 0]["batch"] == 2
    assert runs["bf16-weights", 0]["stats_every"] == 200  # (the controller's default: --stats-every)
    assert report["shape"]["num_hidden_layers"] == 2 and report["shape"]["num_key_value_heads"] == 2
    assert "fp8 matmuls need a CUDA GPU" in report["skipped"]["torchao-rowwise"]
    text = capsys.readouterr().out
    assert "Speed: ours (bf16-weights, batch 2) trained at" in text and "torch's seed spread" in text
    assert "torchao-rowwise did not run" in text


def _search_on_a_fake_gpu(monkeypatch, steps):
    """A batch search's memory readings faked on the CPU: a 1 TiB device whose peak grows 1 GiB a step taken
    (`steps`: the steps' list)."""
    from types import SimpleNamespace

    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2**40))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2**30 * (1 + len(steps)))


def test_scale_search_on_one_gpu_tries_with_a_statistics_step_every_second_step(monkeypatch):
    """The one-GPU batch search trains its tries under a controller whose every step is a statistics step (from
    the search's second step on, with the optimizer's state: each try's peak is such a step's), on a copy of the
    arguments: the runs keep theirs."""
    import argparse
    from types import SimpleNamespace

    import torch

    made, steps = [], []

    def fake_make_trainer(recipe, shape, seed, device, args, tune_batches=None, choice=None):
        made.append((recipe, args.stats_every, args.checkpointing_now))
        return SimpleNamespace(step=steps.append, close=lambda: None)
    monkeypatch.setattr(scale, "make_trainer", fake_make_trainer)
    _search_on_a_fake_gpu(monkeypatch, steps)
    args = argparse.Namespace(memory_fraction=0.95, max_batch=4, stats_every=None, checkpointing_now=True)
    found = scale.search_batch("bf16-pure", scale.TINY, torch.device("cpu"), args)
    assert made == [("bf16-pure", scale.SEARCH_STATS_EVERY, True)] and args.stats_every is None
    assert found["batch"] == 4 and len(steps) == 2 * len(found["tried"]) and scale.SEARCH_STATS_EVERY == 1


@pytest.mark.parametrize("recipe, chosen", [("bf16-pure+fp8", None), ("tune", "bf16-pure+fp8+ckpt"),
                                            ("tune", "bf16-pure")])
def test_scale_search_measures_an_fp8_map_at_each_tries_batch(monkeypatch, recipe, chosen):
    """A recipe with an fp8 map (or a tuning that chose one) builds each try anew, its map measured on that try's
    batches, as the run at that batch measures its own; other recipes keep one trainer for every try. The
    record says which, and a kept search without it is searched again on one GPU."""
    import argparse
    from types import SimpleNamespace

    import torch

    made, closed, steps = [], [], []

    def fake_make_trainer(recipe, shape, seed, device, args, tune_batches=None, choice=None):
        rows = None if tune_batches is None else {b["input_ids"].shape[0] for b in tune_batches}
        made.append((recipe, rows, args.checkpointing_now))
        info = {"chosen": chosen} if recipe == "tune" else {"fp8_layers": 3}
        return SimpleNamespace(step=steps.append, close=lambda: closed.append(recipe), info=info)
    monkeypatch.setattr(scale, "make_trainer", fake_make_trainer)
    monkeypatch.setattr(scale, "_free", lambda device: None)
    _search_on_a_fake_gpu(monkeypatch, steps)
    args = argparse.Namespace(memory_fraction=0.95, max_batch=4, stats_every=None, checkpointing_now=False)
    found = scale.search_batch(recipe, scale.TINY, torch.device("cpu"), args)
    assert found["batch"] == 4 and sorted(found["tried"]) == [1, 2, 4]
    if chosen == "bf16-pure":  # (no fp8 map: the tuned trainer trains every try)
        assert made == [("tune", {1}, False)] and found["fp8_map"] == "none"
    else:
        tries = [m for m in made if m[0] == "bf16-pure+fp8"]
        assert [m[1] for m in tries] == [{1}, {2}, {4}] and found["fp8_map"] == "each try's"
        assert all(m[2] == (recipe == "tune") for m in tries)  # (the choice's checkpointing)
        assert len(closed) == len(made) and args.checkpointing_now is False
    kept = {k: v for k, v in found.items() if k != "fp8_map"}
    kept["stats_every"] = scale.SEARCH_STATS_EVERY
    assert not scale._reusable_search(recipe, kept, "s.json")
    assert scale._reusable_search(recipe, kept, "s.json", sharded=True)
    assert scale._reusable_search(recipe, {**kept, "fp8_map": found["fp8_map"]}, "s.json")
    assert scale._reusable_search("bf16-weights", kept, "s.json")  # (no fp8 map: nothing to measure again)


def test_scale_search_takes_a_try_whose_fp8_map_runs_out_of_memory_as_not_fitting(monkeypatch):
    """A try whose model or fp8 map runs out of memory while it is built does not fit; the search goes on below
    it, each try built after the last one's memory is freed."""
    import argparse
    from types import SimpleNamespace

    import torch

    made, freed, steps = [], [], []

    def fake_make_trainer(recipe, shape, seed, device, args, tune_batches=None, choice=None):
        rows = tune_batches[0]["input_ids"].shape[0]
        made.append(rows)
        if rows >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory (measuring the fp8 map)")
        return SimpleNamespace(step=steps.append, close=lambda: None, info={"fp8_layers": 3})
    monkeypatch.setattr(scale, "make_trainer", fake_make_trainer)
    monkeypatch.setattr(scale, "_free", lambda device: freed.append(len(made)))
    _search_on_a_fake_gpu(monkeypatch, steps)
    args = argparse.Namespace(memory_fraction=0.95, max_batch=8, stats_every=None, checkpointing_now=False)
    found = scale.search_batch("bf16-pure+fp8", scale.TINY, torch.device("cpu"), args)
    assert found["tried"] == {1: 3.0, 2: 5.0, 4: "out of memory", 3: 7.0}, found
    assert found["batch"] == 3 and "error" not in found and found["fp8_map"] == "each try's"
    assert freed[:len(made)] == list(range(len(made)))  # (freed before each try's build)


def test_scale_stats_every_sets_our_controllers_statistics_steps(tmp_path, capsys):
    """--stats-every N: our recipes' statistics cadence, in each run's record; refused by name where nothing of
    ours runs, or not a whole number >= 1."""
    out = tmp_path / "scale.json"
    assert main(["scale", "--tiny", "--device", "cpu", "--steps", "3", "--recipes", "bf16-pure",
                 "--stats-every", "2", "--json", str(out)]) == 0
    assert [r["stats_every"] for r in json.loads(out.read_text())["runs"]] == [2]
    capsys.readouterr()
    for argv, message in ((["--recipes", "torch-bf16"], "--stats-every is for our recipes"),
                          (["--stats-every", "0"], "is not a whole number >= 1")):
        with pytest.raises(SystemExit):
            main(["scale", "--tiny", "--device", "cpu", "--stats-every", "3", *argv])
        assert message in capsys.readouterr().err


def test_scale_tune_takes_seed_zeros_choice_for_the_other_seeds(tmp_path):
    out = tmp_path / "scale.json"
    assert main(["scale", "--tiny", "--device", "cpu", "--steps", "3", "--seeds", "2", "--recipes", "tune",
                 "--tune-candidates", "fp32,bf16", "--tune-steps", "2", "--tune-timed-steps", "1",
                 "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["seed"] for r in runs] == [0, 1] and runs[0]["chosen"] in ("fp32", "bf16")
    assert runs[1]["chosen"] == runs[0]["chosen"] and runs[0]["tuning_seconds"] > 0
    # Where the tuning's seconds went: its trials and phases, as bench tune keeps them.
    tuning = runs[0]["tuning"]
    assert [t["name"] for t in tuning["trials"]] == ["fp32", "bf16"] and tuning["phase_seconds"]["trajectories"] > 0


def test_scale_resume_keeps_the_other_recipes_runs_and_batches_per_recipe(tmp_path):
    out = tmp_path / "scale.json"
    common = ["scale", "--tiny", "--device", "cpu", "--steps", "3", "--json", str(out)]
    assert main([*common, "--recipes", "torch-bf16", "--batch", "torch-bf16=1"]) == 0
    assert main([*common, "--recipes", "bf16-pure,bf16-weights", "--batch", "bf16-pure=3,2", "--resume"]) == 0
    report = json.loads(out.read_text())
    assert [(r["recipe"], r["batch"]) for r in report["runs"]] == [("torch-bf16", 1), ("bf16-pure", 3),
                                                                    ("bf16-weights", 2)]
    assert report["earlier"][0]["device"] == "cpu"
    assert any(line.startswith("Speed: ours (bf16-") for line in report["verdict"])
    # A run at another batch joins the recipe's runs; one at the same batch (and seed) replaces its run; a
    # report of another shape is not mixed in.
    assert main([*common, "--recipes", "torch-bf16", "--batch", "2", "--resume"]) == 0
    assert [(r["recipe"], r["batch"]) for r in json.loads(out.read_text())["runs"]] == [
        ("torch-bf16", 1), ("bf16-pure", 3), ("bf16-weights", 2), ("torch-bf16", 2)]
    assert main([*common, "--recipes", "torch-bf16", "--batch", "1", "--resume"]) == 0
    assert [(r["recipe"], r["batch"]) for r in json.loads(out.read_text())["runs"]] == [
        ("bf16-pure", 3), ("bf16-weights", 2), ("torch-bf16", 2), ("torch-bf16", 1)]
    with pytest.raises(SystemExit):
        main([*common, "--layers", "1", "--recipes", "torch-bf16", "--resume"])
    # One seed a command: seed 1 joins seed 0's run of the recipe, and the loss spread can be judged.
    assert main([*common, "--recipes", "torch-bf16", "--batch", "2", "--seed", "1", "--resume"]) == 0
    report = json.loads(out.read_text())
    assert sorted((r["recipe"], r["seed"], r["batch"]) for r in report["runs"] if r["recipe"] == "torch-bf16") == [
        ("torch-bf16", 0, 1), ("torch-bf16", 0, 2), ("torch-bf16", 1, 2)]
    # (Which batch's torch run is the fastest, and so which losses compare, depends on the CPU's timing.)
    assert len([line for line in report["verdict"] if line.startswith("Loss")]) == 1


@pytest.mark.parametrize("argv, message", [
    (["--recipes", "torch-bf16,fp8"], "choose recipes from"),
    (["--batch", "torch-bf16=0"], "not a whole number >= 1"),
    (["--batch", "fp8=2"], "'fp8' is no recipe"),
    (["--resume"], "--resume adds to the report in --json PATH"),
    (["--compile", "layers"], "invalid choice"),
    (["--seed", "-1"], "seeds are 0, 1"),
    (["--layers", "0"], "not a whole number >= 1"),
    (["--heads", "5"], "--hidden must be a multiple of --heads"),
    (["--memory-fraction", "2"], "--memory-fraction"),
    (["--tune-batch", "2"], "--tune-batch is for tune under --gpus"),
    (["--tune-batch", "0", "--gpus", "2"], "not a whole number >= 1"),
    (["--tune-batch", "2", "--gpus", "2", "--recipes", "torch-bf16"], "--tune-batch is for tune under --gpus"),
    (["--tune-only", "t.json", "--tuned", "t.json"], "--tune-only is what --gpus runs"),
])
def test_scale_refuses_bad_options_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        scale.main(["--tiny", "--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def test_scale_full_size_needs_a_gpu(capsys):
    with pytest.raises(SystemExit):
        scale.main(["--device", "cpu"])
    assert "needs a CUDA GPU; on the CPU add --tiny" in capsys.readouterr().err


def test_scale_verdict_against_the_targets_in_words():
    def r(recipe, tps, peak, loss, seed=0, batch=4, **kw):
        return dict(recipe=recipe, seed=seed, batch=batch, steps=500, steady_tokens_per_s=tps, peak_gib=peak, final_loss=loss,
                    **kw)
    report = {"device": "NVIDIA H200", "args": {"steps": 500}, "skipped": {}, "search": {},
              "runs": [r("torch-bf16", 100.0, 100.0, 2.0), r("torch-bf16", 100.0, 100.0, 2.2, seed=1),
                       r("torchao-rowwise", 120.0, 90.0, 2.1), r("tune", 140.0, 70.0, 2.1, chosen="bf16-weights"),
                       r("tune", 140.0, 70.0, 2.1, seed=1, chosen="bf16-weights")]}
    lines = scale.verdict(report)
    assert any("1.40x the tokens/s of torch's bf16 autocast" in x and "meets the 1.3x target" in x for x in lines)
    assert any("0.70x: meets the 0.8x target" in x for x in lines)
    assert any("torchao's best (torchao-rowwise" in x and "1.17x" in x and "meets" in x for x in lines)
    assert any("inside torch's seed spread" in x for x in lines)
    # A run of ours no longer than its statistics cadence has no statistics step after the optimizer's state:
    # its peak says so.
    assert not any(x.startswith("Peaks:") for x in lines)
    report["runs"][3]["stats_every"] = 500
    assert any(x.startswith("Peaks: ours ran 500 steps, none of them a statistics step") for x in scale.verdict(report))
    report["runs"][3]["stats_every"] = 200
    assert not any(x.startswith("Peaks:") for x in scale.verdict(report))
    # A sharded tensorwise run that gathered its weights in bf16 (--float8-all-gather off) is named so.
    gathered = dict(report, runs=report["runs"] + [r("torchao-tensorwise", 130.0, 90.0, 2.1, float8_all_gather=False)])
    assert any("torchao's best (torchao-tensorwise, batch 4, its weights all-gathered in bf16: --float8-all-gather "
               "off): 1.08x" in x for x in scale.verdict(gathered))
    # Beside a run as torchao advises, that one is torchao's best even if the bf16 one ran faster; a report keeps
    # both (they are not the same run).
    advised = r("torchao-tensorwise", 125.0, 90.0, 2.1, float8_all_gather=True)
    both = dict(gathered, runs=scale._with_run(gathered["runs"], advised))
    assert len(both["runs"]) == len(gathered["runs"]) + 1
    assert any("torchao's best (torchao-tensorwise, batch 4): 1.12x" in x for x in scale.verdict(both))
    # A recipe's runs at the batch its search found count, not those at a batch an earlier search found (kept in
    # the report when the search is made again) even if faster.
    stale = dict(report, runs=report["runs"] + [r("tune", 200.0, 130.0, 2.1, batch=8, chosen="bf16-weights")],
                 search={"tune": {"batch": 4, "tried": {}}})
    assert any("batch 4) trained at 1.40x the tokens/s" in x for x in scale.verdict(stale))
    stale["search"] = {}
    assert any("batch 8) trained at 2.00x the tokens/s" in x for x in scale.verdict(stale))
    # A tuned run at a batch given, not searched, says its speed is at that batch; a searched one does not.
    assert any(x.startswith("Ours (tune) ran only at the batch given (4), not searched") for x in lines)
    report["search"]["tune"] = {"batch": 4, "tried": {}}
    assert not any("not searched" in x for x in scale.verdict(report))
    # The tuning against 10,000 steps at the tuned run's steady rate.
    assert not any(x.startswith("Tuning") for x in lines)  # (no tuning recorded)
    trials = [{"name": "fp32"}, {"name": "bf16-weights"}]
    report["runs"][3].update(tuning={"seconds": 168.0, "trials": trials}, steady_ms_per_step=867.0)
    report["runs"][4].update(tuning={"seconds": 200.0, "trials": trials}, steady_ms_per_step=867.0)
    tuning = [x for x in scale.verdict(report) if x.startswith("Tuning")]
    assert tuning == ["Tuning (seed 0, batch 4): 168.0 s, 1.94% of 10,000 steps at its steady 867 ms: meets the 2% "
                      "target.",
                      "Tuning (seed 1, batch 4): 200.0 s, 2.31% of 10,000 steps at its steady 867 ms: misses the 2% "
                      "target."]
    # What inductor compiled while tuning and what it loaded from its cache (an earlier run's) is said with it.
    warm = dict(report, runs=[dict(x) for x in report["runs"]])
    warm["runs"][3]["tuning"] = dict(warm["runs"][3]["tuning"], inductor_graphs={"graphs": 14, "from_cache": 14})
    assert [x for x in scale.verdict(warm) if x.startswith("Tuning")][0] == (
        "Tuning (seed 0, batch 4): 168.0 s (14 graphs loaded from inductor's on-disk cache), 1.94% of 10,000 "
        "steps at its steady 867 ms: meets the 2% target.")
    # A seed's one-candidate tuning (it trains seed 0's choice) is not the tuning's cost.
    report["runs"][4]["tuning"]["trials"] = trials[1:]
    assert [x for x in scale.verdict(report) if x.startswith("Tuning")] == tuning[:1]
    # With its choice run alone at the same batch and seed in the report, the compile it makes anyway counts once.
    report["runs"][3].update(one_time_seconds=11.5)
    alone = dict(r("bf16-weights", 200.0, 130.0, 2.1), one_time_seconds=18.0)
    for other in (dict(alone, batch=8), dict(alone, seed=1), dict(alone, error="out of memory")):
        assert [x for x in scale.verdict(dict(report, runs=report["runs"] + [other]))
                if x.startswith("Tuning")] == tuning[:1]
    once = [x for x in scale.verdict(dict(report, runs=report["runs"] + [alone])) if x.startswith("Tuning")]
    assert once == ["Tuning (seed 0, batch 4): 168.0 s, 1.94% of 10,000 steps at its steady 867 ms; with the "
                    "compile counted once (+ its one-time 11.5 s - bf16-weights's run alone, 18.0 s): 161.5 s, 1.86%: "
                    "meets the 2% target."]
    # Both started inductor ahead of their set-up (0.0: an earlier recipe of the process had): the same count. Only
    # one of them: its one-time seconds would carry the start, and the count is not made.
    started = [dict(x) for x in report["runs"]]
    started[3]["inductor_start_seconds"] = 4.2
    assert [x for x in scale.verdict(dict(report, runs=started + [dict(alone, inductor_start_seconds=0.0)]))
            if x.startswith("Tuning")] == once
    mixed = [x for x in scale.verdict(dict(report, runs=started + [alone])) if x.startswith("Tuning")]
    assert mixed == ["Tuning (seed 0, batch 4): 168.0 s, 1.94% of 10,000 steps at its steady 867 ms; not counted "
                     "once against bf16-weights's run alone: one of the two started inductor ahead of its set-up and "
                     "the other did not (run both again for the count): meets the 2% target."]


def test_scale_verdict_compares_losses_only_at_torchs_batch_and_the_same_steps():
    def r(recipe, loss, seed=0, batch=3, steps=500, tps=100.0):
        return dict(recipe=recipe, seed=seed, batch=batch, steps=steps, steady_tokens_per_s=tps, peak_gib=90.0,
                    final_loss=loss)
    torch_runs = [r("torch-bf16", 2.0), r("torch-bf16", 2.1, seed=1)]

    def loss_lines(*ours):
        report = {"device": "NVIDIA H200", "args": {"steps": 500}, "skipped": {}, "search": {},
                  "runs": torch_runs + list(ours)}
        return [x for x in scale.verdict(report) if x.startswith("Loss")]
    # Ours only at its own larger batch: more tokens a step, no loss to compare.
    assert "has no complete run at torch's batch (3)" in loss_lines(r("bf16-pure+fp8", 1.5, batch=8, tps=160.0))[0]
    # At torch's batch but a 40-step run: not comparable with 500 steps.
    lines = loss_lines(r("bf16-pure+fp8", 1.5, batch=8, tps=160.0), r("bf16-pure+fp8", 2.5, steps=40))
    assert "different numbers of steps ([40] against [500])" in lines[0]
    # At torch's batch and steps: judged against the spread, whatever the speed run's batch.
    lines = loss_lines(r("bf16-pure+fp8", 1.5, batch=8, tps=160.0), r("bf16-pure+fp8", 2.06),
                       r("bf16-pure+fp8", 2.08, seed=1))
    assert lines == ["Loss after 500 steps at batch 3: ours (bf16-pure+fp8) 2.0700 (2 seed(s)) against torch's "
                     "2.0500 (its seeds 2.0000 .. 2.1000): inside torch's seed spread."]
    assert "outside" in loss_lines(r("bf16-pure+fp8", 2.4))[0]
    # The other recipes at the same batch and steps are listed beside the judgment; another batch's are not.
    report = {"device": "NVIDIA H200", "args": {"steps": 500}, "skipped": {}, "search": {},
              "runs": torch_runs + [r("bf16-pure+fp8", 2.4), r("torchao-tensorwise", 2.3),
                                    r("bf16-pure", 2.2), r("torchao-rowwise", 2.0, batch=6, tps=90.0)]}
    assert scale.verdict(report)[-1] == ("Beside them at batch 3 over 500 steps: torchao-tensorwise 2.3000 "
                                         "(1 seed(s)), bf16-pure 2.2000 (1 seed(s)).")
    # A tuned run names what it chose at that batch.
    assert "ours (tune, chose bf16-weights) 2.0600" in loss_lines(dict(r("tune", 2.06), chosen="bf16-weights"))[0]
    # Where torch has a spread wins over a longer single run.
    torch_runs.append(r("torch-bf16", 2.3, steps=600))
    assert loss_lines(r("bf16-pure+fp8", 2.06), r("bf16-pure+fp8", 2.5, steps=600))[0].startswith(
        "Loss after 500 steps")
    # torch's only run at its batch stopped early: said so, not as a difference of steps.
    torch_runs[:] = [dict(r("torch-bf16", 2.0), stopped_early=True)]
    assert "torch's torch-bf16 has no complete run at its batch (3)" in loss_lines(r("bf16-pure+fp8", 2.06))[0]


def test_scale_seed_zero_run_again_gives_the_other_seeds_its_new_choice(tmp_path, monkeypatch):
    choices = iter(["bf16-weights", "bf16"])
    given = []

    def fake_run(recipe, shape, batch, seed, device, args, choice=None):
        given.append((seed, choice))
        return dict(recipe=recipe, seed=seed, batch=batch, steps=3, steady_tokens_per_s=1.0, tokens_per_s=1.0,
                    peak_gib=None, final_loss=1.0, checkpointing=False,
                    chosen=next(choices) if seed == 0 else choice)
    monkeypatch.setattr(scale, "run", fake_run)
    out = tmp_path / "scale.json"
    common = ["--tiny", "--device", "cpu", "--steps", "3", "--recipes", "tune", "--json", str(out)]
    assert scale.main(common) == 0
    assert scale.main([*common, "--seeds", "2", "--resume"]) == 0
    assert given == [(0, None), (0, None), (1, "bf16")]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["seed"], r["chosen"]) for r in runs] == [(0, "bf16"), (1, "bf16")]


@pytest.mark.cuda
@requires_cuda
def test_scale_searches_the_largest_batch_on_a_gpu(tmp_path):
    """The tiny model on the GPU, compiled: the search doubles the batch up to --max-batch, records each peak,
    and every recipe then runs at its batch; --memory-fraction 0.1 would make a search stop early."""
    out = tmp_path / "scale.json"
    assert main(["scale", "--tiny", "--steps", "4", "--max-batch", "4", "--recipes", "torch-bf16,bf16-weights",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for recipe in ("torch-bf16", "bf16-weights"):
        search = report["search"][recipe]
        assert search["batch"] == 4 and set(search["tried"]) == {"1", "2", "4"}, search
        assert all(isinstance(v, float) and v > 0 for v in search["tried"].values())
    assert [r["batch"] for r in report["runs"]] == [4, 4]
    assert all(r["peak_gib"] > 0 and r["final_loss"] == r["final_loss"] for r in report["runs"])
    assert any(line.startswith("Memory at torch's batch (4)") for line in report["verdict"])


@pytest.mark.parametrize("peak, max_batch, out_of_memory_from, expected, tries", [
    ((20, 10), 64, None, 7, [1, 2, 4, 7]),      # straight from 1 to 4: the line reaches the limit (95) at 7.5
    ((20, 10), 64, 7, 6, [1, 2, 4, 7, 6]),      # out of memory below the limit: the batch below
    ((20, 3), 64, 9, 8, [1, 2, 4, 25, 14, 9, 6, 8]),  # far off: half way, then up the line through what fit
    ((20, 0.5), 16, None, 16, [1, 2, 4, 16]),   # the line passes --max-batch: that batch
    ((20, 20), 64, None, 3, [1, 2, 4, 3]),      # 4 passes the limit: one between
    ((20, 50), 64, None, 1, [1, 2]),
    ((30, 3, 20, 8), 64, None, 9, [1, 2, 4, 8, 9]),  # steeper past 2 (as measured): the line through 2, 4 and 8
    ((40, 0.5, 0, 5), 64, None, 19, [1, 2, 4, 64, 34, 19]),  # flat, then steep: half way, then the new line
])
def test_largest_batch_predicts_from_the_peaks(peak, max_batch, out_of_memory_from, expected, tries):
    """The peak grows with the batch along `peak` (state, GiB a sequence; or the larger of two such lines):
    once three tries lie on a line, the search goes to the batch where it reaches the limit (95), and down from
    one that does not fit."""
    done = []

    def measure(b):
        done.append(b)
        if out_of_memory_from is not None and b >= out_of_memory_from:
            return False, None
        at = max(peak[i] + peak[i + 1] * b for i in range(0, len(peak), 2))
        return at <= 95.0, at
    assert scale.largest_batch(measure, max_batch, 95.0) == expected
    assert done == tries


def test_largest_batch_without_peaks_doubles_up_to_max_batch_then_tries_one_between():
    done = []
    assert scale.largest_batch(lambda b: (done.append(b) or b < 6, None), 16) == 4 and done == [1, 2, 4, 8, 6]
    done.clear()  # peaks unknown although a limit is given (a CPU run): the same
    assert scale.largest_batch(lambda b: (done.append(b) or b < 6, None), 16, 95.0) == 4 and done == [1, 2, 4, 8, 6]
    done.clear()  # a --max-batch between two doublings is tried itself
    assert scale.largest_batch(lambda b: (done.append(b) or True, None), 12) == 12 and done == [1, 2, 4, 8, 12]
    done.clear()  # a prediction that fits with a peak no higher than before: nothing to draw a line through
    peaks = {1: 30.0, 2: 40.0, 4: 60.0, 7: 60.0}
    assert scale.largest_batch(lambda b: (done.append(b) or True, peaks.get(b)), 64, 95.0) == 7
    assert done == [1, 2, 4, 7]


def test_scale_max_seconds_stops_a_run_and_says_its_loss_is_not_comparable(tmp_path):
    out = tmp_path / "scale.json"
    assert main(["scale", "--tiny", "--device", "cpu", "--steps", "20", "--max-seconds", "0",
                 "--recipes", "torch-bf16,bf16-weights", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["steps"], r["stopped_early"]) for r in report["runs"]] == [(3, True), (3, True)]
    assert all(len(r["losses"]) == 3 for r in report["runs"])
    assert any("stopped after 3 of 20 steps (--max-seconds)" in line for line in report["verdict"])
    assert not any(line.startswith("Loss after") for line in report["verdict"])


def test_scale_fsdp2_float8_all_gather_is_torchaos_tensorwise_unless_turned_off(capsys):
    """Sharded, torchao's tensorwise recipe all-gathers its weights in float8 (as torchao advises);
    --float8-all-gather off gathers them in bf16, to show what the float8 all-gather is worth. Forwarded by
    --gpus to the runs it starts; refused on one GPU, where there is no all-gather, and without that recipe."""
    import argparse

    given = {dest: None for _, dest in scale._FORWARDED}
    args = argparse.Namespace(**given, float8_all_gather="off", tiny=False, verbose=False, gpus=2)
    assert "--float8-all-gather" not in scale._forwarded(args)  # (not the tuning's process, nor other recipes)
    commands = {r: scale._sharded_command(args, r, 4, 3, "out.json") for r in ("torchao-tensorwise", "torch-bf16")}
    assert _last(commands["torchao-tensorwise"], "--float8-all-gather") == "off"
    assert "--float8-all-gather" not in commands["torch-bf16"]
    # (--stats-every likewise goes to our recipes' runs alone)
    args.stats_every = 7
    assert _last(scale._sharded_command(args, "tune", 4, 3, "out.json"), "--stats-every") == "7"
    assert "--stats-every" not in scale._sharded_command(args, "torchao-tensorwise", 4, 3, "out.json")
    for argv, message in ((["--recipes", "torchao-tensorwise"], "--float8-all-gather is for sharded runs"),
                          (["--gpus", "2", "--recipes", "torch-bf16,tune"], "is torchao-tensorwise's")):
        with pytest.raises(SystemExit):
            scale.main(["--tiny", "--device", "cpu", "--float8-all-gather", "off", *argv])
        assert message in capsys.readouterr().err
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig

    from adaptive_amp.bench.scale_fsdp2 import torchao_config

    tensorwise, rowwise = (Float8LinearConfig.from_recipe_name(r) for r in ("tensorwise", "rowwise"))
    assert torchao_config(tensorwise, "torchao-tensorwise").enable_fsdp_float8_all_gather
    assert not torchao_config(tensorwise, "torchao-tensorwise", all_gather=False).enable_fsdp_float8_all_gather
    assert not torchao_config(rowwise, "torchao-rowwise").enable_fsdp_float8_all_gather
    assert not tensorwise.enable_fsdp_float8_all_gather  # (a copy: the config given is left as it was)


def test_scale_fsdp2_refuses_to_run_outside_torchrun_or_without_a_batch(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        scale.main(["--tiny", "--device", "cpu", "--fsdp2", "--batch", "2"])
    assert "--fsdp2 runs under torchrun" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        scale.main(["--tiny", "--device", "cpu", "--fsdp2"])
    assert "--fsdp2: give --batch" in capsys.readouterr().err


def _scale_rank(rank, port, out, argv=("--recipes", "torch-bf16,bf16-pure,tune,bf16-weights")):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    scale.main(["--tiny", "--device", "cpu", "--fsdp2", "--batch", "2", "--steps", "6", *argv,
                "--json", str(out)])  # (ends the process)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_scale_fsdp2_trains_a_tunings_choice_as_the_tuned_run(tmp_path):
    """--tuned (what --gpus gives the sharded runs of tune): the choice trains sharded, as the tuned run, its
    "+ckpt" left to the batch search, bf16 as autocast over float32 weights; the record goes with seed 0's run."""
    import torch

    record = tmp_path / "tuning.json"
    record.write_text(json.dumps({"chosen": "bf16+ckpt", "batch": 1, "tuning": {"seconds": 2.0, "trials": []}}))
    out = tmp_path / "scale.json"
    torch.multiprocessing.spawn(_scale_rank, args=(_free_port(), out, ("--recipes", "tune", "--seeds", "2",
                                                                       "--tuned", str(record))), nprocs=2)
    runs = json.loads(out.read_text())["runs"]
    assert [(r["recipe"], r["seed"], r["chosen"], r["checkpointing"]) for r in runs] == [
        ("tune", 0, "bf16+ckpt", False), ("tune", 1, "bf16+ckpt", False)]
    assert runs[0]["policy"].startswith("params=float32,compute=bfloat16") and runs[0]["tuned_batch"] == 1
    assert runs[0]["tuning"]["seconds"] == 2.0 and "tuning" not in runs[1]


def test_scale_tuned_record_is_checked_by_name(tmp_path):
    import argparse

    def error(message):
        raise SystemExit(message)
    path = tmp_path / "tuning.json"
    args = argparse.Namespace(fsdp2=True, recipes=["tune"], tuned=str(path))
    for record, message in ((None, "not a tuning's record (FileNotFoundError"),
                            ({"chosen": "bf16", "batch": 1}, "not a tuning's record (KeyError"),
                            ({"chosen": "bf16+islands", "batch": 1, "tuning": {}}, "the tuning chose 'bf16+islands'"),
                            ({"chosen": "bf16-weights", "batch": 1, "tuning": {}}, "the sharded run trains fp32")):
        if record is not None:
            path.write_text(json.dumps(record))
        with pytest.raises(SystemExit, match=re.escape(message)):
            scale._tuned_record(args, error)
    path.write_text(json.dumps({"chosen": "bf16-pure+fp8+ckpt", "batch": "3", "tuning": {}}))
    assert scale._tuned_record(args, error)["batch"] == 3
    for wrong in (dict(fsdp2=False), dict(recipes=["tune", "torch-bf16"])):
        with pytest.raises(SystemExit, match="--tuned is what --gpus gives"):
            scale._tuned_record(argparse.Namespace(**{**vars(args), **wrong}), error)


def test_scale_tune_only_tunes_at_the_batch_given_and_writes_the_record(tmp_path, monkeypatch):
    """--tune-only PATH (what --gpus runs for tune, with --batch tune=N for its --tune-batch N)."""
    seen = {}

    def fake_trainer(recipe, shape, seed, device, args, tune_batches=None, choice=None):
        seen.update(recipe=recipe, batches=len(tune_batches), batch=tune_batches[0]["input_ids"].shape[0])
        return scale.Trainer(recipe, None, None, None, info={"chosen": "bf16", "tuning": {"seconds": 1.0}})
    monkeypatch.setattr(scale, "make_trainer", fake_trainer)
    path = tmp_path / "tuning.json"
    assert scale.main(["--tiny", "--device", "cpu", "--recipes", "tune", "--batch", "tune=3",
                       "--tune-only", str(path)]) == 0
    assert seen == {"recipe": "tune", "batches": 8, "batch": 3}
    assert json.loads(path.read_text()) == {"chosen": "bf16", "tuning": {"seconds": 1.0}, "batch": 3}
    with pytest.raises(SystemExit):
        scale.main(["--tiny", "--device", "cpu", "--gpus", "2", "--tune-only", str(path)])


def test_scale_gpus_tunes_among_the_candidates_the_sharded_run_trains():
    import argparse

    args = argparse.Namespace(tune_candidates=["fp32", "bf16", "fp16", "bf16+islands", "bf16-weights+fp8",
                                               "bf16-pure+fp8+ckpt"])
    kept, left_out = scale._sharded_candidates(args)
    assert kept == ["fp32", "bf16", "bf16-pure+fp8+ckpt"]
    assert "one dtype per sharded unit" in left_out["bf16-weights+fp8"]
    assert set(left_out) == {"fp16", "bf16+islands", "bf16-weights+fp8"}
    assert all("the sharded run trains" in left_out[c] for c in ("fp16", "bf16+islands"))


def test_scale_fsdp2_shards_over_two_processes_and_reports_once(tmp_path):
    """Two gloo processes as torchrun starts them: each recipe sharded, every rank's tokens counted, the
    losses averaged over ranks; tune and bf16-weights skipped with why; rank 0 alone writes the report."""
    import torch

    out = tmp_path / "scale.json"
    torch.multiprocessing.spawn(_scale_rank, args=(_free_port(), out), nprocs=2)
    report = json.loads(out.read_text())
    assert report["fsdp2"] == 2
    runs = {r["recipe"]: r for r in report["runs"]}
    assert set(runs) == {"torch-bf16", "bf16-pure"}
    assert all(r["fsdp2"] == 2 and r["ranks"] == 2 and r["batch"] == 2 for r in runs.values())
    assert runs["bf16-pure"]["policy"].startswith("params=bfloat16")
    assert runs["torch-bf16"]["final_loss"] < runs["torch-bf16"]["first_loss"]
    assert "one dtype per sharded unit" in report["skipped"]["bf16-weights"]
    assert "--gpus N tunes on one GPU" in report["skipped"]["tune"]
    assert any(line.startswith("Speed: ours (bf16-pure, batch 2)") for line in report["verdict"])


def test_scale_verdict_says_how_soon_each_seed_reached_the_loss_both_reach():
    def r(recipe, seed, offset, ms):
        losses = [100.0 + offset - i for i in range(20)]  # one step behind when offset is 1
        return dict(recipe=recipe, seed=seed, batch=3, steps=20, steady_tokens_per_s=1e3 / ms, peak_gib=90.0,
                    losses=losses, final_loss=sum(losses[-2:]) / 2, steady_ms_per_step=ms)
    report = {"device": "NVIDIA H200", "args": {"steps": 20}, "skipped": {}, "search": {},
              "runs": [r("torch-bf16", 0, 0.0, 10.0), r("torch-bf16", 1, 0.0, 10.0),
                       r("bf16-pure+fp8", 0, 1.0, 5.0), r("bf16-pure+fp8", 1, 1.0, 20.0)]}
    lines = [x for x in scale.verdict(report) if x.startswith("Seed")]
    # One step behind: at twice torch's speed it gets there sooner (20 steps at 5 ms against 19 at 10 ms); at
    # half its speed, later.
    assert lines == ["Seed 0: to the loss both reach (82.5000), ours took 20 steps, 0.1 s at its steady rate, "
                     "torch's 19 steps, 0.2 s: 1.90x as fast.",
                     "Seed 1: to the loss both reach (82.5000), ours took 20 steps, 0.4 s at its steady rate, "
                     "torch's 19 steps, 0.2 s: 0.47x as fast."]


def test_scale_merge_draws_one_verdict_over_reports_written_apart(tmp_path, capsys):
    """Seeds run side by side (a GPU each) write a report each; --merge judges them together and runs nothing."""
    def report(path, *runs, shape=None, date="2026-11-30 11:34 UTC", device="NVIDIA H200"):
        path.write_text(json.dumps({"device": device, "torch": "2.11.0", "date": date, "args": {"steps": 20},
                                    "shape": shape or {"hidden_size": 64}, "fsdp2": None, "search": {},
                                    "skipped": {"torchao-rowwise": "torchao is not installed"}, "runs": list(runs)}))
        return str(path)

    def r(recipe, seed, loss, tps=100.0, **kw):
        return dict(recipe=recipe, seed=seed, batch=3, steps=20, steady_tokens_per_s=tps, tokens_per_s=tps,
                    peak_gib=90.0, final_loss=loss, checkpointing=False, **kw)
    paths = [report(tmp_path / "t0.json", r("torch-bf16", 0, 2.0)),
             report(tmp_path / "t1.json", r("torch-bf16", 1, 2.2)),
             report(tmp_path / "o0.json", r("tune", 0, 2.05, tps=150.0, chosen="bf16+fp8"), r("torch-bf16", 0, 9.0),
                    date="2026-11-30 11:41 UTC"),
             report(tmp_path / "o1.json", r("tune", 1, 2.15, tps=160.0, chosen="bf16-pure+fp8"))]
    before = [open(p).read() for p in paths]
    out = tmp_path / "all.json"
    # (The later report's run of torch-bf16 seed 0 replaces the first's, as --resume would.)
    assert scale.main(["--merge", *paths[:2], paths[3], paths[2], "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert sorted((x["recipe"], x["seed"], x["final_loss"]) for x in merged["runs"]) == [
        ("torch-bf16", 0, 9.0), ("torch-bf16", 1, 2.2), ("tune", 0, 2.05), ("tune", 1, 2.15)]
    assert [m["path"] for m in merged["merged"]] == [*paths[:2], paths[3], paths[2]]
    assert merged["skipped"] == {"torchao-rowwise": "torchao is not installed"}
    assert scale.main(["--merge", paths[2], *paths[:2], paths[3]]) == 0
    text = capsys.readouterr().out
    assert "Speed: ours (tune, chose bf16+fp8, batch 3) trained at 1.50x" in text
    assert "ours (tune, chose bf16+fp8, bf16-pure+fp8) 2.1000 (2 seed(s)) against torch's 2.1000" in text
    assert [open(p).read() for p in paths] == before  # the reports read are left as they were
    # A run that failed fails the merge's exit code too, as it does the command's.
    failed = report(tmp_path / "failed.json", dict(r("tune", 0, 2.0), error="out of memory"))
    assert scale.main(["--merge", paths[0], failed]) == 1
    capsys.readouterr()
    # Bad input, by name, nothing written: a report that cannot be read, is no report, holds another model or ran
    # on another device; options of a run; --json naming a report merged.
    (tmp_path / "bad.json").write_text("[1, 2]")
    (tmp_path / "no_runs.json").write_text(json.dumps({"device": "cpu", "args": {}, "shape": {}, "runs": None}))
    (tmp_path / "no_recipe.json").write_text(json.dumps({"device": "cpu", "args": {}, "shape": {}, "runs": [{}]}))
    out.unlink()
    for argv, message in ((["--merge", paths[0], str(tmp_path / "none.json")], "--merge: cannot read"),
                          (["--merge", paths[0], str(tmp_path / "bad.json")], "bad.json is not a report of bench"),
                          (["--merge", str(tmp_path / "no_runs.json")], "no_runs.json is not a report of bench"),
                          (["--merge", str(tmp_path / "no_recipe.json")], "no_recipe.json is not a report of bench"),
                          (["--merge", paths[0], report(tmp_path / "other.json", shape={"hidden_size": 32})],
                           "holds a model of shape"),
                          (["--merge", paths[0], report(tmp_path / "cpu.json", device="cpu")], "ran on cpu"),
                          (["--merge", *paths, "--resume"], "leave out --resume"),
                          (["--merge", *paths, "--recipes", "tune", "--steps", "3"], "leave out --recipes, --steps"),
                          (["--merge", *paths, "--steps", "700"], "leave out --steps"),  # (the default, given)
                          (["--merge", *paths, "--json", paths[1]], "is one of the reports merged")):
        with pytest.raises(SystemExit):
            scale.main([*argv, "--json", str(out)] if "--json" not in argv else argv)
        assert message in capsys.readouterr().err
        assert not out.exists() and [open(p).read() for p in paths] == before


def _last(command, flag):
    """The value of `flag`'s last occurrence in `command`: the one argparse keeps."""
    return command[len(command) - command[::-1].index(flag)]


def test_scale_gpus_searches_each_recipes_batch_with_one_torchrun_a_try(tmp_path, monkeypatch, capsys):
    """--gpus N: each try is a torchrun of its own (a rank out of memory ends them all), the search as on one GPU,
    then one torchrun a recipe at its batch; the searches join the report. Here torchrun is played by a fake."""
    import subprocess

    commands, fail = [], {"other": False, "run": False, "tuning": False, "cut": False,
                          "chosen": "bf16-pure+fp8+ckpt"}

    def fake_run(command, capture_output=False, text=False):
        commands.append(command)
        recipe, batch = command[command.index("--batch") + 1].split("=")
        if "--tune-only" in command:  # the tuning, in one process
            if fail["tuning"]:
                return subprocess.CompletedProcess(command, 1, "", "")
            assert "--fsdp2" not in command and "bf16-weights" not in command[command.index("--tune-candidates") + 1]
            with open(command[command.index("--tune-only") + 1], "w") as f:
                json.dump({"chosen": fail["chosen"], "batch": int(batch),
                           "tuning": {"seconds": 2.5, "trials": [{}, {}], "skipped": []}}, f)
            return subprocess.CompletedProcess(command, 0, "", "")
        batch, path = int(batch), command[command.index("--json") + 1]
        checkpointing = _last(command, "--checkpointing") == "on"
        steps = int(command[command.index("--steps") + 1])
        if recipe == "tune":  # its torchruns run the tuning's choice
            with open(command[command.index("--tuned") + 1]) as f:
                assert json.load(f)["chosen"] == fail["chosen"]
        too_big = {"torch-bf16": 4, "tune": 3}.get(recipe, 2 if checkpointing else 1)
        if batch >= too_big:  # (what torchrun prints when a rank ran out of memory)
            return subprocess.CompletedProcess(command, 1, "", "torch.OutOfMemoryError: CUDA out of memory")
        if fail["cut"] and recipe == "tune" and steps == 5:  # (a time limit ends the command)
            raise KeyboardInterrupt
        if (fail["other"] and batch == 3) or (fail["run"] and steps == 5):
            return subprocess.CompletedProcess(command, 1, "", "ValueError: something else")
        run = dict(recipe=recipe, seed=0, batch=batch, steps=steps, steady_tokens_per_s=100.0 * batch,
                   tokens_per_s=100.0 * batch, peak_gib=None, final_loss=2.0, checkpointing=checkpointing, fsdp2=2,
                   steady_ms_per_step=10.0)
        if recipe == "tune":
            run.update(chosen="bf16-pure+fp8+ckpt", tuned_batch=1, tuning={"seconds": 2.5, "trials": [{}, {}]})
        report = {"device": "cpu", "args": {"steps": steps}, "shape": scale.TINY, "fsdp2": 2, "search": {},
                  "skipped": {}, "runs": [run]}
        if "--resume" in command and os.path.exists(path):
            with open(path) as f:
                before = json.load(f)
            report.update(runs=before["runs"] + [run], search=before["search"])
        with open(path, "w") as f:
            json.dump(report, f)
        return subprocess.CompletedProcess(command, 0, "", "")
    monkeypatch.setattr(subprocess, "run", fake_run)
    out = tmp_path / "scale.json"
    common = ["--tiny", "--device", "cpu", "--gpus", "2", "--max-batch", "4", "--steps", "5", "--json", str(out)]
    assert scale.main([*common, "--recipes", "torch-bf16,tune,bf16-pure", "--seed", "1"]) == 0
    tries = [(c[c.index("--batch") + 1], _last(c, "--checkpointing")) for c in commands
             if "--tune-only" not in c and c[c.index("--steps") + 1] == str(scale.SEARCH_STEPS)]
    # Doubling until out of memory, then one between (no peaks on the CPU to predict from); tune, tuned first in one
    # process among the candidates that run sharded, its choice searched and run with the tuning; bf16-pure, not
    # one sequence without checkpointing, again with it.
    assert tries == [("torch-bf16=1", "off"), ("torch-bf16=2", "off"), ("torch-bf16=4", "off"),
                     ("torch-bf16=3", "off"), ("tune=1", "off"), ("tune=2", "off"), ("tune=4", "off"),
                     ("tune=3", "off"), ("bf16-pure=1", "off"), ("bf16-pure=1", "on"), ("bf16-pure=2", "on")]
    assert [c[c.index("--batch") + 1] for c in commands if "--tune-only" in c] == ["tune=1"]
    runs = [c for c in commands if "--tune-only" not in c and c[c.index("--steps") + 1] == "5"]
    assert [(c[c.index("--batch") + 1], _last(c, "--checkpointing"), "--resume" in c)
            for c in runs] == [("torch-bf16=3", "off", False), ("tune=2", "off", True), ("bf16-pure=1", "on", True)]
    assert all("--fsdp2" in c and "--nproc_per_node=2" in c and "--tiny" in c and "--seed" in c for c in runs)
    # Each try has a statistics step after the optimizer's state exists (its peak is a statistics step's); the
    # runs keep the controller's cadence.
    trials = [c for c in commands if "--tune-only" not in c and c[c.index("--steps") + 1] == str(scale.SEARCH_STEPS)]
    ours = [c for c in trials if not c[c.index("--batch") + 1].startswith("torch-bf16=")]
    assert ours and all(_last(c, "--stats-every") == str(scale.SEARCH_STATS_EVERY) for c in ours)
    assert not any("--stats-every" in c for c in trials if c not in ours)
    assert scale.SEARCH_STEPS > scale.SEARCH_STATS_EVERY and not any("--stats-every" in c for c in runs)
    report = json.loads(out.read_text())
    assert report["search"]["torch-bf16"] == {"batch": 3, "tried": {"1": None, "2": None, "4": "out of memory",
                                                                      "3": None}, "gpus": 2, "checkpointing": False}
    assert report["search"]["bf16-pure"]["checkpointing"] is True
    assert report["search"]["tune"]["batch"] == 2 and report["search"]["tune"]["tuned"]["chosen"] == \
        "bf16-pure+fp8+ckpt"
    assert [r["recipe"] for r in report["runs"]] == ["torch-bf16", "tune", "bf16-pure"]
    assert any("made in one process on one GPU at batch 1" in line for line in report["verdict"])
    assert "a GPU runs out of memory" in capsys.readouterr().out
    # --resume reuses the searches over as many GPUs (nothing tried again), the tuning with its search.
    commands.clear()
    assert scale.main([*common, "--recipes", "tune", "--resume"]) == 0
    assert [c[c.index("--batch") + 1] for c in commands] == ["tune=2"] and "--tuned" in commands[0]
    # A search of ours whose tries took no statistics step after the optimizer's state existed (a report written
    # before they did) is made again; torch's stands.
    kept = json.loads(out.read_text())
    del kept["search"]["tune"]["stats_every"]
    out.write_text(json.dumps(kept))
    commands.clear()
    assert scale.main([*common, "--recipes", "torch-bf16,tune", "--resume"]) == 0
    assert [c[c.index("--batch") + 1] for c in commands] == ["torch-bf16=3", "tune=1", "tune=2", "tune=4",
                                                              "tune=3", "tune=2"]
    assert json.loads(out.read_text())["search"]["tune"]["stats_every"] == scale.SEARCH_STATS_EVERY
    assert "tried no statistics step after the optimizer's state existed" in capsys.readouterr().out
    # A tuning made again (other settings) that chooses another recipe: its batch is searched again, and the
    # report keeps the new tuning.
    commands.clear()
    fail["chosen"] = "fp32"
    assert scale.main([*common, "--recipes", "tune", "--tune-batch", "2", "--resume"]) == 0
    assert [c[c.index("--batch") + 1] for c in commands] == ["tune=2", "tune=1", "tune=2", "tune=4", "tune=3",
                                                              "tune=2"]
    assert json.loads(out.read_text())["search"]["tune"]["tuned"]["chosen"] == "fp32"
    fail["chosen"] = "bf16-pure+fp8+ckpt"
    # --tune-batch sets the tuning's batch apart from the run's.
    commands.clear()
    assert scale.main([*common[:-1], str(tmp_path / "apart.json"), "--recipes", "tune", "--batch", "tune=2",
                       "--tune-batch", "1"]) == 0
    assert [c[c.index("--batch") + 1] for c in commands] == ["tune=1", "tune=2"] and "--tune-only" in commands[0]
    # A tuning that fails is an error run of the report (at the batch given), and the command fails; so does a
    # run that fails.
    fail["tuning"] = True
    assert scale.main([*common, "--recipes", "tune", "--batch", "tune=2", "--tune-batch", "3", "--resume"]) == 1
    failed = json.loads(out.read_text())["runs"][-1]
    assert failed["recipe"] == "tune" and failed["batch"] == 2 and "the tuning failed" in failed["error"]
    fail["tuning"] = False
    commands.clear()
    fail["run"] = True
    assert scale.main([*common, "--recipes", "torch-bf16", "--resume"]) == 1
    assert [c[c.index("--batch") + 1] for c in commands] == ["torch-bf16=3"]
    report = json.loads(out.read_text())
    assert report["runs"][-1]["recipe"] == "torch-bf16" and "failed" in report["runs"][-1]["error"]
    assert report["runs"][-1]["batch"] == 3  # (the batch of the search reused)
    # A try that fails for another reason than memory: nothing ran, said so, and the report left as it was.
    fail.update(other=True, run=False)
    before = out.read_text()
    capsys.readouterr()
    assert scale.main([*common, "--recipes", "torch-bf16"]) == 1
    printed = capsys.readouterr().out
    assert "the try at batch 3 failed" in printed and "ValueError: something else" in printed
    assert "No recipe ran" in printed and out.read_text() == before
    assert scale.main([*common, "--recipes", "bf16-weights"]) == 1  # (skipped sharded)
    assert "No recipe ran" in capsys.readouterr().out and out.read_text() == before
    # Under --resume, a command cut short keeps the searches and the tuning made so far in the report; without
    # it, the report is left as it was.
    cut = tmp_path / "cut.json"
    fail.update(other=False, cut=True)
    before = out.read_text()
    with pytest.raises(KeyboardInterrupt):
        scale.main([*common, "--recipes", "tune"])
    assert out.read_text() == before
    with pytest.raises(KeyboardInterrupt):
        scale.main([*common[:-1], str(cut), "--recipes", "torch-bf16,tune", "--resume"])
    kept = json.loads(cut.read_text())
    assert kept["search"]["torch-bf16"]["batch"] == 3 and kept["search"]["tune"]["batch"] == 2
    assert kept["search"]["tune"]["tuned"]["chosen"] == "bf16-pure+fp8+ckpt" and kept["fsdp2"] == 2
    assert [r["recipe"] for r in kept["runs"]] == ["torch-bf16"]
    commands.clear()
    fail["cut"] = False
    assert scale.main([*common[:-1], str(cut), "--recipes", "tune", "--resume"]) == 0
    assert [c[c.index("--batch") + 1] for c in commands] == ["tune=2"]
    assert [r["recipe"] for r in json.loads(cut.read_text())["runs"]] == ["torch-bf16", "tune"]
    # Bad input, by name.
    for argv, message in ((["--fsdp2"], "--gpus starts torchrun itself"), (["--max-seconds", "9"], "--max-seconds"),
                          (["--merge", str(out)], "leave out --device, --gpus, --tiny"),
                          (["--layers", "3", "--json", str(out), "--resume"], "holds runs of shape")):
        with pytest.raises(SystemExit):
            scale.main(["--tiny", "--device", "cpu", "--gpus", "2", *argv])
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_scale_gpus_runs_each_recipe_under_torchrun(tmp_path):
    """The real thing on the CPU: torchrun with two gloo processes a try and a recipe; tune tuned in a process of
    its own, its choice then run sharded."""
    out = tmp_path / "scale.json"
    assert main(["scale", "--tiny", "--device", "cpu", "--gpus", "2", "--recipes", "torch-bf16,tune,bf16-pure",
                 "--batch", "bf16-pure=1", "--max-batch", "1", "--steps", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert sorted((r["recipe"], r["batch"], r["fsdp2"], r["ranks"]) for r in report["runs"]) == [
        ("bf16-pure", 1, 2, 2), ("torch-bf16", 1, 2, 2), ("tune", 1, 2, 2)]
    tuned = next(r for r in report["runs"] if r["recipe"] == "tune")
    assert tuned["chosen"] == report["search"]["tune"]["tuned"]["chosen"] and tuned["tuning"]["trials"]
    assert tuned["tuned_batch"] == 1
    assert report["search"]["torch-bf16"]["batch"] == 1 and "bf16-pure" not in report["search"]


def test_scale_starts_inductor_once_a_process_before_any_set_up(monkeypatch):
    """A compiled run's process starts inductor before the first recipe's set-up, so that neither a tuning nor an
    fp8 map (which compile first) carries inductor's start, which the same recipe run without them would not;
    once a process, and not at all when nothing compiles."""
    import argparse

    import torch

    calls = []
    monkeypatch.setattr(scale, "_INDUCTOR_STARTED", {})
    real_build = scale.build
    monkeypatch.setattr(scale, "build", lambda *a, **k: calls.append("build") or real_build(*a, **k))
    real_start = scale.start_inductor
    monkeypatch.setattr(scale, "start_inductor", lambda device: calls.append("start") or real_start(device))
    args = argparse.Namespace(checkpointing_now=False, compile="model", world=1, rank=0, lr=1e-4, stats_every=None)
    cpu = torch.device("cpu")
    first = scale.make_trainer("bf16-weights", scale.TINY, 0, cpu, args)
    second = scale.make_trainer("bf16-weights", scale.TINY, 0, cpu, args)
    assert calls == ["start", "build", "start", "build"]
    assert first.info["inductor_start_seconds"] > 0 and second.info["inductor_start_seconds"] == 0.0
    assert real_start(cpu) == 0.0  # started: nothing more to pay
    first.close(), second.close()
    calls.clear()
    args.compile = "off"
    off = scale.make_trainer("bf16-weights", scale.TINY, 0, cpu, args)
    assert calls == ["build"] and "inductor_start_seconds" not in off.info
    off.close()


def test_scale_inductor_that_cannot_start_is_said_once_and_recorded(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(scale, "_INDUCTOR_STARTED", {})

    def broken(fn, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    cpu = torch.device("cpu")
    assert scale.start_inductor(cpu) is None and scale.start_inductor(cpu) is None
    out = capsys.readouterr().out
    assert out.count("inductor did not start ahead of the recipes (RuntimeError: no C++ compiler)") == 1
