"""bench/precision_ablation.py (issue 21: why bf16 weights lag autocast) still runs: its CPU smoke mode."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_bench_script

pytest.importorskip("transformers")


def test_precision_ablation_script_smoke(tmp_path):
    result = load_bench_script("precision_ablation").main(["--tiny", "--device", "cpu", "--steps", "12",
                                                           "--out", str(tmp_path)])
    runs = json.loads((tmp_path / "ablation.json").read_text())["runs"]
    assert set(runs) == set(result["runs"]) == {"torch-bf16", "bf16-pure", "bf16-master", "autocast-sr",
                                                         "bf16-weights"}
    # One model, the same batches: the recipes that share a forward share its first loss.
    assert runs["torch-bf16"]["first_loss"] == runs["autocast-sr"]["first_loss"]
    assert runs["bf16-pure"]["first_loss"] == runs["bf16-master"]["first_loss"]
    for name, r in runs.items():
        assert len(r["losses"]) == 12 and all(torch.isfinite(torch.tensor(r["losses"]))), name


def test_ablation_recipes_keep_their_precisions():
    script = load_bench_script("precision_ablation")
    from adaptive_amp import zoo

    for name, dtype in (("bf16-master", torch.bfloat16), ("autocast-sr", torch.float32)):
        zm = zoo.build("gpt2", "tiny", seed=0)
        step = script.recipe_step(name, zm, zm.model, 1e-3, torch.device("cpu"))
        step(zm.make_batch(2, seed=0))
        params = list(zm.model.parameters())
        assert all(p.dtype == dtype for p in params)
        # autocast-sr: every weight sits on the bf16 grid after a step.
        if name == "autocast-sr":
            assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in params)


def test_the_bf16_weights_recipe_keeps_the_residual_stream_in_fp32():
    script = load_bench_script("precision_ablation")
    from adaptive_amp import zoo
    from adaptive_amp.recipes import matmul_layers

    zm = zoo.build("gpt2", "tiny", seed=0)
    step = script.recipe_step("bf16-weights", zm, zm.model, 1e-3, torch.device("cpu"))
    seen = {}
    zm.model.transformer.h[0].register_forward_pre_hook(lambda m, args: seen.update(residual=args[0].dtype))
    assert torch.isfinite(step(zm.make_batch(2, seed=0)))
    assert seen["residual"] == torch.float32
    matmul = {id(p) for _, m in matmul_layers(zm.model) for p in m.parameters(recurse=False)}
    assert {p.dtype for p in zm.model.parameters() if id(p) in matmul} == {torch.bfloat16}
    assert {p.dtype for p in zm.model.parameters() if id(p) not in matmul} == {torch.float32}  # norms
