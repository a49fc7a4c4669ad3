"""PyTorch Lightning: ``Trainer(plugins=[AdaptivePrecision("auto")])``.

:class:`AdaptivePrecision` is a Lightning ``Precision`` plugin that runs
:class:`adaptive_amp.AdaptiveMixedPrecision` (the controller) inside the
Trainer: policy selection, fp32 islands, loss scaling with
:class:`adaptive_amp.GradScaler`, monitoring and adaptation, "bf16-pure" with
adaptive_amp's stochastic-rounding optimizers, and the controller's state in
Lightning checkpoints. :class:`AdaptiveFabricPrecision` is its Fabric twin.

The plain path needs no plugin of ours: Lightning's own
``MixedPrecision("16-mixed", device, scaler=adaptive_amp.GradScaler(device))``
takes our scaler as it takes torch's.

Works with both of Lightning's packages: ``pytorch_lightning`` (with
``lightning_fabric``) and the unified ``lightning`` (``lightning.pytorch``,
``lightning.fabric``). They hold separate copies of the same classes, and a
Trainer accepts only plugins derived from its own package's ``Precision``; so
the two plugins here derive from the ``Precision`` of every package that is
installed, and one ``AdaptivePrecision`` goes into either Trainer (one
``AdaptiveFabricPrecision`` into either Fabric). Importing this module needs
at least one of the two packages.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import nn

from ._lightning_packages import (FABRIC_PRECISION_BASES, GradClipAlgorithmType, LIGHTNING_MODULES,
                                  TRAINER_PRECISION_BASES)

from ..controller import AdaptiveMixedPrecision
from ..distributed import CollectiveAdaptiveMixedPrecision, world_group
from ..names import fp8_preset
from ..policy import PrecisionPolicy, recipe_policy
from ..recipes import cast_for_policy

__all__ = ["AdaptivePrecision", "AdaptiveFabricPrecision"]

# Lightning's name for what a policy computes in (its `precision` attribute, for logs and checks).
_LIGHTNING_NAMES = {(torch.float32, torch.float16): "16-mixed", (torch.float32, torch.bfloat16): "bf16-mixed",
                    (torch.bfloat16, torch.bfloat16): "bf16-true", (torch.float32, torch.float32): "32-true"}


def _lightning_name(policy, default: str) -> str:
    """Lightning's name of the nearest precision (bf16-weights computes under autocast: "bf16-mixed")."""
    if getattr(policy, "param_scope", "all") == "matmul":
        return "bf16-mixed"
    return _LIGHTNING_NAMES.get((getattr(policy, "param_dtype", None), getattr(policy, "compute_dtype", None)),
                                default)


def _parse_policy(policy) -> Union[str, PrecisionPolicy]:
    """The plugin's policy, checked before the Trainer starts: a PrecisionPolicy (also from its string form), or
    the name of a policy the controller decides when it is built ("auto", "tune", a "+fp8" preset)."""
    if isinstance(policy, PrecisionPolicy):
        return policy
    if not isinstance(policy, str):
        raise TypeError("policy must be 'auto', 'tune', a '+fp8' preset ('bf16+fp8', 'bf16-weights+fp8', "
                        f"'bf16-pure+fp8'), a PrecisionPolicy or its string form, got {type(policy).__name__}")
    name = policy.strip().lower()
    if name in ("auto", "tune"):
        return name
    if fp8_preset(policy) is not None:  # (refuses "+fp8" on a base it cannot stack on, naming the policy)
        return policy.strip()
    return PrecisionPolicy.from_string(policy)


def _known_policy(policy) -> Optional[PrecisionPolicy]:
    """What the plugin knows of the parameters and compute before the controller exists: the policy, or for a
    "+fp8" preset its base recipe's (the fp8 layers are measured when the controller is built); None for
    "auto" and "tune"."""
    if isinstance(policy, PrecisionPolicy):
        return policy
    base = fp8_preset(policy)
    return None if base is None else recipe_policy(base)


def _handles_unscaling(optimizer) -> bool:
    return getattr(optimizer, "_step_supports_amp_scaling", False)


class _ControllerHost:
    """What both plugins share: the policy and controller arguments, the controller once it can exist,
    and its state in checkpoints."""

    def _init_host(self, policy, controller_kwargs: Dict[str, Any]) -> None:
        self.policy = _parse_policy(policy)
        self.controller_kwargs = dict(controller_kwargs)
        self.controller_kwargs.setdefault("progress", False)
        self.amp: Optional[AdaptiveMixedPrecision] = None
        self._pending_state: Optional[dict] = None
        self._clip_norm: Optional[tuple] = None  # (max_norm, norm_type) for the next step
        self.precision = _lightning_name(_known_policy(self.policy), "32-true")

    def convert_module(self, module: nn.Module) -> nn.Module:
        # bf16-pure, bf16-weights (and their "+fp8" presets): cast before the strategy wraps the module (DDP's
        # buckets follow the parameters' dtype) and before the optimizer is built on it, so that its state is
        # bf16-sized from the start; the cast the controller would make (all of the module, or its matmul
        # layers' weights).
        known = _known_policy(self.policy)
        if known is not None and known.param_dtype == torch.bfloat16:
            cast_for_policy(module, known)
        return module

    def _build(self, module: nn.Module, optimizers: List[torch.optim.Optimizer]) -> AdaptiveMixedPrecision:
        if self.amp is not None:
            self.amp.remove()  # a second fit: the islands of the first one come off before new ones go on
        kwargs = dict(self.controller_kwargs)
        if world_group() is not None:
            self.amp = CollectiveAdaptiveMixedPrecision(module, optimizers, self.policy, **kwargs)
        else:
            self.amp = AdaptiveMixedPrecision(module, optimizers, self.policy, **kwargs)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.amp.load_state_dict(state)
        policy = self.amp.policy
        self.precision = _lightning_name(policy, self.precision)
        return self.amp

    def _require_amp(self, what: str) -> AdaptiveMixedPrecision:
        if self.amp is None:
            raise RuntimeError(f"{type(self).__name__}.{what}: the controller does not exist yet; "
                               + self._how_to_connect)
        return self.amp

    def _step(self, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"{type(self).__name__}: optimizer.step() arguments {sorted(kwargs)} are not "
                            "supported (the controller steps every optimizer itself)")
        clip, self._clip_norm = self._clip_norm, None
        amp = self._require_amp("optimizer_step")
        if clip is None:
            return amp.step()
        return amp.step(max_grad_norm=clip[0], norm_type=clip[1])

    def _unscale(self, optimizer) -> None:
        scaler = self._require_amp("unscale_gradients").scaler
        if scaler.is_enabled():
            if _handles_unscaling(optimizer):
                raise NotImplementedError(
                    f"{type(optimizer).__name__} unscales its gradients inside its own step (fused), so they "
                    "cannot be unscaled for clipping by value; clip by norm, which is folded into its step")
            scaler.unscale_(optimizer)

    def state_dict(self) -> Dict[str, Any]:
        if self.amp is None:
            return {} if self._pending_state is None else {"adaptive_amp": self._pending_state}
        return {"adaptive_amp": self.amp.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not state_dict:
            return
        if "adaptive_amp" not in state_dict:
            raise ValueError(f"{type(self).__name__}.load_state_dict: no 'adaptive_amp' entry (keys: "
                             f"{sorted(state_dict)}); was the checkpoint saved with this plugin?")
        if self.amp is None:
            self._pending_state = state_dict["adaptive_amp"]  # loaded when the controller is built
        else:
            self.amp.load_state_dict(state_dict["adaptive_amp"])


def _lightning_module(model: nn.Module) -> nn.Module:
    """The LightningModule inside what the strategy wrapped (DDP and Lightning's own wrapper)."""
    if isinstance(model, LIGHTNING_MODULES):
        return model
    for module in model.modules():
        if isinstance(module, LIGHTNING_MODULES):
            return module
    return model


def _overrides_backward(model) -> bool:
    """Whether a LightningModule subclass defines its own backward (which the plugin cannot call)."""
    return any(isinstance(model, base) and type(model).backward is not base.backward for base in LIGHTNING_MODULES)


class AdaptivePrecision(_ControllerHost, *TRAINER_PRECISION_BASES):
    """Lightning ``Precision`` plugin that trains under :class:`adaptive_amp.AdaptiveMixedPrecision`.

    Usage::

        trainer = Trainer(plugins=[AdaptivePrecision("auto")])   # pytorch_lightning's or lightning.pytorch's

    Args:
        policy: ``"auto"`` (select from the hardware and the model), a
            :class:`adaptive_amp.PrecisionPolicy` or its string form
            (``"params=float32,compute=float16,loss_scale=dynamic"``,
            ``"bf16-pure"``), a ``"+fp8"`` preset (``"bf16+fp8"``,
            ``"bf16-weights+fp8"``, ``"bf16-pure+fp8"``: its base recipe, and
            fp8 in each layer measured to gain and tolerate it, on
            ``sample_inputs`` or ``fp8=dict(batches=...)`` run through the
            module's ``forward`` unless ``fp8`` has a ``run``), or ``"tune"``
            (``tune=dict(batches=..., loss_fn=fn(module, batch))``: the
            candidates are measured when ``fit`` sets up the module, and on a
            resume again, from the restored weights). With ``"bf16-pure"``
            (also with fp8) the module is cast to bf16 before the optimizers
            are created, and ``configure_optimizers`` must return
            :class:`adaptive_amp.optim.AdamW` or ``SGD`` with
            ``stochastic_rounding=True``; a tuning that chooses such a recipe
            converts the optimizer in place, state included.
        **controller_kwargs: passed to AdaptiveMixedPrecision (``sample_inputs``,
            ``overrides``, ``read_every``, ``adapt``, ``scaler_kwargs``, ...).

    The controller is built when the Trainer connects the plugin to the model
    and its optimizer (one optimizer; the controller steps it), and kept after
    ``fit`` in :attr:`amp` for its report. Under several processes
    (DDP/FSDP) its decisions are collective
    (:class:`adaptive_amp.distributed.CollectiveAdaptiveMixedPrecision`).
    Gradient clipping by norm (``gradient_clip_val``) is done by the
    controller's step (from the scaler's unscale pass, folded into fused
    optimizers); by value, after unscaling. ``on_before_optimizer_step`` sees
    the gradients as the controller has them before its step: still scaled
    (the controller's gradient statistics are of the scaled gradients).
    ``LightningModule.backward`` overrides are bypassed: the controller runs
    the backward (to scale the loss and record it).
    """

    _how_to_connect = "the Trainer builds it when fit() sets up the model and its optimizer"

    def __init__(self, policy: Union[str, PrecisionPolicy] = "auto", **controller_kwargs: Any) -> None:
        self._init_host(policy, controller_kwargs)
        self._eval_adjuster = None
        self._warned_backward = False

    def connect(self, model: nn.Module, optimizers: List[torch.optim.Optimizer], lr_schedulers: List[Any]):
        module = _lightning_module(model)
        if not optimizers:  # validate / test / predict: the policy's autocast, no controller
            self._eval_adjuster = self._make_eval_adjuster(module)
            return model, optimizers, lr_schedulers
        if len(optimizers) != 1:
            raise ValueError(f"AdaptivePrecision drives one optimizer; configure_optimizers returned "
                             f"{len(optimizers)}. Combine the parameter groups into one optimizer")
        if self._eval_adjuster is not None:
            self._eval_adjuster.remove()
            self._eval_adjuster = None
        self._build(module, list(optimizers))
        return model, optimizers, lr_schedulers

    def _make_eval_adjuster(self, module: nn.Module):
        from ..adjust import DynamicPrecisionAdjuster
        from ..hardware import HardwareDetector
        from ..policy import AdaptivePrecisionSelector

        if self.amp is not None:
            return None  # after fit: the controller's policy, as it ended
        policy = _known_policy(self.policy)  # (a "+fp8" preset: its base; its layers are measured by fit)
        if policy is None:
            device = next(module.parameters(), torch.empty(0)).device
            policy = AdaptivePrecisionSelector().select(module, HardwareDetector().detect(device), None,
                                                        self.controller_kwargs.get("overrides"))
        return DynamicPrecisionAdjuster(module, policy)

    def _autocast(self):
        if self.amp is not None:
            return self.amp.adjuster.autocast()
        if self._eval_adjuster is not None:
            return self._eval_adjuster.autocast()
        return contextlib.nullcontext()

    def forward_context(self):
        return self._autocast()

    @contextlib.contextmanager
    def train_step_context(self):
        # The controller's autocast also collects layer statistics on its statistics steps.
        with (self.amp.autocast() if self.amp is not None else self._autocast()):
            yield

    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("AdaptivePrecision: positional backward arguments are not supported; pass them "
                            "by keyword (gradient=..., retain_graph=...)")
        if not self._warned_backward and _overrides_backward(model):
            warnings.warn(f"{type(model).__name__}.backward is overridden, but AdaptivePrecision runs the "
                          "backward itself (it scales the loss and records it); the override is not called",
                          stacklevel=2)
            self._warned_backward = True
        self._require_amp("backward").backward(tensor, **kwargs)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("AdaptivePrecision: LBFGS re-evaluates its closure inside step(), which loss "
                            "scaling cannot follow; use another optimizer")
        closure_result = closure()
        self._after_closure(model, optimizer)  # Lightning's hooks, then clip_gradients below
        if closure_result is None and model.automatic_optimization:
            self._clip_norm = None
            return closure_result  # training_step returned None: no backward ran, nothing to step
        return self._step(**kwargs)

    def clip_gradients(self, optimizer, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self._clip_norm = (float(clip_val), 2.0)
        else:
            self._unscale(optimizer)
            torch.nn.utils.clip_grad_value_(list(self.main_params(optimizer)), clip_value=clip_val)


class AdaptiveFabricPrecision(_ControllerHost, *FABRIC_PRECISION_BASES):
    """The Fabric twin of :class:`AdaptivePrecision`.

    Fabric never shows a precision plugin the optimizers, so connect them
    once after ``fabric.setup``::

        precision = AdaptiveFabricPrecision("auto")
        fabric = Fabric(plugins=[precision])
        model, optimizer = fabric.setup(model, optimizer)
        precision.connect(model, optimizer)
        ...
        fabric.backward(loss)          # scales and records the loss
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # optional
        optimizer.step()               # the controller's step: skip, update, monitor, adapt
        optimizer.zero_grad()

    Put the plugin in what ``fabric.save`` saves (``{"amp": precision, ...}``)
    to keep the controller's state in checkpoints.
    """

    _how_to_connect = "call precision.connect(model, optimizer) after fabric.setup(model, optimizer)"

    def __init__(self, policy: Union[str, PrecisionPolicy] = "auto", **controller_kwargs: Any) -> None:
        self._init_host(policy, controller_kwargs)
        self._module: Optional[nn.Module] = None

    def connect(self, module: nn.Module, *optimizers) -> AdaptiveMixedPrecision:
        """Build the controller on the module and optimizers that ``fabric.setup`` returned (or the raw ones)."""
        if len(optimizers) == 1 and isinstance(optimizers[0], (list, tuple)):
            optimizers = tuple(optimizers[0])
        if len(optimizers) != 1:
            raise ValueError(f"AdaptiveFabricPrecision.connect: pass one optimizer (the controller steps it at "
                             f"each optimizer.step()), got {len(optimizers)}; combine the parameter groups into one")
        raw = [getattr(o, "optimizer", o) for o in optimizers]  # _FabricOptimizer -> the optimizer
        inner = getattr(module, "module", module)  # _FabricModule -> the strategy's module (DDP or not)
        inner = getattr(inner, "module", inner) if isinstance(inner, torch.nn.parallel.DistributedDataParallel) \
            else inner
        self._module = inner
        return self._build(inner, raw)

    def forward_context(self):
        amp = self._require_amp("forward_context")
        # Training forwards collect the controller's layer statistics on its statistics steps.
        return amp.autocast() if self._module.training else amp.adjuster.autocast()

    def backward(self, tensor: torch.Tensor, model, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("AdaptiveFabricPrecision: pass backward arguments by keyword")
        self._require_amp("backward").backward(tensor, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        return self._step(**kwargs)

    def unscale_gradients(self, optimizer) -> None:
        self._unscale(optimizer)
