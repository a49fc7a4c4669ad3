"""One vocabulary (adaptive_amp.names): each format and recipe name means one thing wherever it is accepted."""

from __future__ import annotations

import pytest
import torch

import adaptive_amp
from adaptive_amp import names, reference
from adaptive_amp.analysis import PrecisionAnalyzer
from adaptive_amp.hardware import Capabilities
from adaptive_amp.policy import CANDIDATES, PrecisionPolicy, candidate_names, candidate_recipes, parse_dtype

CPU = Capabilities(device_type="cpu", name="test cpu", bf16=True)


@pytest.mark.parametrize("spelling, canonical", [
    ("bf16", "bfloat16"), ("BF16", "bfloat16"), ("torch.bfloat16", "bfloat16"), ("fp16", "float16"),
    ("half", "float16"), ("f16", "float16"), ("e4m3", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"),
    ("e5m2", "float8_e5m2"), ("float8_e5m2", "float8_e5m2"),
])
def test_a_format_spelling_means_the_same_format_everywhere(spelling, canonical):
    x = torch.randn(64)
    out = adaptive_amp.stochastic_round(x, spelling, seed=3)
    assert out.dtype == getattr(torch, canonical)
    assert torch.equal(out.view(torch.uint8), reference.stochastic_round(x, spelling, seed=3).view(torch.uint8))
    assert adaptive_amp.tensor_stats([x], fmt=spelling).fmt == canonical
    assert PrecisionAnalyzer(candidates=[spelling]).candidates == (canonical,)
    if canonical in ("float16", "bfloat16"):
        assert parse_dtype(spelling) == getattr(torch, canonical)
        p = PrecisionPolicy.from_string(f"params=float32,compute={spelling}")
        assert p.compute_dtype == getattr(torch, canonical)


@pytest.mark.parametrize("ambiguous", ["fp8", "float8", "FP8", "f8"])
def test_an_ambiguous_format_is_refused_with_the_alternatives(ambiguous):
    x = torch.randn(8)
    with pytest.raises(TypeError, match=r"ambiguous.*float8_e4m3fn \(e4m3\) or float8_e5m2 \(e5m2\)"):
        adaptive_amp.stochastic_round(x, ambiguous, seed=1)
    with pytest.raises(ValueError, match=r"ambiguous.*float8_e4m3fn \(e4m3\) or float8_e5m2 \(e5m2\)"):
        adaptive_amp.tensor_stats([x], fmt=ambiguous)
    with pytest.raises(ValueError, match="ambiguous"):
        PrecisionAnalyzer(candidates=[ambiguous])


@pytest.mark.parametrize("lone, recipe_policy, pure_hint", [
    ("bf16", "params=float32,compute=bfloat16", "bf16-pure"),
    ("bfloat16", "params=float32,compute=bfloat16", "bf16-pure"),
    ("fp16", "params=float32,compute=float16", "params=float16,compute=float16"),
    ("half", "params=float32,compute=float16", "params=float16,compute=float16"),
])
def test_a_lone_16_bit_name_in_a_policy_is_refused_with_both_spellings(lone, recipe_policy, pure_hint):
    """"bf16" as a recipe is bf16 autocast with fp32 weights; jmp's shorthand made it bf16 weights too."""
    with pytest.raises(ValueError, match="ambiguous") as info:
        PrecisionPolicy.from_string(lone)
    assert recipe_policy in str(info.value) and pure_hint in str(info.value)
    with pytest.raises(ValueError, match="ambiguous"):
        adaptive_amp.AdaptiveMixedPrecision(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters()),
                                            policy=lone, capabilities=CPU, progress=False)


def test_the_bf16_recipe_is_the_same_policy_as_a_candidate_and_spelled_out():
    recipes, _ = candidate_recipes(CPU, names=["bf16", "fp32", "bf16-pure", "bf16-weights"])
    by_name = {r.name: r.policy for r in recipes}
    assert by_name["bf16"] == PrecisionPolicy.from_string("params=float32,compute=bf16")
    assert by_name["fp32"] == PrecisionPolicy.from_string("fp32")
    assert by_name["bf16-pure"] == PrecisionPolicy.from_string("bf16-pure") == PrecisionPolicy.from_string("pure-bf16")
    assert by_name["bf16-weights"] == PrecisionPolicy.from_string("bf16-weights")


def test_candidate_aliases_are_the_canonical_candidates():
    assert candidate_names(["bfloat16+islands", "Float32", "pure-bf16+ckpt", "half", "BF16-weights+bf16-moments"]) \
        == ["bf16+islands", "fp32", "bf16-pure+ckpt", "fp16", "bf16-weights+bf16-moments"]
    assert candidate_names("bf16, fp32") == ["bf16", "fp32"]
    recipes, _ = candidate_recipes(CPU, names=["bfloat16"])
    assert [r.name for r in recipes] == ["bf16"]
    assert all(names.recipe_name(c) == c for c in CANDIDATES)


def test_fp8_candidates_stack_on_the_bf16_recipes_in_one_canonical_order():
    assert candidate_names(["bf16-pure+fp8+bf16-moments", "float8", "bfloat16+fp8+ckpt",
                            "bf16-weights+ckpt+fp8+bf16-moments", "pure-bf16+fp8"]) == [
        "bf16-pure+bf16-moments+fp8", "bf16+fp8", "bf16+fp8+ckpt", "bf16-weights+bf16-moments+fp8+ckpt",
        "bf16-pure+fp8"]
    assert [c for c in CANDIDATES if c.endswith("+fp8")] == [
        "bf16+fp8", "bf16-weights+fp8", "bf16-weights+bf16-moments+fp8", "bf16-pure+fp8",
        "bf16-pure+bf16-moments+fp8"]
    assert [names.fp8_preset(p) for p in ("bf16+fp8", "bf16-weights+fp8", "BF16-pure + fp8", "pure-bf16+fp8",
                                          "bf16-pure", "params=float32,compute=bfloat16", "tune")] == [
        "bf16", "bf16-weights", "bf16-pure", "bf16-pure", None, None, None]


@pytest.mark.parametrize("bad, match", [
    ("fp16+fp8", "policy 'fp16[+]fp8': fp8 stacks on bf16, bf16-weights, bf16-pure .*not on fp16"),
    ("fp32+fp8", "policy 'fp32[+]fp8': fp8 stacks on .*not on fp32"),
    ("bf16-pure+bf16-moments+fp8", "policy .*: a policy measuring its fp8 layers is one of 'bf16[+]fp8'"),
    ("bf16-pure+fp8+ckpt", "the optimizer's moments are the optimizer's own"),
])
def test_a_policy_with_fp8_on_another_base_or_with_other_suffixes_is_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        names.fp8_preset(bad)


@pytest.mark.parametrize("bad, match", [
    (["fp8"], "candidates 'fp8': fp8 names no recipe alone; it stacks on a bf16 recipe: 'bf16[+]fp8'"),
    (["fp16+fp8"], "candidates 'fp16[+]fp8': fp8 stacks on bf16, bf16-weights, bf16-pure"),
    (["fp32+fp8+ckpt"], "not on fp32"),
    (["bf16+fp8+nope"], "unknown; choose from fp32"),
    (["bf16+islands+fp8"], "unknown; choose from fp32"),
    (["float8", "bf16+fp8"], "'bf16[+]fp8' is 'bf16[+]fp8', given twice"),
    (["bf16", "bfloat16"], "'bfloat16' is 'bf16', given twice"),
    (["bf16+nope"], "unknown; choose from fp32"),
    ([], "candidates is empty"),
])
def test_bad_candidate_names_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        candidate_names(bad)


def test_the_vocabulary_is_written_down_once():
    doc = names.__doc__
    for name in (*names.FORMATS, *names.FORMAT_ALIASES, *names.AMBIGUOUS_FORMATS, "bf16-pure", "bf16-weights",
                 "+islands", "+bf16-moments", "+fp8", "+ckpt", "pure-bf16", "bf16-pure+bf16-moments+fp8+ckpt",
                 "bf16+fp8", "bf16-weights+fp8", "bf16-pure+fp8", "float8"):
        assert name in doc, name
