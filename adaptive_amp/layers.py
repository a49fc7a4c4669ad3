"""What a layer is: a module that owns weights and computes, found by structure, not by a class list.

A *layer* is a module with parameters of its own (``module._parameters``,
not its children's): ``nn.Linear``, transformers' ``Conv1D``, a custom
Linear wrapper, norms, embeddings, a convolution, ``nn.MultiheadAttention``.
Containers (a transformer block, an ``nn.Sequential``) are not layers: their
layers are. The root module is never one (it is the whole model, and a policy
cannot name it).

Users choose differently by name pattern or type:

* ``include``: only modules matching it are layers (whether or not they own
  weights), e.g. ``include=nn.Linear`` or ``include="*.mlp"``;
* ``exclude``: modules matching it are not layers, e.g. ``exclude="*.ln_*"``.

A selector is a glob pattern over the module's dotted name (``fnmatch``: ``*``
also crosses dots), a module class (subclasses match), or a list of them.

The analyzer, the monitor's per-layer statistics, the islands and the report
all see the layers this module finds. A ``torch.compile`` wrapper is looked
through, and names never carry its ``_orig_mod.`` prefix, so a layer has the
same name in a compiled model and in the eager one.
"""

from __future__ import annotations

import fnmatch
import sys
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

#: The attribute through which torch.compile's OptimizedModule holds the module it compiled.
COMPILED_ATTR = "_orig_mod"

Selector = Union[str, type, Sequence[Union[str, type]], None]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper compiled (through nested wrappers); `model` itself otherwise.

    Its submodules are the compiled model's, with the names the eager model has."""
    while isinstance(getattr(model, COMPILED_ATTR, None), nn.Module):
        model = getattr(model, COMPILED_ATTR)
    return model


def compiled_in_place(model: nn.Module) -> List[nn.Module]:
    """The modules of `model` compiled in place (``module.compile()``: each repeated block, or the whole model)."""
    return [m for m in unwrap_model(model).modules() if _is_compiled_in_place(m)]


def _is_compiled_in_place(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def compile_context(impl):
    """The dynamo context (its ``callback`` is the backend) of a function torch.compile returned, such as the
    ``_compiled_call_impl`` of a module compiled in place; None where it cannot be found."""
    cells = getattr(impl, "__closure__", None) or ()
    return next((c.cell_contents for c in cells if hasattr(c.cell_contents, "callback")), None)


def compiles(context) -> bool:
    """Whether `context` (a dynamo context) compiles: torch.compile's, not ``torch.compiler.disable``'s or
    ``torch._dynamo.run``'s (the same class family, with no backend)."""
    dynamo_context = getattr(getattr(torch._dynamo, "eval_frame", None), "_TorchDynamoContext", None)
    return dynamo_context is not None and isinstance(context, dynamo_context) and \
        callable(getattr(context, "callback", None))


def compiled_whole(model: nn.Module) -> Tuple[bool, Any]:
    """Whether `model` is compiled whole, and the dynamo context it was compiled with (None where it cannot be
    read): a torch.compile wrapper, a module compiled in place (``model.compile()``), a LightningModule that
    Lightning's ``from_compiled`` compiled (``trainer.fit`` applies it to a module ``torch.compile`` wrapped: its
    forward and training_step, the context kept in ``_compiler_ctx``), or a module whose forward was replaced by
    a compiled function in the instance. A wrapper or forward of ``torch.compiler.disable`` is not compiled."""
    root = unwrap_model(model)
    if root is not model:
        context = getattr(model, "dynamo_ctx", None)
        compiled = context is None or compiles(context)  # (None: a torch without it; compiled)
        return compiled, context if compiled else None
    impl = getattr(root, "_compiled_call_impl", None)
    if impl is not None:
        return True, compile_context(impl)
    lightning = getattr(root, "_compiler_ctx", None)  # what from_compiled leaves: training_step compiled too
    context = lightning.get("dynamo_ctx") if isinstance(lightning, dict) else None
    if context is None and "forward" in vars(root):
        # (only dynamo's own compiling context: a forward wrapped by another library, or by
        # torch.compiler.disable, runs eagerly)
        context = compile_context(vars(root)["forward"])
    compiled = compiles(context)
    return compiled, context if compiled else None


def is_compiled(model: nn.Module) -> bool:
    """Whether `model` runs compiled: compiled whole (:func:`compiled_whole`: a ``torch.compile`` wrapper, in
    place, or by Lightning), or a module of it compiled in place (each repeated block, say: compiled even under a
    ``torch.compiler.disable`` wrapper, whose context the block's own compiled call replaces)."""
    return compiled_whole(model)[0] or bool(compiled_in_place(model))


def compiled_parts(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, module) of the modules of `model` compiled on their own: by ``module.compile()``, or wrapped by
    ``torch.compile(module)`` in their parent (the wrapper's name, the module it wraps)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # (nothing compiled in this process)
        return []
    return [(n, m._orig_mod if isinstance(m, eval_frame.OptimizedModule) else m)
            for n, m in unwrap_model(model).named_modules()
            if _is_compiled_in_place(m) or isinstance(m, eval_frame.OptimizedModule)]


def compiled_layers(model: nn.Module) -> Union[bool, Callable[[str], bool]]:
    """Which modules of `model` run compiled: True for a model compiled whole, False for an eager one, else
    ``(name) -> bool`` (a name in the unwrapped model): those inside a part compiled on its own
    (:func:`compiled_parts`: each decoder layer, say; not the embedding or the output head beside them)."""
    if compiled_whole(model)[0]:
        return True
    prefixes = tuple(n for n, _ in compiled_parts(model))
    if not prefixes:
        return False
    return lambda name: any(name == p or name.startswith(p + ".") for p in prefixes)


def is_instance_named(obj, module: str, name: str) -> bool:
    """Whether `obj` is an instance of the class `name` of `module` (``"transformers.pytorch_utils"``,
    ``"Conv1D"``), or of a subclass of it, told by the classes' own names: `module` need not be imported, and
    code that torch.compile traces reads nothing it would guard on beyond `obj`'s type."""
    return any(c.__name__ == name and c.__module__ == module for c in type(obj).__mro__)


def is_sharded(tensor) -> bool:
    """Whether `tensor` (a parameter, its gradient, an optimizer state, a recorded value) is a DTensor, as FSDP2's
    ``fully_shard`` and tensor parallelism leave them: each rank holds its shard, or a replica."""
    return type(tensor).__name__ == "DTensor"


def gathered_layer(module: nn.Module) -> nn.Module:
    """`module` with whole weights, to compute with outside the model's forward (where FSDP2 holds only the
    shards): `module` itself when none of its own parameters is sharded; else a shallow copy of it whose
    sharded parameters are their full tensors (``DTensor.full_tensor()``), new leaves with storage of their
    own: nothing flows back to the shards, and writing to the copy leaves them as they are. Gathering is a
    collective: every rank of the mesh must call this for the same modules, in the same order. The copy holds
    the whole weight until it is dropped."""
    if not any(is_sharded(p) for p in module._parameters.values()):
        return module
    # A shallow copy (its own parameter dict; the hooks and buffers are the original's), made without calling
    # the class: FSDP2's module classes construct again in __new__.
    clone = object.__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone._parameters = {name: _gathered(p) if is_sharded(p) else p for name, p in module._parameters.items()}
    return clone


def _gathered(parameter) -> nn.Parameter:
    full = parameter.full_tensor().detach()
    if full.data_ptr() == parameter.to_local().data_ptr():  # (one rank, or replicated: the shard is the whole)
        full = full.clone()
    return nn.Parameter(full, requires_grad=parameter.requires_grad)


def canonical_name(name: str) -> str:
    """`name` without torch.compile's ``_orig_mod`` components (``_orig_mod.lm_head`` -> ``lm_head``)."""
    parts = name.split(".")
    return ".".join(p for p in parts if p != COMPILED_ATTR) if COMPILED_ATTR in parts else name


def owns_weights(module: nn.Module) -> bool:
    """Whether `module` has parameters of its own (not only its children's)."""
    return any(p is not None for p in module._parameters.values())


def _selectors(value: Selector, what: str) -> Tuple[Tuple[str, ...], Tuple[type, ...]]:
    if value is None:
        return (), ()
    items = [value] if isinstance(value, (str, type)) else list(value)
    patterns, types = [], []
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            patterns.append(canonical_name(item))
        elif isinstance(item, type) and issubclass(item, nn.Module):
            types.append(item)
        else:
            raise TypeError(f"{what}[{i}] is {item!r}; pass a module name pattern (str, e.g. '*.mlp.*') "
                            "or an nn.Module subclass (e.g. nn.Linear)")
    return tuple(patterns), tuple(types)


def _matches(name: str, module: nn.Module, selectors: Tuple[Tuple[str, ...], Tuple[type, ...]]) -> bool:
    patterns, types = selectors
    return isinstance(module, types) or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def find_layers(model: nn.Module, include: Selector = None, exclude: Selector = None) -> List[Tuple[str, nn.Module]]:
    """(name, module) of every layer of `model` (compiled or not), in ``named_modules()`` order.

    Without `include`, a layer is a module that owns weights (see the module
    docstring); with it, a module matching `include`. Modules matching
    `exclude` are left out either way.
    """
    inc, exc = _selectors(include, "include"), _selectors(exclude, "exclude")
    layers = []
    for name, module in unwrap_model(model).named_modules():
        if not name:
            continue
        chosen = _matches(name, module, inc) if include is not None else owns_weights(module)
        if chosen and not _matches(name, module, exc):
            layers.append((name, module))
    return layers


def is_pattern(name: str) -> bool:
    """Whether an island name is a glob pattern (holds ``*``, ``?`` or ``[``)."""
    return any(c in name for c in "*?[")


def expand_names(names: Iterable[str], model: nn.Module, layers: Optional[List[Tuple[str, nn.Module]]] = None
                 ) -> Tuple[List[str], List[str]]:
    """Island names -> module names of `model`: a plain name stands for itself, a pattern for every layer
    whose name matches it. Returns (names in order without repeats, the entries that match nothing)."""
    modules = dict(unwrap_model(model).named_modules())
    layer_names = None
    out, unmatched = [], []
    for entry in names:
        entry = canonical_name(entry)
        if is_pattern(entry):
            if layer_names is None:
                layer_names = [n for n, _ in (layers if layers is not None else find_layers(model))]
            hits = [n for n in layer_names if fnmatch.fnmatchcase(n, entry)]
        else:
            hits = [entry] if entry in modules and entry else []
        if not hits:
            unmatched.append(entry)
        out.extend(h for h in hits if h not in out)
    return out, unmatched


def collapse_names(entries: Sequence[Tuple[str, str]], model: nn.Module) -> List[Tuple[str, str]]:
    """(name, value) entries with the same value on every layer of a repeated block written once, as a pattern:
    ``model.layers.0.mlp.up_proj`` ... ``model.layers.31.mlp.up_proj``, all fp8, become
    ``model.layers.*.mlp.up_proj``. A pattern (each numeric part of the name a ``*``) is written only where the
    layers of `model` it matches (as :func:`expand_names` reads it) are exactly the entries it replaces, two or
    more, each named by no other entry (so that no later entry's precedence moves); it takes the place of the
    first of them. Other entries are kept as they are, in order."""
    def pattern_of(name: str) -> str:
        return ".".join("*" if part.isdigit() else part for part in name.split("."))

    names = [n for n, _ in find_layers(model)]
    uses: dict = {}
    groups: dict = {}
    for name, value in entries:
        uses[name] = uses.get(name, 0) + 1
        groups.setdefault((pattern_of(name), value), []).append(name)
    collapsed = {key for key, members in groups.items()
                 if len(members) > 1 and key[0] not in members and all(uses[n] == 1 for n in members)
                 and sorted(n for n in names if fnmatch.fnmatchcase(n, key[0])) == sorted(members)}
    out, done = [], set()
    for name, value in entries:
        key = (pattern_of(name), value)
        if key not in collapsed:
            out.append((name, value))
        elif key not in done:
            done.add(key)
            out.append(key)
    return out
