"""Hugging Face Accelerate: one call after ``accelerator.prepare``.

Usage::

    accelerator = Accelerator()                       # mixed_precision="no": adaptive_amp decides
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    amp = adaptive_amp.integrations.accelerate.attach(accelerator, model, optimizer, "auto")
    for batch in loader:                              # the ordinary Accelerate loop, unchanged
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()                              # does not advance on a skipped step
        optimizer.zero_grad()

What each Accelerate call becomes:

* the model's forward runs under the controller's autocast (policy dtype,
  fp32 islands, layer statistics on training forwards). A model Accelerate
  compiled whole in one process (its dynamo plugin; the transformers
  Trainer's ``torch_compile``) runs the compiled forward inside that context,
  as a model compiled by hand does under the controller: one whole-model
  graph, and its statistics steps with the repeated blocks compiled. Under
  DDP the compiled wrapper holds DDP, and the context goes inside it: its
  statistics steps then compile the whole model a second time;
* ``accelerator.backward(loss)`` is the controller's backward (the loss scaled
  by :class:`adaptive_amp.GradScaler` where the policy scales, and recorded);
* ``accelerator.clip_grad_norm_`` is the scaler's ``clip_grad_norm_`` (the
  norm from the unscale pass, folded into fused optimizers' step);
* ``optimizer.step()`` is the controller's step (skip, scale update, monitor,
  adapt), and ``optimizer.step_was_skipped`` (which Accelerate's scheduler
  wrapper and ``accelerator.optimizer_step_was_skipped`` read) is the
  scaler's device-side ``found_inf``: the step itself never waits for the
  device; the flag synchronizes only when it is read as a bool. Accelerate's
  own test (did the patched ``optimizer.step`` run?) is always true for fused
  optimizers, which step on the device even when they skip;
* ``accelerator.save_state`` / ``load_state`` (and the transformers Trainer's
  checkpoints) keep the controller's state where they keep the scaler's
  (``scaler.pt``): ``accelerator.scaler`` is this bridge. Under several
  processes every rank's controller state goes into that one file (each
  rank resumes its own), and with FSDP2 the step that
  ``torch.distributed.checkpoint`` runs to create the optimizer's state
  before loading it is the optimizer's alone, not a training step.
* ``policy="tune"`` (with ``tune=dict(batches=..., loss_fn=...)``) tunes when
  the controller connects (the Trainer: as training begins; on a resume,
  again, from the restored weights, and the saved controller state then
  loads). A chosen recipe with bf16 weights or moments converts the optimizer
  in place, so that the prepared optimizer, and the checkpoints, hold the
  state that trains.

Accelerate's FSDP (``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2))``) and DDP strategies both work: the scaler all-reduces
found_inf and, for sharded gradients, the clip norm; the controller's
decisions are collective. Give FSDP2 a ``torch.optim`` optimizer
(adaptive_amp.optim's fused optimizers take plain tensors, not FSDP2's
sharded DTensor parameters).

The Accelerator must be created with ``mixed_precision="no"``: its own
autocast and scaler would fight the policy's.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Union

import torch
from torch import nn

from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from ..controller import AdaptiveMixedPrecision
from ..distributed import CollectiveAdaptiveMixedPrecision, world_group
from ..layers import unwrap_model
from ..policy import PrecisionPolicy
from ..step_result import StepResult

__all__ = ["AcceleratorBridge", "SkipFlag", "attach"]


class SkipFlag:
    """Whether the last optimizer step was skipped, kept on the device until someone asks.

    ``bool(flag)`` reads it: the step's :class:`~adaptive_amp.StepResult`, which
    waits for that step's work only (not for work launched since);
    :attr:`tensor` is the device-side value (nonzero: skipped) for code that
    wants to stay asynchronous, e.g. ``torch.where`` on a learning rate.
    """

    __slots__ = ("tensor", "_result")

    def __init__(self, found_inf: Optional[torch.Tensor], result: Optional[StepResult] = None):
        self.tensor, self._result = found_inf, result  # (no result: no step was taken, so none was skipped)

    def __bool__(self) -> bool:
        return self._result is not None and not self._result

    def __repr__(self):
        return f"SkipFlag({self.tensor!r})"


class _ScaledLoss:
    """What ``accelerator.scaler.scale(loss)`` returns: its ``backward`` is the controller's."""

    __slots__ = ("_bridge", "_loss")

    def __init__(self, bridge: "AcceleratorBridge", loss: torch.Tensor):
        self._bridge, self._loss = bridge, loss

    def backward(self, **kwargs: Any) -> None:
        self._bridge._require_amp().backward(self._loss, **kwargs)
        self._bridge._backward_since_step = True


def _raw_optimizer(optimizer):
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class AcceleratorBridge:
    """Connects an ``accelerate.Accelerator`` to an :class:`adaptive_amp.AdaptiveMixedPrecision`.

    Installed as ``accelerator.scaler`` (so that Accelerate's backward and
    checkpoints reach the controller); :meth:`connect` builds the controller
    on the prepared model and optimizer. Use :func:`attach`, which does both.
    """

    def __init__(self, accelerator: Accelerator, policy: Union[str, PrecisionPolicy] = "auto",
                 **controller_kwargs: Any):
        if accelerator.mixed_precision != "no":
            raise ValueError(f"the Accelerator was created with mixed_precision={accelerator.mixed_precision!r}; "
                             "adaptive_amp chooses the precision itself, so create it with mixed_precision='no' "
                             "(for the transformers Trainer: fp16=False, bf16=False) and pass the policy here")
        if getattr(accelerator, "scaler", None) is not None:
            raise ValueError("accelerator.scaler is already set; adaptive_amp installs its own")
        self.accelerator = accelerator
        self.policy = policy
        self.controller_kwargs = {"progress": False, **controller_kwargs}
        self.amp: Optional[AdaptiveMixedPrecision] = None
        self._optimizer = None  # the raw optimizer the controller steps
        self._pending_state: Optional[dict] = None
        self._backward_since_step = False
        self._saving: Optional[tuple] = None  # (step, every rank's state) for the save_state under way
        accelerator.scaler = self
        accelerator.register_save_state_pre_hook(self._gather_for_save_state)
        # Accelerate clips with torch's clip_grad_norm_ after an unscale that, with mixed_precision="no",
        # does nothing: the scaler's clip knows the scale (and fused optimizers' deferred unscaling).
        accelerator.clip_grad_norm_ = self.clip_grad_norm_

    # ------------------------------------------------------------ set-up
    def connect(self, model: nn.Module, optimizer) -> AdaptiveMixedPrecision:
        """Build the controller on `model` and `optimizer` as ``accelerator.prepare`` returned them."""
        if isinstance(optimizer, (list, tuple)):
            raise ValueError("adaptive_amp's Accelerate bridge drives one optimizer; combine the parameter "
                             "groups into one")
        if not isinstance(optimizer, AcceleratedOptimizer):
            raise TypeError("optimizer: pass the optimizer that accelerator.prepare returned (an "
                            f"AcceleratedOptimizer), got {type(optimizer).__name__}")
        module = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        # A model compiled whole around the module itself (Accelerate's dynamo plugin, the transformers
        # Trainer's torch_compile, in one process): the controller takes the compiled wrapper, as it takes a
        # user's, and its context goes around the compiled forward. Inside it, traced, the context broke the
        # graph into pieces and recompiled them, and the statistics steps compiled the whole model again.
        outer = model if model is not module and unwrap_model(model) is module else module
        raw = _raw_optimizer(optimizer)
        if self.amp is not None:
            self.amp.remove()
        make = CollectiveAdaptiveMixedPrecision if world_group() is not None else AdaptiveMixedPrecision
        self.amp = make(outer, raw, self.policy, **self.controller_kwargs)
        self._optimizer = raw
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.amp.load_state_dict(state)
        self._wrap_forward(outer)
        # Instance attribute, as Accelerate patches optimizer.step itself: the object the Accelerator,
        # its scheduler wrapper and the caller hold stays the same.
        optimizer.step = self._step_method(optimizer)
        optimizer._is_overflow = SkipFlag(None)
        return self.amp

    def _step_method(self, accelerated: AcceleratedOptimizer):
        """``optimizer.step`` under the bridge, keeping the mark torch's LR schedulers put on it.

        A scheduler made before :func:`attach` (the transformers Trainer makes it before training begins)
        wrapped ``optimizer.step`` to record ``_opt_called``; replacing that wrapper without its mark makes
        the scheduler's first step warn that ``optimizer.step()`` "has been overridden". A scheduler made
        after finds the mark and leaves the method alone.
        """
        bridge = self

        def step(closure=None):
            accelerated._opt_called = True  # what the scheduler's wrapper records
            return bridge._optimizer_step(accelerated, closure)

        step._wrapped_by_lr_sched = True
        return step

    def _wrap_forward(self, module: nn.Module) -> None:
        if getattr(module.forward, "_adaptive_amp_bridge", None) is self:
            return
        inner = module.forward
        bridge = self

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            amp = bridge.amp
            # Training forwards collect the controller's layer statistics on its statistics steps.
            with (amp.autocast() if module.training else amp.adjuster.autocast()):
                return inner(*args, **kwargs)

        forward._adaptive_amp_bridge = self
        module.forward = forward

    def _require_amp(self) -> AdaptiveMixedPrecision:
        if self.amp is None:
            raise RuntimeError("adaptive_amp: the controller is not connected yet; call "
                               "adaptive_amp.integrations.accelerate.attach(accelerator, model, optimizer) "
                               "after accelerator.prepare")
        return self.amp

    # ------------------------------------------------------------ the step
    def _optimizer_step(self, accelerated: AcceleratedOptimizer, closure=None) -> None:
        if closure is not None:
            raise RuntimeError("optimizer.step(closure) is not supported with loss scaling")
        if not accelerated.gradient_state.sync_gradients:
            return  # accumulating: Accelerate's own step does nothing either
        if self._is_state_initialization():
            # torch.distributed.checkpoint (Accelerate's FSDP2 load_state) creates the optimizer's state with a
            # step on zero gradients at lr 0 before loading the saved state into it. No loss is behind it: it
            # is the optimizer's, not a training step, and the controller (restored already) must not count it.
            self._optimizer.step()
            return
        self._backward_since_step = False
        amp = self._require_amp()
        scaler = amp.scaler  # (the step may replace it: a switch to bf16)
        result = amp.step()
        accelerated._is_overflow = SkipFlag(scaler.found_inf if scaler.is_enabled() else None, result)

    def _is_state_initialization(self) -> bool:
        """A step with no backward through Accelerate since the last one, on an optimizer that has no state
        yet, at lr 0 everywhere: it changes nothing and there is nothing to unscale, check or record."""
        raw = self._optimizer
        if self._backward_since_step or raw is None or raw.state:
            return False
        return all(float(g["lr"]) == 0.0 for g in raw.param_groups if "lr" in g)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the controller's optimizer's gradients (unscaled) to `max_norm`; the norm as a device tensor."""
        amp = self._require_amp()
        owned = {id(p) for g in self._optimizer.param_groups for p in g["params"]}
        stray = [p for p in parameters if p.grad is not None and id(p) not in owned]
        if stray:
            raise ValueError(f"clip_grad_norm_: {len(stray)} parameters with gradients are not in the optimizer "
                             "adaptive_amp steps; clip the optimizer's parameters")
        # The controller's clip: the norm it returns (all-reduced over FSDP2's shards) is the one its step records.
        return amp.clip_grad_norm_(float(max_norm), norm_type)

    # ------------------------------------------------ the scaler Accelerate sees
    def scale(self, loss: torch.Tensor) -> _ScaledLoss:
        self._require_amp()
        return _ScaledLoss(self, loss)

    def unscale_(self, optimizer) -> None:
        self._require_amp().scaler.unscale_(_raw_optimizer(optimizer))

    def get_scale(self) -> float:
        return self._require_amp().scaler.get_scale()

    def is_enabled(self) -> bool:
        return self.amp is not None and self.amp.scaler.is_enabled()

    @property
    def _device(self) -> torch.device:
        return self.amp.device if self.amp is not None else self.accelerator.device

    def _lazy_init_scale_growth_tracker(self, device) -> None:
        """Accelerate's FSDP2 load_state calls this after load_state_dict (torch's scaler creates its scale
        tensor lazily); the controller's scaler has its state from load_state_dict already."""

    def _gather_for_save_state(self, models, weights, output_dir) -> None:
        # accelerator.save_state runs on every rank, and every rank writes scaler.pt, to the same path. The
        # ranks' controller states differ (each keeps its own losses and layer statistics), so each rank
        # writes all of them (the same bytes): each resumes its own, and the writes cannot interleave into a
        # corrupt file. (The transformers Trainer saves scaler.pt from the main process alone, without this
        # hook: its checkpoints hold rank 0's state, which every rank resumes.)
        group = world_group()
        if group is None or self.amp is None:
            return
        states = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(states, self.amp.state_dict(), group=group)
        self._saving = (self.amp.step_count, {"adaptive_amp": states[0], "adaptive_amp_ranks": states})

    def state_dict(self) -> Dict[str, Any]:
        saving, self._saving = self._saving, None
        if saving is not None and self.amp is not None and saving[0] == self.amp.step_count:
            return saving[1]  # (not one left over from a save_state that failed at an earlier step)
        if self.amp is None:
            return {} if self._pending_state is None else {"adaptive_amp": self._pending_state}
        return {"adaptive_amp": self.amp.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "adaptive_amp" not in state_dict:
            raise ValueError("scaler state: no 'adaptive_amp' entry; this checkpoint was not saved with "
                             f"adaptive_amp's Accelerate bridge (keys: {sorted(state_dict)})")
        state = state_dict["adaptive_amp"]
        ranks = state_dict.get("adaptive_amp_ranks")
        group = world_group()
        if ranks is not None and group is not None and len(ranks) == torch.distributed.get_world_size(group):
            state = ranks[torch.distributed.get_rank(group)]
        if self.amp is None:
            self._pending_state = state  # loaded by connect()
        else:
            self.amp.load_state_dict(state)


def attach(accelerator: Accelerator, model: nn.Module, optimizer, policy: Union[str, PrecisionPolicy] = "auto",
           **controller_kwargs: Any) -> AdaptiveMixedPrecision:
    """Run `accelerator`'s training loop under AdaptiveMixedPrecision; returns the controller.

    Call after ``accelerator.prepare`` with the model and optimizer it
    returned. `policy` and `controller_kwargs` are AdaptiveMixedPrecision's.
    """
    bridge = accelerator.scaler if isinstance(accelerator.scaler, AcceleratorBridge) else None
    if bridge is None:
        bridge = AcceleratorBridge(accelerator, policy, **controller_kwargs)
    return bridge.connect(model, optimizer)
