"""torch's LR schedulers beside the Accelerate bridge: no "optimizer.step() has been overridden" warning.

A scheduler wraps ``optimizer.step`` when it is made and, at its first step, warns when the method it finds
no longer carries its mark. The bridge replaces ``optimizer.step``; the replacement keeps the mark and
records what the scheduler's wrapper records, whether the scheduler was made before attach (the
transformers Trainer's order) or after.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _integ_models import tiny_gpt2, token_batches  # noqa: E402

# A transformers Trainer and Accelerate loops on a GPT-2: seconds each (`pytest -m slow`).
pytestmark = pytest.mark.slow

OVERRIDDEN = "has been overridden after learning rate scheduler initialization"


def _overridden_warnings(caught):
    return [str(w.message) for w in caught if OVERRIDDEN in str(w.message)]


@pytest.mark.parametrize("scheduler_made", ["before_attach", "after_attach"])
def test_accelerate_loop_scheduler_does_not_warn(scheduler_made):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from adaptive_amp.integrations.accelerate import attach

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if scheduler_made == "before_attach":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        model, opt, sched = accelerator.prepare(model, opt, sched)
        amp = attach(accelerator, model, opt, "auto", progress=False)
    else:
        model, opt = accelerator.prepare(model, opt)
        amp = attach(accelerator, model, opt, "auto", progress=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in token_batches(3):
            accelerator.backward(model(input_ids=batch, labels=batch).loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            lrs.append(opt.param_groups[0]["lr"])
    accelerator.free_memory()
    assert not _overridden_warnings(caught), _overridden_warnings(caught)
    assert amp.step_count == 3
    assert lrs == pytest.approx([1e-3 / 2, 1e-3 / 3, 1e-3 / 4])  # the scheduler stepped after each step


def test_trainer_scheduler_does_not_warn(tmp_path):
    from transformers import Trainer, TrainingArguments

    from adaptive_amp.integrations import transformers as adaptive_hf

    class Tokens(torch.utils.data.Dataset):
        rows = torch.cat(token_batches(2))

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0, lr_scheduler_type="linear")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens())
    callback = adaptive_hf.attach(trainer, "auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not _overridden_warnings(caught), _overridden_warnings(caught)
    assert callback.amp.step_count == 2
