"""sample_inputs follow one rule (adaptive_amp.analysis.split_inputs) in the analyzer and the controller."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from adaptive_amp import AdaptiveMixedPrecision, zoo  # noqa: E402
from adaptive_amp.analysis import PrecisionAnalyzer, split_inputs  # noqa: E402
from adaptive_amp.hardware import Capabilities  # noqa: E402

CPU = Capabilities(device_type="cpu", name="test cpu", bf16=True)


def test_split_inputs_rule():
    x, y = torch.ones(2), torch.zeros(2)
    assert split_inputs(x) == ((x,), {})
    assert split_inputs((x, y)) == ((x, y), {})
    assert split_inputs([x]) == ((x,), {})
    assert split_inputs({"a": x}) == ((), {"a": x})
    assert split_inputs(((x,), {"a": y})) == ((x,), {"a": y})
    assert split_inputs(([x, y], {})) == ((x, y), {})
    assert split_inputs(((x, {"a": y}), {})) == ((x, {"a": y}), {})  # a sequence and a dict, positionally


@pytest.mark.parametrize("how", ["args_kwargs", "kwargs", "args"])
def test_controller_analyzes_gpt2_with_sample_inputs_as_args_and_kwargs(how):
    zm = zoo.build("gpt2", "tiny", seed=0)
    batch = zm.make_batch(2, seed=0)
    ids, mask = batch["input_ids"], torch.ones_like(batch["input_ids"])
    sample = {"args_kwargs": ((ids,), {"attention_mask": mask}), "kwargs": {"input_ids": ids, "attention_mask": mask},
              "args": (ids,)}[how]
    amp = AdaptiveMixedPrecision(zm.model, torch.optim.AdamW(zm.model.parameters()), policy="auto",
                                 sample_inputs=sample, capabilities=CPU, progress=False)
    try:
        assert amp.analysis is not None and len(amp.analysis.results) > 0
    finally:
        amp.remove()
    direct = PrecisionAnalyzer(candidates=["bf16"], progress=False).analyze(zm.model, sample)
    assert {r.name for r in direct.results} == {r.name for r in amp.analysis.results if r.dtype == "bfloat16"}
