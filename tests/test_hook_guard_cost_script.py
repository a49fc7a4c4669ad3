"""bench/hook_guard_cost.py: what dynamo's hook guards cost a compiled forward call, on the CPU."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script

pytest.importorskip("transformers")


@pytest.mark.parametrize("inference", [False, True])
def test_both_states_are_timed_and_dynamos_setting_is_left_as_it_was(inference, tmp_path, capsys):
    from torch._dynamo import config

    before = config.skip_nnmodule_hook_guards
    path = tmp_path / "guards.json"
    assert load_bench_script("hook_guard_cost").main(["--layers", "2", "--backend", "eager", "--rounds", "2",
                                                      "--calls", "3", "--repeats", "1", "--json", str(path)]
                                                     + ["--inference"] * inference) == 0
    res = json.loads(path.read_text())
    assert res["inference"] is inference
    assert res["layers"] == 2 and res["modules"] > 20  # a Llama's modules: embeddings, norms, projections
    assert len(res["round_ms"]["off"]) == len(res["round_ms"]["on"]) == 2
    assert res["guards_off_ms"] > 0 and res["guards_on_ms"] > 0
    assert res["guards_us_a_call"] == pytest.approx((res["guards_on_ms"] - res["guards_off_ms"]) * 1e3)
    assert config.skip_nnmodule_hook_guards == before
    assert "us a call" in capsys.readouterr().out


@pytest.mark.parametrize("option", ["--layers", "--rounds", "--calls", "--repeats", "--threads"])
def test_counts_below_one_are_refused_naming_the_option(option, capsys):
    with pytest.raises(SystemExit) as exc:
        load_bench_script("hook_guard_cost").main([option, "0"])
    assert exc.value.code == 2 and option in capsys.readouterr().err
