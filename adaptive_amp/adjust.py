"""DynamicPrecisionAdjuster: apply a precision policy to a model and change it between steps.

A policy (duck-typed: ``.compute_dtype`` and ``.islands``) says which dtype
autocast computes in and which modules ("islands") must stay in fp32. An
island is a module's ``named_modules()`` name, or a glob pattern (``*``,
``?``, ``[``) that stands for every layer whose name matches it
(``transformer.h.*.mlp.c_proj``; layers as :mod:`adaptive_amp.layers` finds
them). A compiled model is adjusted through the module it compiled, with the
eager model's names (``lm_head``, not ``_orig_mod.lm_head``). The adjuster gives the autocast
context for the policy and makes each island run with autocast off on fp32
inputs. It never touches parameters or the optimizer, so a policy can change
between any two steps, and ``remove()`` leaves the model as it was.

The policy's per-layer map (``policy.layers``: a layer in ``"bf16"``, its
autocast in bf16, or in an fp8 kind of :mod:`adaptive_amp.fp8`, its matmuls
through torchao's float8 training) is applied the same way, each layer's kind
through its own handle; an island wins over another kind on the same layer.
fp8 is checked before anything changes (torchao, a GPU with fp8 matmuls, the
layer's sizes: :func:`adaptive_amp.fp8.require_fp8`), so a refused policy
leaves the model as it was.

Islands are applied with :mod:`adaptive_amp.layer_precision` (kind ``"fp32"``):
the module's class is swapped for a cached subclass whose ``forward`` runs
the layer's own inside ``torch.autocast(enabled=False)`` on fp32 inputs, and
the adjuster keeps the handle. Nothing is set on the module instance, so
another controller's islands, MemoryGuard's activation checkpointing and the
user's hooks compose with ours in any order; a ``copy.deepcopy`` or
``torch.save`` of the model copies the layers' own classes and weights; and
``remove()``, or the adjuster being garbage collected, puts each class back.
The autocast context is entered and left in one ``with`` block, which stays
correct when the forward raises and which torch.compile traces as one region,
also across a graph break inside the layer (a pre-hook/hook pair cannot do
that: layer_precision.py says why). The class is guarded, so a changed set of
islands retraces a compiled model once and an unchanged one never does.

A compiled model's backward is compiled with its forward, and by default
(``torch._functorch.config.backward_pass_autocast = "same_as_forward"`` in
torch 2.13) under the autocast the forward ran in: an island's backward
would then compute in fp16 and overflow where eager's does not (pytorch
issues 153044, 179804). The policy's autocast context compiles backward
passes without autocast ("off"), as eager runs them, so an island protects
the backward of a compiled model as it does an eager one's. It also turns off
AOT autograd's functionalization view replay for graph outputs that alias
others (``view_replay_for_aliased_outputs``; the autograd/as_strided replay
remains): in torch 2.13 it rebuilt such an output with a garbage shape
("shape '[94358125396928, ...]' is invalid") for GPT-2 under fp16 autocast
with inductor, where the controller's statistics hooks return a detached
alias of the logits. And it compiles without AOT autograd's on-disk cache
(``enable_autograd_cache``): in torch 2.11 and 2.13, saving the entry of a
graph compiled with the controller's hooks crashed the process (a segfault
in the cache's pickling, during the first compiled backward: GPT-2 medium
on an H200, and the CPU test suite), while with the cache off every zoo
model compiled and trained.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    from torch._functorch import config as _functorch_config
except ImportError:  # pragma: no cover - torch without AOT autograd's config
    _functorch_config = None

from .layer_precision import OwnedHandles, apply_kind, register_kind, registered_kinds
from .layers import expand_names, unwrap_model


def _bf16(forward, device_type: str):
    def bf16_forward(self, *args, **kwargs):
        # Inside an fp16 or fp32 policy, or where an fp8 layer was demoted: this layer's autocast in bf16.
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return forward(self, *args, **kwargs)
    return bf16_forward


register_kind("bf16", _bf16)


def _layer_kind_options(kind: str, device_type: str) -> dict:
    """The options apply_kind takes for a kind of the per-layer map; an fp8 kind is registered on first use
    (adaptive_amp.fp8.execution registers them when imported, without importing torchao)."""
    if kind.startswith("fp8-") and kind not in registered_kinds():
        from .fp8 import execution  # noqa: F401 - registers the fp8 kinds
    return {"device_type": device_type} if kind in ("fp32", "bf16") else {}


#: (name, value) of each AOT autograd setting the policy's compiled passes need, where this torch has it.
_COMPILE_SETTINGS = tuple((name, value) for name, value in (
    ("backward_pass_autocast", "off"),  # torch >= 2.8
    ("view_replay_for_aliased_outputs", False),
    ("enable_autograd_cache", False),
) if _functorch_config is not None and hasattr(_functorch_config, name))


class _CompileSettings:
    """The settings of :func:`compile_settings` while entered; the values before them restored on exit.

    Set and restored as plain config attributes: ``config.patch(...)`` builds a
    context class per call, 50 us a step for the three of them on a 2-core CPU, which
    every step of the controller paid (eager models too). Only settings that differ
    are written, so an entry inside another (or under the user's own patch)
    writes nothing."""

    __slots__ = ("_prior",)

    def __enter__(self):
        prior = []
        try:
            for name, value in _COMPILE_SETTINGS:
                old = getattr(_functorch_config, name)
                if old != value:
                    setattr(_functorch_config, name, value)
                    prior.append((name, old))
        except BaseException:
            self._restore(prior)
            raise
        self._prior = prior
        return self

    def __exit__(self, *exc):
        prior, self._prior = self._prior, []
        self._restore(prior)
        return False

    @staticmethod
    def _restore(prior):
        for name, old in reversed(prior):
            setattr(_functorch_config, name, old)


def compile_settings() -> _CompileSettings:
    """AOT autograd's settings for the policy's compiled passes (see the module docstring): backward passes
    compiled without autocast, aliased outputs rebuilt without view replay, no on-disk cache (decided when
    the forward compiles; a lazily compiled backward then saves the entry, where the segfault happened).
    A context: entered by the policy's autocast and, with no autocast, by bf16-pure's forward. Restored on
    exit."""
    return _CompileSettings()


def graphs_traced() -> int:
    """Graphs dynamo has traced in this process so far (a count that only grows)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def forget_compiled_graphs() -> None:
    """Drop every dynamo graph (``torch.compiler.reset()``), if any was traced in this process: once parameters
    changed dtype in place (recipes.cast_parameters), or guards changed (collect.guard_hooks_under_compile).

    ``p.data = p.data.to(bf16)`` keeps the Parameter objects and the modules' dictionaries, and dynamo may
    skip the guards of tensors reached through dictionaries that did not change: a graph traced for fp32
    parameters then runs on their bf16 memory. Measured: tuning a compiled GPT-2 on an H200 (torch 2.11)
    stopped with an illegal memory access in such a graph (its fp32 read of a bf16 weight). With no graph
    left there is none to reuse wrongly; compiled models recompile at their next call."""
    if graphs_traced():  # something was compiled in this process
        torch.compiler.reset()


class PolicyAutocast(torch.autocast):
    """torch.autocast under :func:`compile_settings`; restored on exit."""

    def __enter__(self):
        self._backward = compile_settings().__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._backward.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._backward.__exit__(None, None, None)


def _device_type(model: nn.Module) -> str:
    for t in model.parameters():
        return t.device.type
    for t in model.buffers():
        return t.device.type
    return "cpu"  # a model without tensors runs wherever its inputs are; cpu is torch's default


class DynamicPrecisionAdjuster:
    """Runs `model` under `policy`: autocast in ``policy.compute_dtype``, islands in fp32.

    Usage::

        adjuster = DynamicPrecisionAdjuster(model, policy)
        with adjuster.autocast():
            loss = loss_fn(model(x))
        ...
        adjuster.set_policy(new_policy)   # between steps
        adjuster.remove()                 # model back as it was

    Works with ``torch.compile(model)``, compiled before or after the
    adjuster wraps it: an island changes the module's class, which dynamo
    guards, so a changed policy retraces once and an unchanged one never
    does. Several adjusters (controllers) on one model each keep their own
    islands; the adjuster holds no reference the model keeps, and its islands
    come off when it is garbage collected.
    """

    def __init__(self, model: nn.Module, policy):
        self.model = unwrap_model(model)
        self.device_type = _device_type(model)
        self.policy = None
        # island name -> its layer_precision handle, in the order promoted
        self._islands = OwnedHandles(self)
        # layer name -> the handle of its other kind in the policy's per-layer map (fp8, bf16)
        self._kinds = OwnedHandles(self)
        self._kind_handles: dict = {}
        self.set_policy(policy)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

    @property
    def islands(self) -> tuple:
        return self._islands.keys()

    @property
    def layer_kinds(self) -> dict:
        """{layer name: kind} of each layer the policy's map runs in a kind other than fp32 (fp8, bf16), as
        applied (the islands are :attr:`islands`)."""
        return {name: self._kind_handles[name].kind for name in self._kinds.keys()}

    def autocast(self):
        """The autocast context of the policy (disabled when the policy computes in fp32); a compiled model
        run in it gets a backward without autocast, as an eager one has. A pure policy (parameters already in
        the compute dtype, bf16-pure) gets no autocast at all, only those compile settings: its weights need
        no casts, and autocast would still run its fp32 ops (layer norms, softmax) in fp32 (GPT-2 medium at
        8x1024 tokens, eager, H200: a bf16-pure trial step took 114.6 ms with it, 85.5 without, while bf16
        autocast's took 123 ms on both machines). One rule for the controller, the tuning's trials
        and a recipe run alone, so that a trial measures what the controller then runs. bf16-weights
        (param_scope="matmul") runs under autocast: its point is autocast's fp32 outside the matmuls."""
        dtype = self.policy.compute_dtype
        if getattr(self.policy, "pure", False):
            return compile_settings()
        return PolicyAutocast(self.device_type, dtype=dtype, enabled=dtype != torch.float32)

    def check_policy(self, policy) -> None:
        """Raises ValueError if `policy` cannot be applied to this model (nothing is changed)."""
        dtype = policy.compute_dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"policy.compute_dtype is {dtype}; expected torch.float32, float16 or bfloat16")
        modules = dict(self.model.named_modules())
        islands = self._island_names(policy)
        for name in islands:
            if name not in self._islands and "forward" in modules[name].__dict__:
                raise ValueError(f"policy.islands: {name!r} has a forward set on the instance (another library's "
                                 "hooks, say), which would bypass the island; remove it first or leave the layer out")
        kinds = self._layer_kind_names(policy, islands)
        for name, kind in kinds.items():
            handle = self._kind_handles.get(name)
            if (handle is None or handle.kind != kind) and "forward" in modules[name].__dict__:
                raise ValueError(f"policy.layers: {name!r} has a forward set on the instance (another library's "
                                 f"hooks, say), which would bypass its {kind}; remove it first or leave the layer out")
        for kind in sorted({k for k in kinds.values() if k.startswith("fp8-")}):
            names = [n for n, k in kinds.items() if k == kind]
            from .fp8.eligibility import require_fp8

            try:
                require_fp8(self.model, names, kind=kind)
            except (RuntimeError, ValueError) as exc:
                raise type(exc)(f"policy.layers: {', '.join(names)} in {kind}: {exc}") from None

    def _layer_kind_names(self, policy, islands: tuple) -> dict:
        """{layer name: kind} of the policy's map entries other than fp32, patterns expanded, a later entry
        winning over an earlier one, and an island over both."""
        resolved: dict = {}
        for entry, kind in getattr(policy, "layers", ()):
            names, unknown = expand_names((entry,), self.model)
            if unknown:
                raise ValueError(f"policy.layers: {entry!r} ({kind}) names no module of the model (a name from "
                                 "model.named_modules() without torch.compile's '_orig_mod.', or a pattern such as "
                                 "'*.mlp.*' that matches at least one layer)")
            for name in names:
                resolved.pop(name, None)
                resolved[name] = kind
        for name in islands:
            resolved.pop(name, None)
        return resolved

    def _island_names(self, policy) -> tuple:
        names, unknown = expand_names(policy.islands, self.model)
        if unknown:
            raise ValueError(f"policy.islands names modules the model does not have: {unknown} (an island is a "
                             "name from model.named_modules() without torch.compile's '_orig_mod.', or a pattern "
                             "such as '*.mlp.*' that matches at least one layer)")
        return tuple(names)

    def set_policy(self, policy) -> None:
        """Switch to `policy`: new islands and per-layer kinds (``policy.layers``: fp8, bf16) applied, dropped
        or changed ones removed. Parameters are not touched. A layer with an island runs in fp32 whatever
        else the map says of it."""
        self.check_policy(policy)
        wanted = self._island_names(policy)
        modules = dict(self.model.named_modules())
        for name in [n for n in self._islands.keys() if n not in wanted]:
            self._islands.pop(name).remove()
        for name in wanted:
            if name not in self._islands:
                self._islands.add(apply_kind(modules[name], "fp32", device_type=self.device_type), key=name)
        kinds = self._layer_kind_names(policy, wanted)
        for name in [n for n in self._kinds.keys() if kinds.get(n) != self._kind_handles[n].kind]:
            self._kinds.pop(name).remove()
            del self._kind_handles[name]
        for name, kind in kinds.items():
            if name not in self._kinds:
                handle = apply_kind(modules[name], kind, **_layer_kind_options(kind, self.device_type))
                self._kind_handles[name] = self._kinds.add(handle, key=name)
        self.policy = policy

    def remove(self) -> None:
        """Take every island off: the model's modules are of their own classes again (but for other owners'
        kinds: another controller's islands stay)."""
        self._kinds.remove()
        self._kind_handles.clear()
        self._islands.remove()

    def __repr__(self):
        return (f"DynamicPrecisionAdjuster(compute_dtype={self.policy.compute_dtype}, "
                f"islands={list(self._islands.keys())}, layers={self.layer_kinds}, device_type={self.device_type!r})")
