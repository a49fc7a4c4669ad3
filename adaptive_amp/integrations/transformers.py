"""The transformers Trainer: one call on the Trainer before ``train()``.

Usage::

    trainer = Trainer(model=model, args=TrainingArguments(..., fp16=False, bf16=False), ...)
    adaptive_amp.integrations.transformers.attach(trainer, "auto")
    trainer.train()                     # or train(resume_from_checkpoint=...)

The Trainer trains through its Accelerator, so this is
:mod:`adaptive_amp.integrations.accelerate`'s bridge installed on
``trainer.accelerator``, plus a callback that connects the controller once
the Trainer has prepared its model and optimizer. The Trainer's own code
then does the rest: its ``max_grad_norm`` clipping goes through the scaler,
its LR scheduler does not step when ``accelerator.optimizer_step_was_skipped``
(the scaler's found_inf, read once per step by the Trainer), and its
checkpoints carry the controller's state in ``scaler.pt``.

For "bf16-pure", give the Trainer adaptive_amp's stochastic-rounding
optimizer: ``optimizer_cls_and_kwargs=(adaptive_amp.optim.AdamW,
{"lr": ..., "stochastic_rounding": True})``.
"""

from __future__ import annotations

from typing import Any, Union

from transformers import Trainer, TrainerCallback

from ..policy import PrecisionPolicy
from .accelerate import AcceleratorBridge

__all__ = ["AdaptiveAmpCallback", "attach"]


class AdaptiveAmpCallback(TrainerCallback):
    """Connects the bridge's controller when training begins (the optimizer is prepared by then)."""

    def __init__(self, bridge: AcceleratorBridge, trainer: Trainer):
        self.bridge = bridge
        self._trainer = trainer

    @property
    def amp(self):
        """The controller (None before ``train()`` begins)."""
        return self.bridge.amp

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer
        self.bridge.connect(trainer.model_wrapped, trainer.optimizer)
        return control


def attach(trainer: Trainer, policy: Union[str, PrecisionPolicy] = "auto",
           **controller_kwargs: Any) -> AdaptiveAmpCallback:
    """Make `trainer` train under AdaptiveMixedPrecision; returns the callback (its ``.amp`` is the controller).

    `policy` and `controller_kwargs` are AdaptiveMixedPrecision's. The
    TrainingArguments must leave ``fp16`` and ``bf16`` off: the policy decides.
    """
    if any(isinstance(cb, AdaptiveAmpCallback) for cb in trainer.callback_handler.callbacks):
        raise ValueError("adaptive_amp is already attached to this Trainer")
    bridge = AcceleratorBridge(trainer.accelerator, policy, **controller_kwargs)
    callback = AdaptiveAmpCallback(bridge, trainer)
    trainer.add_callback(callback)
    return callback
