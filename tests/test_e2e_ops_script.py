"""bench/e2e_ops.py (the lead's GPU check of what the controller's step launches beyond its plain twin's) in its
CPU mode: the tiny GPT-2, aten ops in place of kernels."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _script():
    return load_bench_script("e2e_ops")


def test_bf16_pure_ordinary_step_differs_from_the_plain_loop_only_by_the_loss_it_keeps(tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert _script().main(["--cpu", "--recipes", "bf16-pure", "--steps", "1", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["recipes"]
    ordinary, stats = r["ordinary"], r["statistics"]
    assert ordinary["steps"] == 1 and stats["steps"] == 1
    # The controller keeps the step's loss for its monitor (loss.detach().float(): an fp32 loss, so no copy).
    extra = {name: cc - pc for name, pc, cc, _, _ in ordinary["differences"]}
    assert extra == {"aten::detach": 1, "aten::to": 1}
    assert ordinary["plain"]["syncs"] == ordinary["controller"]["syncs"] == 0  # (the CPU has no stream to sync)
    # A statistics step: bookkeeping on the statistics rows (tensor_stats itself is a native launch, not aten;
    # index_select's CPU implementation selects row by row).
    assert {name for name, *_ in stats["differences"]} <= {"aten::as_strided", "aten::cat", "aten::detach",
                                                           "aten::empty", "aten::index_select", "aten::select",
                                                           "aten::to", "aten::view"}
    assert "ordinary   controller" in capsys.readouterr().out
