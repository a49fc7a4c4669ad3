"""Tuning restores everything a trial can touch, and says what went wrong when nothing can be chosen."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from adaptive_amp import optim, zoo  # noqa: E402
from adaptive_amp.hardware import Capabilities  # noqa: E402
from adaptive_amp.policy import AdaptivePrecisionSelector  # noqa: E402
from adaptive_amp.recipes import AppliedRecipe  # noqa: E402

from conftest import assert_bitwise_equal  # noqa: E402

CPU = Capabilities(device_type="cpu", name="test cpu", bf16=True)
FAST = dict(steps=3, rounds=1, timed_steps=1, capabilities=CPU)
tune = AdaptivePrecisionSelector().tune


def _gpt2_with_a_head_and_a_loose_parameter():
    """The zoo's GPT-2, a classification head only the loss function uses, and a loose temperature the
    optimizer trains: neither is a parameter of the model."""
    zm = zoo.build("gpt2", "tiny", seed=0)
    torch.manual_seed(1)
    head = nn.Linear(zm.model.config.n_embd, 3)
    temperature = nn.Parameter(torch.ones(()))
    batches = [zm.make_batch(4, seed=i) for i in range(3)]
    labels = [torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for b, y in zip(batches, labels):
        b["labels3"] = y

    def loss_fn(model, batch):
        hidden = model.transformer(input_ids=batch["input_ids"]).last_hidden_state[:, -1]
        return nn.functional.cross_entropy(head(hidden).float() / temperature, batch["labels3"])

    return zm, head, temperature, batches, loss_fn


def _values(tensors, opt):
    out = {f"p{i}": t.detach().clone() for i, t in enumerate(tensors)}
    out.update({f"g{i}": t.grad.clone() for i, t in enumerate(tensors) if t.grad is not None})
    for i, t in enumerate(tensors):
        for k, v in opt.state.get(t, {}).items():
            out[f"s{i} {k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype, k
            assert_bitwise_equal(a[k], b[k], k)
        else:
            assert a[k] == b[k], k


def test_tune_restores_parameters_the_optimizer_trains_outside_the_model():
    zm, head, temperature, batches, loss_fn = _gpt2_with_a_head_and_a_loose_parameter()
    extra = [*head.parameters(), temperature]
    opt = torch.optim.AdamW([*zm.model.parameters(), *extra], lr=3e-3)
    loss_fn(zm.model, batches[0]).backward()  # a step taken: moments and gradients to restore too
    opt.step()
    everything = [*zm.model.parameters(), *extra]
    before = _values(everything, opt)
    result = tune(zm.model, opt, batches, loss_fn, candidates=["fp32", "bf16", "bf16-pure"], **FAST)
    _assert_same(before, _values(everything, opt))
    bf16 = next(t for t in result.trials if t.name == "bf16")
    assert bf16.grad_cosine is not None and bf16.grad_cosine > 0.9  # the head's gradients are compared too


def test_tune_of_a_model_without_parameters_of_its_own():
    """All the weights are the loss function's: the trials train them, compare them, and put them back."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.GELU(), nn.LayerNorm(16, elementwise_affine=False))
    head = nn.Linear(16, 4)
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    batches = [(x, torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(9 + i))) for i, x in enumerate(xs)]

    def loss_fn(model, batch):
        return nn.functional.cross_entropy(head(model(batch[0])).float(), batch[1])

    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    before = _values(list(head.parameters()), opt)
    result = tune(body, opt, batches, loss_fn, candidates=["fp32", "bf16"], **FAST)
    _assert_same(before, _values(list(head.parameters()), opt))
    bf16 = next(t for t in result.trials if t.name == "bf16")
    assert math.isfinite(bf16.grad_cosine) and bf16.grad_cosine > 0.9
    assert result.trials[0].state_bytes >= sum(p.numel() * 4 for p in head.parameters())


def _bf16_pure_run(zm, opt, batches, steps=3):
    recipe = next(r for r in AdaptivePrecisionSelector().candidates(CPU, names=["bf16-pure"])[0])
    applied = AppliedRecipe(recipe, zm.model, opt)
    losses = []
    for k in range(steps):
        with applied.autocast():
            loss = zm.loss(zm.model, batches[k % len(batches)])
        loss.backward()
        applied.optimizer.step()
        applied.optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in zm.model.parameters()]


def test_tune_restores_the_stochastic_rounding_generator_of_our_optimizer():
    """A run seeded through adaptive_amp.optim's generator is the same with or without a tuning before it."""
    def setup():
        zm = zoo.build("gpt2", "tiny", seed=0)
        gen = torch.Generator().manual_seed(1234)
        return zm, optim.AdamW(zm.model.parameters(), lr=3e-3, generator=gen), gen

    zm, opt, gen = setup()
    batches = [zm.make_batch(4, seed=i) for i in range(3)]
    plain_losses, plain_params = _bf16_pure_run(zm, opt, batches)

    zm, opt, gen = setup()
    state = gen.get_state()
    tune(zm.model, opt, batches, zm.loss, candidates=["fp32", "bf16-pure"], **FAST)
    assert torch.equal(gen.get_state(), state)
    losses, params = _bf16_pure_run(zm, opt, batches)
    assert losses == plain_losses
    for a, b in zip(params, plain_params):
        assert_bitwise_equal(a, b)


# ---------------------------------------------------------------------------- errors


class _Counted:
    """loss_fn that counts its calls: a refusal "before any trial" leaves it at 0."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, model, batch):
        self.calls += 1
        return self.fn(model, batch)


def _small():
    zm = zoo.build("gpt2", "tiny", seed=0)
    return zm, torch.optim.AdamW(zm.model.parameters(), lr=1e-3), [zm.make_batch(2, seed=i) for i in range(2)]


def test_every_trial_non_finite_says_so_not_raise_the_budget():
    zm, opt, batches = _small()
    with pytest.raises(RuntimeError, match="every candidate's loss was non-finite") as info:
        tune(zm.model, opt, batches, lambda m, b: zm.loss(m, b) * float("nan"), candidates=["fp32", "bf16"],
             **FAST)
    assert "memory_budget" not in str(info.value) and "fp32: non-finite loss at step 0" in str(info.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(candidates=[]), "candidates is empty"),
    (dict(candidates=["bf16+islands"]), "candidates: none of them can run here .*bf16\\+islands: no sensitivity"),
    (dict(tie=-0.01), "tie is -0.01"),
    (dict(tie=float("nan")), "tie is nan"),
    (dict(loss_tolerance=-1.0), "loss_tolerance is -1.0"),
    (dict(min_cosine=float("nan")), "min_cosine is nan"),
    (dict(memory_budget=float("inf")), "memory_budget is inf"),
    (dict(memory_budget=float("nan")), "memory_budget is nan"),
    (dict(memory_budget=-5), "memory_budget is -5"),
    (dict(memory_budget="-5GiB"), "memory_budget is '-5GiB'"),
    (dict(memory_budget="lots"), "memory_budget 'lots'"),
    (dict(memory_budget="infGiB"), "memory_budget .*'infGiB'"),
    (dict(memory_budget="0.1B"), "memory_budget is '0.1B'"),
    (dict(memory_budget=True), "memory_budget is True"),
])
def test_bad_options_are_refused_by_name_before_any_trial(kwargs, match):
    zm, opt, batches = _small()
    loss_fn = _Counted(zm.loss)
    with pytest.raises(ValueError, match=match):
        tune(zm.model, opt, batches, loss_fn, **{**FAST, "candidates": ["fp32", "bf16"], **kwargs})
    assert loss_fn.calls == 0


@pytest.mark.parametrize("change, error, match", [
    (dict(steps="8"), TypeError, "steps is '8'; pass an int"),
    (dict(steps=2.7), TypeError, "steps is 2.7; pass an int"),
    (dict(rounds=True), TypeError, "rounds is True"),
    (dict(state_margin="0.1"), TypeError, "state_margin is '0.1'"),
    (dict(progress="yes"), TypeError, "progress is a str"),
    (dict(loss_fn=None), TypeError, "loss_fn is a NoneType"),
    (dict(batches=5), TypeError, "batches is a int"),
    (dict(model=None), TypeError, "model is a NoneType"),
])
def test_arguments_of_the_wrong_type_are_refused_by_name_before_any_trial(change, error, match):
    zm, opt, batches = _small()
    loss_fn = _Counted(zm.loss)
    args = dict(model=zm.model, batches=batches, loss_fn=loss_fn)
    options = {**FAST, "candidates": ["fp32", "bf16"]}
    for k, v in change.items():
        (args if k in args else options)[k] = v
    with pytest.raises(error, match=match):
        tune(args["model"], opt, args["batches"], args["loss_fn"], **options)
    assert loss_fn.calls == 0
