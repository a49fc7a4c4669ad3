"""adaptive_amp inside a real transformers Trainer and a plain Accelerate loop (CPU, tiny GPT-2).

On the CPU Accelerate turns its fp16 path off (no autocast, no scaler); the
tests switch it on by hand (native_amp and a scaler on the Accelerator, as
it has on a GPU) to get the libraries' own fp16 path as the reference.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

# transformers Trainers and Accelerate on a GPT-2, against the libraries' own fp16 path: seconds each (`pytest -m slow`).
pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainingArguments  # noqa: E402

import adaptive_amp  # noqa: E402
from adaptive_amp.integrations import transformers as hf  # noqa: E402
from adaptive_amp.integrations.accelerate import SkipFlag  # noqa: E402

from _integ_models import tiny_gpt2, token_batches  # noqa: E402
from conftest import cuda_param  # noqa: E402

FP16 = "params=float32,compute=float16,loss_scale=dynamic:1024:growth_interval=3"


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=24):
        self.rows = torch.cat(token_batches(n // 4))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class InjectingTrainer(Trainer):
    """Makes the loss infinite at chosen optimizer steps (every gradient becomes inf/NaN) and keeps the
    learning rate and loss of every step."""

    def __init__(self, *args, inject_inf_at=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.inject_inf_at = set(inject_inf_at)
        self.lrs, self.losses = [], []

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses.append(loss.detach().float().item())
        self.lrs.append(self.optimizer.param_groups[0]["lr"])
        return loss * float("inf") if self.state.global_step in self.inject_inf_at else loss


def _args(tmp_path, steps=6, device="cpu", **kw):
    base = dict(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
                use_cpu=device == "cpu", report_to=[], logging_steps=1000, save_strategy="no", seed=0, data_seed=0,
                full_determinism=True, disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=0.0,
                optim="adamw_torch", lr_scheduler_type="linear")
    base.update(kw)
    args = TrainingArguments(**base)
    if device == "cuda":
        # One GPU: on a host with several, the Trainer would wrap the model in DataParallel (one loss per GPU).
        _ = args.device
        args._n_gpu = 1
    return args


def _trainer(tmp_path, steps=6, inject_inf_at=(), device="cpu", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return InjectingTrainer(model=tiny_gpt2(), args=_args(tmp_path, steps, device, **kw), train_dataset=Tokens(),
                                inject_inf_at=inject_inf_at)


def _their_fp16(trainer, scaler):
    """Accelerate's own fp16 path, which it switches off on the CPU: autocast in prepare, the scaler in
    backward, unscale_gradients and AcceleratedOptimizer.step."""
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = scaler
    return trainer


def _same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs"


def _torch_scaler(device="cpu"):
    return torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=3)


@pytest.mark.parametrize("device", ["cpu", cuda_param()])
def test_trainer_fp16_matches_accelerate_amp_bitwise(tmp_path, device):
    """attach(trainer, fp16 policy) == the Trainer's own fp16 path (torch's scaler), an overflow at step 2
    included; and our GradScaler dropped into that path == torch's."""
    theirs = _their_fp16(_trainer(tmp_path / "a", fp16=True, inject_inf_at=[2], device=device),
                         _torch_scaler(device))
    theirs.train()
    drop_in_scaler = adaptive_amp.GradScaler(device, init_scale=1024.0, growth_interval=3)
    drop_in = _their_fp16(_trainer(tmp_path / "b", fp16=True, inject_inf_at=[2], device=device), drop_in_scaler)
    drop_in.train()
    ours = _trainer(tmp_path / "c", inject_inf_at=[2], device=device)
    cb = hf.attach(ours, FP16, read_every=2)
    ours.train()
    for other in (drop_in, ours):
        _same_params(theirs.model, other.model)
        assert other.losses == theirs.losses and other.lrs == theirs.lrs
    assert drop_in_scaler.get_scale() == ours.accelerator.scaler.get_scale() == theirs.accelerator.scaler.get_scale()
    amp = cb.amp
    assert amp.step_count == 6 and amp.scaler.skipped_steps == 1
    assert amp.report(plots=False).history["found_inf"][:6] == [0, 0, 1, 0, 0, 0]


def test_trainer_bf16_matches_accelerate_amp_bitwise(tmp_path):
    theirs = _trainer(tmp_path / "a", bf16=True)
    theirs.train()
    ours = _trainer(tmp_path / "b")
    cb = hf.attach(ours, "params=float32,compute=bfloat16")
    ours.train()
    _same_params(theirs.model, ours.model)
    assert ours.losses == theirs.losses
    assert cb.amp.step_count == 6 and not cb.amp.scaler.is_enabled()


@pytest.mark.parametrize("device", ["cpu", cuda_param()])
def test_fused_optimizer_skip_keeps_the_scheduler_still(tmp_path, device):
    """With a fused optimizer (the Trainer's default adamw_torch_fused) Accelerate's skip test sees the
    step run and advances the LR schedule on an overflowing step; the bridge reports the skip from the
    scaler's device-side found_inf, so the schedule waits."""
    theirs = _their_fp16(_trainer(tmp_path / "a", fp16=True, inject_inf_at=[2], optim="adamw_torch_fused",
                                  device=device), _torch_scaler(device))
    theirs.train()
    ours = _trainer(tmp_path / "b", inject_inf_at=[2], optim="adamw_torch_fused", device=device)
    cb = hf.attach(ours, FP16)
    ours.train()
    # Step 3 runs with the learning rate step 2 had: the skipped step did not advance the schedule.
    assert ours.lrs[3] == ours.lrs[2] and ours.lrs[2] != ours.lrs[1]
    assert theirs.lrs[3] != theirs.lrs[2]  # Accelerate's own path: the schedule moved on a skipped step
    assert ours.lr_scheduler.last_epoch == 6 - 1
    assert cb.amp.scaler.skipped_steps == 1
    flag = ours.optimizer.step_was_skipped
    assert isinstance(flag, SkipFlag) and isinstance(flag.tensor, torch.Tensor) and not flag


def test_trainer_clipping_agrees_with_torch_clip(tmp_path):
    theirs = _their_fp16(_trainer(tmp_path / "a", fp16=True, max_grad_norm=0.05, logging_steps=1),
                         _torch_scaler())
    theirs.train()
    ours = _trainer(tmp_path / "b", max_grad_norm=0.05, logging_steps=1)
    hf.attach(ours, FP16)
    ours.train()
    # The norm comes from the unscale pass (per-chunk sums, fp64 across chunks): it differs from torch's
    # in the 7th digit, and Adam carries that into the weights (up to ~lr/20 on weights whose gradients
    # are near zero). The losses agree.
    norms = [[h["grad_norm"] for h in t.state.log_history if "grad_norm" in h] for t in (theirs, ours)]
    assert len(norms[0]) == 6
    torch.testing.assert_close(torch.tensor(norms[1]), torch.tensor(norms[0]), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=1e-5, atol=0)
    for p, q in zip(theirs.model.parameters(), ours.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-4)


def test_trainer_resume_from_checkpoint_bitwise(tmp_path):
    straight = _trainer(tmp_path / "s", inject_inf_at=[4], save_strategy="steps", save_steps=3)
    cb_s = hf.attach(straight, FP16, read_every=2)
    straight.train()
    ckpt = tmp_path / "s" / "checkpoint-3"
    saved = torch.load(ckpt / "scaler.pt", weights_only=True)
    assert saved["adaptive_amp"]["step"] == 3

    resumed = _trainer(tmp_path / "r", inject_inf_at=[4])
    cb_r = hf.attach(resumed, FP16, read_every=2)
    resumed.train(resume_from_checkpoint=str(ckpt))
    _same_params(straight.model, resumed.model)
    assert resumed.losses == straight.losses[3:]
    assert cb_r.amp.step_count == 6
    assert cb_r.amp.scaler.state_dict() == cb_s.amp.scaler.state_dict()
    assert json.dumps(cb_r.amp.state_dict()["monitor"]) == json.dumps(cb_s.amp.state_dict()["monitor"])


def test_trainer_bf16_pure_and_auto(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_gpt2()
        model.to(torch.bfloat16)
        opt = adaptive_amp.optim.AdamW(model.parameters(), lr=1e-2, stochastic_rounding=True)
        pure = InjectingTrainer(model=model, args=_args(tmp_path / "p"), train_dataset=Tokens(),
                                optimizers=(opt, None))
    cb = hf.attach(pure, "bf16-pure")
    pure.train()
    assert all(p.dtype == torch.bfloat16 for p in pure.model.parameters())
    assert all(torch.isfinite(torch.tensor(pure.losses)))
    assert str(cb.amp.policy).startswith("params=bfloat16")

    auto = _trainer(tmp_path / "a", steps=2)
    cb = hf.attach(auto, "auto")
    auto.train()
    assert cb.amp.step_count == 2


def test_trainer_tune_checkpoints_the_optimizer_its_choice_steps(tmp_path):
    """policy="tune" choosing bf16-pure converts the Trainer's optimizer in place to its stochastic-rounding twin,
    state included, so that the Trainer's checkpoints hold the moments that train (with a new twin object they
    held the original's emptied state), and a resume (which tunes again, from the restored weights) continues
    bitwise."""
    batches = [{"input_ids": b, "labels": b} for b in token_batches(2)]
    tune = dict(batches=batches, loss_fn=lambda m, b: m(**b).loss, candidates=["bf16-pure"], steps=2)

    straight = _trainer(tmp_path / "s", save_strategy="steps", save_steps=3)
    cb_s = hf.attach(straight, "tune", tune=tune)
    straight.train()
    assert cb_s.amp.tuning.recipe.name == "bf16-pure"
    converted = cb_s.amp.optimizers[0]
    assert isinstance(converted, adaptive_amp.optim.AdamW) and straight.optimizer.optimizer is converted
    ckpt = tmp_path / "s" / "checkpoint-3"
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(saved["state"]) == len(list(straight.model.parameters()))

    resumed = _trainer(tmp_path / "r")
    cb_r = hf.attach(resumed, "tune", tune=tune)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert all(p.dtype == torch.bfloat16 for p in resumed.model.parameters())
    _same_params(straight.model, resumed.model)
    assert resumed.losses == straight.losses[3:]
    assert cb_r.amp.step_count == 6


def test_trainer_torch_compile_compiles_once_with_the_controllers_context_around_the_graph(tmp_path):
    """The Trainer compiles the model whole (its torch_compile): the controller takes the compiled wrapper and its
    context goes around the compiled forward. Inside it, traced, the context broke the graph into pieces and
    recompiled them at later steps (CPU, aot_eager: 6, 7, 7, 10, 14 and 14 graphs after each of six steps)."""
    from torch._dynamo.utils import counters
    from transformers import TrainerCallback

    class Graphs(TrainerCallback):
        after = []

        def on_step_end(self, args, state, control, **kwargs):
            self.after.append(counters["stats"]["unique_graphs"])

    torch._dynamo.reset()
    counters.clear()
    trainer = _trainer(tmp_path, steps=6, torch_compile=True, torch_compile_backend="aot_eager")
    cb = hf.attach(trainer, "params=float32,compute=bfloat16", stats_every=2, read_every=2)
    graphs = Graphs()
    trainer.add_callback(graphs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert cb.amp.model is trainer.model_wrapped and cb.amp.model is not trainer.model  # the compiled wrapper
    # Nothing compiles after the second step (the first, a statistics step, compiled one block's graph).
    assert graphs.after[-1] == graphs.after[1] <= 3, graphs.after
    assert sorted({ls.step for ls in cb.amp.monitor.layer_stats}) == [0, 2, 4]
    torch._dynamo.reset()


def test_attach_refuses_the_trainers_own_mixed_precision(tmp_path):
    with pytest.raises(ValueError, match="mixed_precision='no'"):
        hf.attach(_trainer(tmp_path, bf16=True), "auto")


def test_accelerate_loop_with_save_and_load_state(tmp_path):
    """The plain Accelerate loop: fused SR optimizer, scheduler through accelerator.prepare, a skipped step,
    and accelerator.save_state / load_state resuming bitwise."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed

    from adaptive_amp.integrations.accelerate import attach

    def run(steps, start=0, load=None, save_at=None):
        set_seed(0)
        # Accelerate keeps its state per process; an earlier Trainer may have set bf16 there.
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(cpu=True, mixed_precision="no")
        model = tiny_gpt2()
        opt = adaptive_amp.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        model, opt, sched = accelerator.prepare(model, opt, sched)
        amp = attach(accelerator, model, opt, FP16, read_every=2)
        if load is not None:
            accelerator.load_state(load)
        lrs, skipped = [], []
        for i, batch in enumerate(token_batches(steps)):
            if i < start:
                continue
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss * (float("inf") if i == 4 else 1.0))
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
            skipped.append(bool(accelerator.optimizer_step_was_skipped))
            opt.zero_grad()
            if save_at is not None and i + 1 == save_at:
                accelerator.save_state(str(tmp_path / "state"))
        accelerator.free_memory()
        return model, amp, lrs, skipped

    m_straight, amp_straight, lrs, skipped = run(7, save_at=3)
    assert skipped == [False] * 4 + [True] + [False] * 2
    assert lrs[5] == lrs[4]  # the scheduler did not step after the skipped step
    assert amp_straight.scaler.skipped_steps == 1
    m_resumed, amp_resumed, lrs_resumed, _ = run(7, start=3, load=str(tmp_path / "state"))
    assert lrs_resumed == lrs[3:]
    _same_params(m_straight, m_resumed)
    assert amp_resumed.step_count == 7
    assert amp_resumed.scaler.state_dict() == amp_straight.scaler.state_dict()
    assert os.path.exists(tmp_path / "state" / "scaler.pt")


def test_accelerate_gradient_accumulation_steps_once_per_window():
    """gradient_accumulation_steps=2 under accelerator.accumulate: the bridge steps the controller at the
    window's end only, bitwise as the controller driven by hand (losses halved, two backwards, one step)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from adaptive_amp.integrations.accelerate import attach

    data = token_batches(6)

    def by_accelerate():
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=2)
        model = tiny_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        model, opt = accelerator.prepare(model, opt)
        amp = attach(accelerator, model, opt, FP16)
        for batch in data:
            with accelerator.accumulate(model):
                accelerator.backward(model(input_ids=batch, labels=batch).loss)
                opt.step()
                opt.zero_grad()
        accelerator.free_memory()
        return accelerator.unwrap_model(model), amp

    def by_hand():
        model = tiny_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        amp = adaptive_amp.AdaptiveMixedPrecision(model, opt, FP16, progress=False)
        for i, batch in enumerate(data):
            with amp.autocast():
                loss = model(input_ids=batch, labels=batch).loss
            amp.backward(loss / 2)
            if i % 2 == 1:
                amp.step()
                amp.zero_grad()
        return model, amp

    m_acc, amp_acc = by_accelerate()
    m_ref, amp_ref = by_hand()
    _same_params(m_ref, m_acc)
    assert amp_acc.step_count == amp_ref.step_count == 3
