"""Training recipes beyond a PrecisionPolicy, and the reversible conversions that apply them.

A :class:`Recipe` is what a trial of :mod:`adaptive_amp.tune` runs and what
the memory guard (:mod:`adaptive_amp.pressure`) moves between: a precision
policy (compute and parameter dtypes, TF32, fp32 islands, loss scaling) plus
the optimizer's moment dtype and activation checkpointing of the model's
blocks. A policy's per-layer map (``policy.layers``) carries its fp8 layers
(the ``+fp8`` recipes): the adjuster applies them as it applies islands.

The conversions change a live model and optimizer and can be undone:

* :func:`convert_optimizer`: the user's optimizer (``torch.optim.AdamW``,
  ``Adam`` without weight decay, ``SGD``, or ours) becomes an
  :class:`adaptive_amp.optim.AdamW`/``SGD`` with stochastic rounding and the
  asked moment dtype. It shares the user's ``param_groups`` dicts (so an LR
  scheduler built on the user's optimizer still drives it) and takes over its
  state; undoing gives the state back (fp32 moments bitwise, bf16 moments
  upcast) and removes the keys it added to the groups.
  :func:`convert_optimizer_in_place` makes the user's optimizer object itself
  that conversion (a tuned recipe, a memory-guard move), so that what the
  user and a framework hold steps and checkpoints the state that trains.
* :func:`cast_parameters`: parameters and floating buffers to bf16 in place
  (the Parameter objects, which the optimizers hold, stay the same) and back,
  tables such as rotary frequencies left float32 (:func:`derived_buffers`);
  :func:`cast_floats_hook` casts a pure recipe's floating inputs;
  :func:`cast_matmul_weights` casts only the matmul layers' weights, and
  :func:`float32_embeddings` keeps the residual stream fp32 (bf16-weights).
  :func:`cast_for_policy` and :func:`policy_hooks` pick these for a policy.
* :func:`checkpoint_blocks`: the model's repeated blocks (the longest
  ``nn.ModuleList`` of modules of one class) recompute their activations in
  the backward pass (``torch.utils.checkpoint``, non-reentrant).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .adjust import DynamicPrecisionAdjuster, forget_compiled_graphs
from .layer_precision import apply_kind, base_class
from .layers import expand_names, is_sharded, unwrap_model
from .scaler import GradScaler

_MISSING = object()
#: Group keys our optimizers add to a torch optimizer's param_groups (removed again on undo).
_ADDED_KEYS = ("stochastic_rounding", "moment_dtype")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Recipe:
    """A way to train: a PrecisionPolicy plus the optimizer's moments and checkpointing.

    policy: the adaptive_amp.policy.PrecisionPolicy (dtypes, TF32, islands and the per-layer map with its fp8
        layers, loss scaling); the policy module builds recipes (AdaptivePrecisionSelector.candidates), this
        one only applies them.
    moment_dtype: None keeps the user's optimizer as it is; a dtype converts it to
        adaptive_amp.optim (stochastic rounding) with moments in that dtype.
        Recipes with bf16 parameters need it.
    checkpoint: recompute the blocks' activations in the backward pass.
    safety: lower is numerically safer (the reference is the safest that fits).
    """

    name: str
    policy: Any
    moment_dtype: Optional[torch.dtype] = None
    checkpoint: bool = False
    safety: int = 0

    def __post_init__(self):
        if self.param_dtype == torch.bfloat16 and self.moment_dtype is None:
            raise ValueError(f"recipe {self.name!r}: bf16 parameters need an optimizer that rounds stochastically; "
                             "set moment_dtype (torch.float32 or torch.bfloat16)")
        if self.param_dtype == torch.bfloat16 and self.policy.islands and self.policy.param_scope != "matmul":
            raise ValueError(f"recipe {self.name!r}: bf16 parameters throughout (bf16-pure) cannot have fp32 "
                             "islands; bf16-weights (param_scope='matmul') can: its islands keep fp32 weights")

    @property
    def param_dtype(self) -> torch.dtype:
        return self.policy.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

    @property
    def islands(self) -> tuple:
        return tuple(self.policy.islands)

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """The policy's string form plus the extras: ``params=...,compute=...;moments=bfloat16;checkpoint``."""
        extras = []
        if self.moment_dtype is not None:
            extras.append(f"optimizer=adaptive_amp.optim(SR),moments={dtype_name(self.moment_dtype)}")
        if self.checkpoint:
            extras.append("checkpoint=blocks")
        return ";".join([str(self.policy)] + extras)

    def to_dict(self) -> dict:
        return {"name": self.name, "policy": str(self.policy),
                "moment_dtype": None if self.moment_dtype is None else dtype_name(self.moment_dtype),
                "checkpoint": self.checkpoint}


# ---------------------------------------------------------------------------- optimizer


def convertible(optimizer) -> Optional[str]:
    """None if :func:`convert_optimizer` can take `optimizer`, else why not (for a recipe's skip reason)."""
    from . import optim

    if isinstance(optimizer, (optim.AdamW, optim.SGD)):
        return None
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        return (f"{type(optimizer).__module__}.{type(optimizer).__name__} has no stochastic-rounding twin "
                "(adaptive_amp.optim has AdamW and SGD)")
    for i, g in enumerate(optimizer.param_groups):
        if g.get("amsgrad"):
            return f"param_groups[{i}] uses amsgrad, which adaptive_amp.optim.AdamW does not implement"
        if g.get("differentiable"):
            return f"param_groups[{i}] is differentiable, which a fused step cannot be"
        if isinstance(g.get("lr"), torch.Tensor):
            return f"param_groups[{i}] has a Tensor lr, which adaptive_amp.optim refuses"
        if type(optimizer) is torch.optim.Adam and g.get("weight_decay", 0) and not g.get("decoupled_weight_decay"):
            return (f"param_groups[{i}]: torch.optim.Adam's weight decay is an L2 term, not AdamW's decoupled "
                    "decay, so adaptive_amp.optim.AdamW would train differently")
    return None


class ConvertedOptimizer:
    """The result of :func:`convert_optimizer`: ``.optimizer`` to step, ``.undo()`` to give the state back."""

    def __init__(self, original, optimizer, saved_groups, step_places):
        self.original = original
        self.optimizer = optimizer
        self._saved_groups = saved_groups  # per group: {key: value or _MISSING} for the keys we set
        self._step_places = step_places  # param -> (device, dtype) of the original's "step" entries

    def undo(self) -> None:
        """The original optimizer gets the state back: moments in their params' dtype (fp32 moments of fp32
        params bitwise), ``step`` where its class keeps it. The conversion's group keys are removed."""
        from . import optim

        orig, ours = self.original, self.optimizer
        if orig is ours:
            return
        for group, saved in zip(orig.param_groups, self._saved_groups):
            for key, value in saved.items():
                if value is _MISSING:
                    group.pop(key, None)
                else:
                    group[key] = value
        keep_ours = isinstance(orig, (optim.AdamW, optim.SGD))
        # Moments go back to what the original keeps: its moment_dtype (ours) or the param's dtype (torch's).
        moment_dtype = {p: (g["moment_dtype"] if keep_ours else p.dtype) for g in orig.param_groups for p in g["params"]}
        for p, st in list(ours.state.items()):
            out = {}
            for key, value in st.items():
                if key == "step" and p in self._step_places:
                    device, dtype = self._step_places[p]
                    value = value.detach().to(device=device, dtype=dtype, copy=True)
                elif isinstance(value, torch.Tensor) and key != "step":
                    value = value.to(moment_dtype.get(p, value.dtype))
                out[key] = value
            orig.state[p] = out
        ours.state.clear()
        if hasattr(orig, "_plans"):
            orig._plans = {}


def convert_optimizer(optimizer, moment_dtype: torch.dtype) -> ConvertedOptimizer:
    """`optimizer` as an adaptive_amp.optim optimizer with stochastic rounding and moments in `moment_dtype`.

    The new optimizer shares the original's ``param_groups`` list (an LR scheduler of the original still sets
    its learning rates) and takes the original's state (moments cast to `moment_dtype`, ``step`` as a float32
    tensor on the param's device); the original's state is emptied so its memory can be freed.
    """
    from . import optim

    why = convertible(optimizer)
    if why is not None:
        raise TypeError(f"optimizer: {why}")
    if moment_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"moment_dtype is {moment_dtype}; expected torch.float32 or torch.bfloat16")
    ours_cls = optim.SGD if isinstance(optimizer, (torch.optim.SGD, optim.SGD)) else optim.AdamW
    # Built on a throw-away group so that construction checks the options, then handed the user's groups.
    first = optimizer.param_groups[0]
    if ours_cls is optim.AdamW:
        ours = optim.AdamW([torch.zeros(1)], lr=float(first["lr"]), moment_dtype=moment_dtype,
                           generator=getattr(optimizer, "generator", None))
    else:
        ours = optim.SGD([torch.zeros(1)], lr=float(first["lr"]), moment_dtype=moment_dtype,
                         generator=getattr(optimizer, "generator", None))
    saved_groups = []
    for group in optimizer.param_groups:
        saved_groups.append({k: group.get(k, _MISSING) for k in _ADDED_KEYS})
        group["stochastic_rounding"] = True
        group["moment_dtype"] = moment_dtype
        for key, value in ours.defaults.items():
            group.setdefault(key, value)
    ours.param_groups = optimizer.param_groups
    # The user's defaults, from which a group added later (add_param_group) takes what it does not give.
    ours.defaults.update({k: v for k, v in optimizer.defaults.items()
                          if k in ours.defaults and k not in ("stochastic_rounding", "moment_dtype")})
    ours.state.clear()
    step_places = {}
    moment_keys = ours_cls._moment_keys
    for p, st in list(optimizer.state.items()):
        new = {}
        for key, value in st.items():
            if key == "step" and isinstance(value, torch.Tensor):
                step_places[p] = (value.device, value.dtype)
                value = value.detach().to(device=p.device, dtype=torch.float32, copy=value.device != p.device)
                value = value.reshape(())
            elif key in moment_keys and isinstance(value, torch.Tensor):
                # In the param's memory layout, which the fused step pairs elements by (a channels_last
                # conv weight: the zoo's ResNet failed its bf16-moments move with contiguous moments).
                value = torch.empty_like(p, dtype=moment_dtype).copy_(value)
            new[key] = value
        ours.state[p] = new
    if optimizer is not ours:
        optimizer.state.clear()
    ours._plans = {}
    return ConvertedOptimizer(optimizer, ours, saved_groups, step_places)


#: What an optimizer keeps of its own through an in-place conversion: hooks its user registered, the LR
#: scheduler's "stepped" mark.
_KEPT = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
         "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
         "_optimizer_load_state_dict_post_hooks", "_opt_called", "track_grad_norm")


def convert_optimizer_in_place(optimizer, moment_dtype: torch.dtype) -> Callable[[], None]:
    """Make `optimizer` itself adaptive_amp.optim's (:func:`convert_optimizer`'s conversion, then its class and
    attributes swapped in), so that the object its user holds (in a checkpoint call, an LR scheduler, a
    framework's wrapper) stays the live one, and its ``state_dict()`` holds the state that trains. Returns the
    undo: the original class, attributes and state again."""
    converted = convert_optimizer(optimizer, moment_dtype)
    ours = converted.optimizer
    old_class, old_dict = type(optimizer), dict(optimizer.__dict__)
    new_dict = dict(ours.__dict__)
    for key in _KEPT:
        if key in old_dict:
            new_dict[key] = old_dict[key]
    if "step" in old_dict:
        # An LR scheduler wrapped the bound step of the old class (torch's patch_track_step_called): wrap ours.
        new_dict["step"] = _scheduler_step(optimizer)
    optimizer.__class__ = type(ours)
    optimizer.__dict__.clear()
    optimizer.__dict__.update(new_dict)
    ours.state = optimizer.state  # (the conversion's own object is a husk from now on)

    def undo():
        live = dict(optimizer.__dict__)
        ours.state = live["state"]  # what the optimizer holds now (also after a load_state_dict meanwhile)
        ours.param_groups = live["param_groups"]
        restored = dict(old_dict)
        restored["param_groups"] = live["param_groups"]
        for key in _KEPT:
            if key in live and key != "track_grad_norm":
                restored[key] = live[key]
        if "step" in live:  # (also an LR scheduler created since)
            restored["step"] = _scheduler_step(optimizer)
        optimizer.__class__ = old_class
        optimizer.__dict__.clear()
        optimizer.__dict__.update(restored)
        converted.undo()
    return undo


def _scheduler_step(optimizer):
    ref = weakref.ref(optimizer)

    def step(*args, **kwargs):
        opt = ref()
        opt._opt_called = True
        return type(opt).step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    return step


# ---------------------------------------------------------------------------- parameters


def _cast_floats(value, dtype: torch.dtype):
    """`value` with its floating-point tensors (also in tuples, lists and dicts) in `dtype`: the same object
    when nothing needed a cast."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        items = [_cast_floats(v, dtype) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        items = [(k, _cast_floats(v, dtype)) for k, v in value.items()]
        if all(cast is value[k] for k, cast in items):
            return value
        return type(value)(items)
    return value


class CastFloats:
    """A forward pre-hook (``with_kwargs=True``) that casts a module's floating-point inputs to `dtype`. An object
    of a module-level class rather than a closure, so that a model carrying it pickles (``torch.save(model)``)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        cast_args, cast_kwargs = _cast_floats(args, self.dtype), _cast_floats(kwargs, self.dtype)
        if cast_args is args and cast_kwargs is kwargs:
            return None  # (token ids, say: the call goes on as it was, without torch rebuilding its arguments)
        return cast_args, cast_kwargs

    def __getstate__(self):
        return self.dtype

    def __setstate__(self, dtype):
        self.dtype = dtype


def cast_floats_hook(dtype: torch.dtype) -> CastFloats:
    """A forward pre-hook (``with_kwargs=True``) that casts a module's floating-point inputs to `dtype`: what
    a plain loop in `dtype` does, for a pure policy (bf16 weights, no autocast) fed fp32 inputs."""
    return CastFloats(dtype)


def _cast_in_place(tensors, dtype: torch.dtype) -> List[Tuple[torch.Tensor, torch.dtype]]:
    """Each floating tensor of `tensors` (and its gradient) to `dtype` in place, each once (tied weights);
    returns (tensor, dtype before) of those it cast."""
    before, seen = [], set()
    with torch.no_grad():
        for t in tensors:
            if t is None or id(t) in seen or not t.is_floating_point() or t.dtype == dtype:
                continue
            seen.add(id(t))
            before.append((t, t.dtype))
            t.data = t.data.to(dtype)
            if t.grad is not None:
                t.grad = t.grad.to(dtype)
    if before:
        forget_compiled_graphs()
    return before


def _uncast(before) -> None:
    """Undo :func:`_cast_in_place`: values upcast exactly from what training left."""
    with torch.no_grad():
        for t, old in before:
            t.data = t.data.to(old)
            if t.grad is not None:
                t.grad = t.grad.to(old)
    if before:
        forget_compiled_graphs()


def derived_buffers(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The floating buffers a module registered non-persistent: tables it computes from its configuration
    (rotary inverse frequencies ``inv_freq``, sine/cosine caches), not state it trains or saves (BatchNorm's
    running statistics are persistent). :func:`cast_parameters` keeps them float32, as autocast does: a
    rotary angle is position x frequency, and a frequency rounded to bf16 (relative error up to 2**-9) turns
    the angles of late positions by radians (2047 x 0.75 x 2**-9 = 3 rad), so queries and keys are rotated
    by the wrong amounts and their gradients point elsewhere."""
    root = unwrap_model(model)
    return [(f"{name}.{b}" if name else b, t) for name, m in root.named_modules()
            for b, t in m._buffers.items()
            if t is not None and t.is_floating_point() and b in m._non_persistent_buffers_set]


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> Callable[[], None]:
    """Floating-point parameters (and their gradients) and buffers of `model` to `dtype`, in place, as
    ``model.to(dtype)`` does (the controller's bf16-pure casts that way, and a trial must run the same model:
    BatchNorm's running statistics must match its weights' dtype), except the :func:`derived_buffers`, which
    stay as they are (Llama's rotary frequencies: float32). Returns the undo (back to each tensor's dtype
    before, values upcast exactly from what training left)."""
    root = unwrap_model(model)
    derived = {id(t) for _, t in derived_buffers(root)}
    before = _cast_in_place([*root.parameters(), *(b for b in root.buffers() if id(b) not in derived)], dtype)
    return lambda: _uncast(before)


def matmul_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The modules whose own ``weight`` is a matrix (or a convolution's kernel): ``nn.Linear``, transformers'
    ``Conv1D``, convolutions, embeddings. Their weights are what autocast casts to bf16 at every step; norms
    (vector weights), loose parameters (ViT's class token and position embeddings) and buffers are not."""
    root = unwrap_model(model)
    return [(name, m) for name, m in root.named_modules()
            if isinstance(m._parameters.get("weight"), torch.Tensor) and m._parameters["weight"].dim() >= 2]


def _float32_output(module, args, output):
    return output.float() if isinstance(output, torch.Tensor) and output.dtype != torch.float32 else output


def cast_matmul_weights(model: nn.Module, dtype: torch.dtype, keep: Sequence[str] = ()) -> Callable[[], None]:
    """The parameters of :func:`matmul_layers` to `dtype` in place (as :func:`cast_parameters`), everything else
    left in float32. `keep`: names of modules (fp32 islands) whose parameters stay float32, and with them every
    parameter they share (a tied embedding and output layer: the island's fp32 weight is the embedding's too).
    Runs under autocast, with :func:`float32_embeddings`, so that the residual stream, the norms and what
    autocast keeps in fp32 see what torch's autocast gives them (the "bf16-weights" recipe, policy
    param_scope="matmul").

    Why not all of it (bf16-pure, which computes the residual stream and the norms in bf16 too): on one H200,
    2000 steps of a compiled 1.1B Llama ended 1.1% above torch's bf16 autocast with bf16-pure (7.431 against
    7.349) and 1.5% below it with this (7.245 against 7.357), at 1.65x torch's speed (bench/RESULTS.md).
    Returns the undo."""
    root = unwrap_model(model)
    kept = {id(p) for name in keep for p in root.get_submodule(name).parameters()}
    before = _cast_in_place([t for _, m in matmul_layers(model) for t in m._parameters.values()
                             if id(t) not in kept], dtype)
    return lambda: _uncast(before)


class HookHandles:
    """Several hooks' handles removed as one (``.remove()``, as a torch hook handle)."""

    def __init__(self, handles):
        self.handles = list(handles)

    def remove(self) -> None:
        while self.handles:
            self.handles.pop().remove()


def float32_embeddings(model: nn.Module) -> HookHandles:
    """Forward hooks that make the model's embeddings return float32 whatever their weights' dtype: with bf16
    embedding weights (:func:`cast_matmul_weights`), the residual stream that starts there stays float32, as
    under torch's autocast (which leaves embeddings alone)."""
    root = unwrap_model(model)
    return HookHandles(m.register_forward_hook(_float32_output) for m in root.modules()
                       if isinstance(m, (nn.Embedding, nn.EmbeddingBag)))


def cast_refusal(model: nn.Module, policy) -> Optional[str]:
    """Why :func:`cast_for_policy` cannot cast `model` for `policy` (None: it can).

    FSDP2 (``fully_shard``) fixes each parameter's dtype when it shards it, and all-gathers a unit's parameters
    in one dtype: its parameters (DTensors) cannot be cast afterwards, nor split into bf16 matmul weights and
    float32 norms. DistributedDataParallel sets up its gradient all-reduce for the dtypes the parameters have
    when it wraps the model: after a cast its hooks no longer average the gradients, and each rank would train
    its replica on its own gradients, silently (measured: two gloo ranks' bf16 gradients differed after one
    backward). A model cast before either wraps it casts nothing here, and is not refused."""
    if policy.param_dtype == torch.float32:
        return None
    root = unwrap_model(model)
    sharded = [(n, p) for n, p in root.named_parameters() if is_sharded(p)]
    if sharded:
        if policy.param_scope == "matmul":
            return (f"{sharded[0][0]} is sharded by FSDP2 (a DTensor), and bf16 matmul weights beside float32 "
                    "norms (bf16-weights) would be two dtypes in one sharded unit, which FSDP2 refuses; under FSDP2 "
                    "keep a float32 policy and give fully_shard mp_policy=MixedPrecisionPolicy("
                    "param_dtype=torch.bfloat16), or train bf16-pure")
        wrong = [(n, p) for n, p in sharded if p.is_floating_point() and p.dtype != policy.param_dtype]
        if wrong:
            return (f"{wrong[0][0]} is sharded by FSDP2 (a DTensor) in {wrong[0][1].dtype}, and FSDP2 fixes a "
                    f"parameter's dtype when fully_shard runs: cast the model before sharding it "
                    f"(model.to({policy.param_dtype}), then fully_shard)")
        return None
    if policy.param_scope == "matmul":
        islands, _ = expand_names(policy.islands, model)
        kept = {id(p) for name in islands for p in root.get_submodule(name).parameters()}
        names = {id(p): n for n, p in root.named_parameters()}
        cast = [(names.get(id(p), layer), p) for layer, m in matmul_layers(model) for p in m._parameters.values()
                if p is not None and id(p) not in kept]
    else:
        cast = list(root.named_parameters())
    wrong = [(n, p) for n, p in cast if p.is_floating_point() and p.dtype != policy.param_dtype]
    held = _replicated(root, [p for _, p in wrong]) if wrong else set()
    first = next(((n, p) for n, p in wrong if id(p) in held), None)
    if first is None:
        return None
    if policy.param_scope == "matmul":
        keep = [n[len("module."):] if n.startswith("module.") else n for n in islands]
        how = ("cast the matmul layers' weights first (adaptive_amp.recipes.cast_matmul_weights(model, "
               f"torch.bfloat16{f', keep={keep}' if keep else ''})), then wrap it")
    else:
        how = f"cast it first (model.to({policy.param_dtype})), then wrap it"
    return (f"{first[0]} is in {first[1].dtype} in a model DistributedDataParallel wraps, and DDP averages "
            "gradients in the dtypes the parameters had when it wrapped the model: cast afterwards, each rank would "
            f"silently train its replica on its own gradients. {how[0].upper() + how[1:]} in "
            "DistributedDataParallel; or keep a float32 policy")


def _replicated(root: nn.Module, params: Sequence[torch.Tensor]) -> set:
    """The ids of those of `params` a DistributedDataParallel wrapper holds: one inside `root`, or one around it
    (the framework integrations, and a user who hands the controller ``ddp.module``, give it the module DDP
    wraps; DDP marks neither the module nor its parameters, so the wrappers alive are looked for)."""
    ids = {id(p) for p in params}
    ddp = nn.parallel.DistributedDataParallel
    wrappers = [m for m in root.modules() if isinstance(m, ddp)]
    if not wrappers and torch.distributed.is_available() and torch.distributed.is_initialized():
        # (type(): isinstance of a dead weak proxy among the objects raises)
        wrappers = [o for o in gc.get_objects() if issubclass(type(o), ddp)]
    return {id(p) for w in wrappers for p in w.parameters() if id(p) in ids}


def cast_for_policy(model: nn.Module, policy) -> Callable[[], None]:
    """The cast a policy with bf16 parameters makes (returns its undo): param_scope "all" (bf16-pure) every
    parameter and buffer (:func:`cast_parameters`), "matmul" (bf16-weights) the matmul layers' weights but the
    islands' (:func:`cast_matmul_weights`). The controller, the trials and a recipe run alone all cast with this.
    A model FSDP2 has sharded, or DDP wraps, is refused with :func:`cast_refusal`'s reason, before anything
    changes."""
    if policy.param_dtype == torch.float32:
        return lambda: None
    why = cast_refusal(model, policy)
    if why:
        raise ValueError(f"policy {policy}: {why}")
    if policy.param_scope == "matmul":
        islands, unknown = expand_names(policy.islands, model)
        if unknown:
            raise ValueError(f"policy.islands names modules the model does not have: {unknown}")
        return cast_matmul_weights(model, policy.param_dtype, keep=islands)
    return cast_parameters(model, policy.param_dtype)


def policy_hooks(model: nn.Module, policy):
    """The hooks such a policy's model needs (a handle with ``.remove()``, or None): bf16-pure, without
    autocast, casts fp32 inputs as a plain bf16 loop would; bf16-weights makes embeddings return fp32."""
    if policy.param_dtype == torch.float32:
        return None
    if policy.param_scope == "matmul":
        return float32_embeddings(model)
    return model.register_forward_pre_hook(cast_floats_hook(policy.param_dtype), with_kwargs=True)


# ---------------------------------------------------------------------------- checkpointing


def find_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The model's repeated blocks: the children of the ``nn.ModuleList`` (of 2 or more modules of one class)
    with the most parameters, e.g. GPT-2's ``transformer.h``. Empty if there is none."""
    best, best_size = [], 0
    for name, module in unwrap_model(model).named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({base_class(m) for m in module}) != 1:  # (one of them an island is still a block)
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best = [(f"{name}.{i}" if name else str(i), m) for i, m in enumerate(module)]
            best_size = size
    return best


def checkpoint_blocks(model: nn.Module) -> Callable[[], None]:
    """Run each block's forward in non-reentrant ``torch.utils.checkpoint``; returns the undo.

    Applied as the ``"checkpoint"`` kind of :mod:`adaptive_amp.layer_precision`, which islands use too: a block
    can be checkpointed and an island, the two changed in any order, and undoing one leaves the other (an
    island promoted on a checkpointed block stays fp32 when the checkpointing is undone)."""
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError("checkpoint: the model has no repeated blocks (an nn.ModuleList of 2 or more modules "
                         "of one class) to checkpoint")
    named = [name for name, block in blocks if "forward" in block.__dict__]
    if named:
        raise ValueError(f"checkpoint: blocks {named} have a forward set on the instance (another library's "
                         "hooks, say), which would bypass the checkpointing; remove it first")
    handles = HookHandles(())
    try:
        for _, block in blocks:
            handles.handles.append(apply_kind(block, "checkpoint"))
    except BaseException:
        handles.remove()
        raise
    return handles.remove


# ---------------------------------------------------------------------------- float8


def float8_available() -> Optional[str]:
    """None if torchao's float8 training (``convert_to_float8_training``, what the scale benchmark compares
    with) can be used here, else why not. fp8 layers of a policy are checked by adaptive_amp.fp8."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao), so float8 training is not tried"
    if not torch.cuda.is_available():
        return "float8 training needs a CUDA GPU"
    if torch.cuda.get_device_capability() < (8, 9):
        return "float8 matmuls need sm_89 or newer"
    return None


# ---------------------------------------------------------------------------- applying a recipe


class AppliedRecipe:
    """A recipe applied to a model and an optimizer: what a training step needs, and :meth:`undo`.

    ``optimizer`` is the one to step (the user's, or its stochastic-rounding conversion: with `in_place`, the
    user's object itself, converted by :func:`convert_optimizer_in_place`, so that what the user and any
    framework hold steps and checkpoints the state that trains), ``scaler`` a GradScaler (disabled without
    loss scaling), ``autocast()`` the policy's autocast with islands."""

    def __init__(self, recipe: Recipe, model: nn.Module, optimizer, precision: bool = True, in_place: bool = False):
        # precision=False: only the optimizer, parameter dtype and checkpointing (a controller applies the
        # policy's autocast, islands and fp8 layers, scaler and TF32 itself).
        self.recipe = recipe
        self.model = model
        self._undo: List[Callable[[], None]] = []
        self.checkpoint_undo: Optional[Callable[[], None]] = None  # (the controller owns it: precision=False)
        try:
            self.optimizer = optimizer
            if recipe.moment_dtype is not None and in_place:
                self._undo.append(convert_optimizer_in_place(optimizer, recipe.moment_dtype))
            elif recipe.moment_dtype is not None:
                converted = convert_optimizer(optimizer, recipe.moment_dtype)
                self._undo.append(converted.undo)
                self.optimizer = converted.optimizer
            if recipe.param_dtype != torch.float32:
                # The controller's cast and hooks (it adds the hooks itself: precision=False), so that a trial
                # runs what the controller runs.
                self._undo.append(cast_for_policy(model, recipe.policy))
                hooks = policy_hooks(model, recipe.policy) if precision else None
                if hooks is not None:
                    self._undo.append(hooks.remove)
            if recipe.checkpoint:
                self.checkpoint_undo = checkpoint_blocks(model)
                self._undo.append(self.checkpoint_undo)
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            self.device = device
            self._tf32_before = None
            self.adjuster = self.scaler = None
            if not precision:
                return
            self.adjuster = DynamicPrecisionAdjuster(model, recipe.policy)
            self._undo.append(self.adjuster.remove)
            loss_scale = recipe.policy.loss_scale
            self.scaler = (GradScaler(device.type, **loss_scale.grad_scaler_kwargs())
                           if loss_scale is not None else GradScaler(device.type, enabled=False))
            if device.type == "cuda":
                self._tf32_before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(recipe.policy.tf32)
        except BaseException:
            self.undo()
            raise

    def autocast(self):
        return self.adjuster.autocast()

    def train_step(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One plain step of the recipe (what its trial times, without a controller): ``closure() -> loss``
        under its autocast, backward through its scaler, the optimizer's step, gradients set to None.
        Returns the detached loss."""
        if self.scaler is None:
            raise RuntimeError("train_step needs the recipe's autocast and scaler: apply it with precision=True")
        with self.autocast():
            loss = closure()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def undo(self) -> None:
        """Everything applied, undone in reverse order (parameters back to their dtype, state to the
        user's optimizer, checkpointing and islands off, TF32 as it was)."""
        while self._undo:
            self._undo.pop()()
        before = getattr(self, "_tf32_before", None)
        if before is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
            self._tf32_before = None


@contextlib.contextmanager
def applied(recipe: Recipe, model: nn.Module, optimizer):
    """``with applied(recipe, model, opt) as a:`` ... undone on exit, also on error."""
    a = AppliedRecipe(recipe, model, optimizer)
    try:
        yield a
    finally:
        a.undo()
