"""Per-layer execution kinds (an fp32 island, activation checkpointing): applied to a module, removed by a handle.

:func:`apply_kind` makes one module run its forward inside a *kind*
(``"fp32"``: autocast off and floating inputs in fp32; ``"checkpoint"``:
non-reentrant ``torch.utils.checkpoint``) and returns a
:class:`KindHandle`, whose ``remove()`` takes exactly that application off.
New kinds are registered with :func:`register_kind`.

How: the module's class is swapped (``module.__class__``) for a cached
subclass of its own class whose ``forward`` runs the base class's forward
inside every kind applied to the module, in the order they were applied
(the first innermost). The subclass keeps the base's name, qualified name
and module. Who applied what lives here, in a table weakly keyed by module,
never on the model; each change picks the subclass for what is left, and
the last removal puts the base class back. So:

* several owners compose: two controllers that each keep a module in fp32
  each hold a handle, and the module stays fp32 until both are removed; a
  checkpointed block that became an island keeps the island when the
  checkpointing is removed, in whatever order;
* a copy (``copy.deepcopy``, ``pickle``, ``torch.save(model)``) of a module
  is of its base class: the subclass reduces to it. The copy runs its own
  weights in the model's dtypes, without the kinds: those belong to their
  owners and stay on the module the owners hold;
* under torch.compile, a module's class is guarded, so a changed set of kinds
  retraces once and an unchanged one never; ``forward`` runs its contexts as
  ``with`` blocks, which dynamo keeps across a graph break inside the layer.

Why not a forward pre-hook/hook pair: the pre-hook cannot enter a context that
the hook leaves in a way dynamo honours. ``torch.set_autocast_enabled`` in
hooks traces without a graph break, but a graph break inside the layer ends
the graph without restoring it, and the rest of the layer ran in the compute
dtype (torch 2.13, CPU bf16 autocast); the autocast context's ``__enter__``
called from a hook does not trace at all. Why not a closure set as the
instance's ``forward``: a copy of the module carries the closure, which runs
the original module's bound forward and weights, a pickle of it fails, and
two owners cannot tell their wrappers apart.

A module whose ``forward`` was set on the instance (shadowing its class's)
cannot take a kind: :func:`apply_kind` refuses it by name.
"""

from __future__ import annotations

import copyreg
import itertools
import threading
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

#: kind name -> wrap(forward, **options) -> forward (each forward an unbound function: (module, *args, **kwargs)).
_KINDS: Dict[str, Callable[..., Callable]] = {}
#: (base class, applied kinds) -> the subclass that runs them.
_CLASSES: Dict[tuple, type] = {}
#: module -> [(token, kind, options)] in the order applied.
_APPLIED: "weakref.WeakKeyDictionary[nn.Module, List[tuple]]" = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()
_TOKENS = itertools.count()


def register_kind(name: str, wrap: Callable[..., Callable]) -> None:
    """Make `name` a kind :func:`apply_kind` can apply. ``wrap(forward, **options)`` returns the forward to run
    instead: a function ``(module, *args, **kwargs)`` that calls ``forward(module, *args, **kwargs)`` inside what
    the kind does. It is called once per (class, kinds) and its result lives on a class, so it must not hold a
    module (the forward is handed the module it runs). Options are keyword arguments with hashable values."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not callable(wrap):
        raise TypeError(f"wrap must be callable (forward, **options) -> forward, got {type(wrap).__name__}")
    _KINDS[name] = wrap


def registered_kinds() -> Tuple[str, ...]:
    return tuple(_KINDS)


def base_class(module: nn.Module) -> type:
    """The class `module` has without the kinds applied to it (its own class when none is)."""
    return getattr(type(module), "_kinds_base", type(module))


def applied_kinds(module: nn.Module) -> Tuple[Tuple[str, dict], ...]:
    """(kind, options) of each kind `module` runs in, innermost first (each once, however many owners)."""
    return tuple((kind, dict(options)) for kind, options in getattr(type(module), "_kinds_applied", ()))


class KindHandle:
    """One application of a kind to a module (:func:`apply_kind`). Holds the module weakly."""

    __slots__ = ("kind", "options", "_module", "_token", "__weakref__")

    def __init__(self, module: nn.Module, kind: str, options: dict, token: int):
        self.kind, self.options = kind, options
        self._module = weakref.ref(module)
        self._token = token

    @property
    def module(self) -> Optional[nn.Module]:
        return self._module()

    @property
    def active(self) -> bool:
        module = self._module()
        return module is not None and any(t == self._token for t, _, _ in _APPLIED.get(module, ()))

    def remove(self) -> None:
        """Take this application off (idempotent); the module keeps the kinds other handles hold."""
        module = self._module()
        if module is None:
            return
        with _LOCK:
            entries = _APPLIED.get(module)
            if not entries or not any(t == self._token for t, _, _ in entries):
                return
            left = [e for e in entries if e[0] != self._token]
            _set_class(module, left)
            if left:
                _APPLIED[module] = left
            else:
                del _APPLIED[module]

    def __repr__(self):
        return f"KindHandle(kind={self.kind!r}, options={self.options}, active={self.active})"


def apply_kind(module: nn.Module, kind: str, **options) -> KindHandle:
    """Run `module`'s forward inside `kind` until the returned handle's ``remove()``.

    Kinds: ``"fp32"`` (option ``device_type``, the device whose autocast is turned off: autocast off and the
    floating inputs cast to fp32, an fp32 island), ``"checkpoint"`` (no options: non-reentrant
    ``torch.utils.checkpoint``), or one :func:`register_kind` added. Applying a (kind, options) the module
    already runs in (another owner's) adds an owner: it runs once, until every owner's handle is removed.
    Raises ValueError (nothing changed) for an unknown kind, options the kind refuses, or a module whose
    forward was set on the instance."""
    if kind not in _KINDS:
        raise ValueError(f"kind is {kind!r}; registered kinds: {sorted(_KINDS)} (add one with register_kind)")
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if "forward" in module.__dict__:
        raise ValueError(f"module {base_class(module).__name__} has a forward set on the instance (by another "
                         f"library's hooks, say), which would bypass its class's: kind {kind!r} cannot be applied to "
                         "it; remove that forward first")
    try:
        key = tuple(sorted(options.items()))
        hash(key)
    except TypeError:
        raise ValueError(f"options of kind {kind!r} must be hashable keyword values, got {options}") from None
    with _LOCK:
        entries = list(_APPLIED.get(module, ()))
        token = next(_TOKENS)
        entries.append((token, kind, key))
        _set_class(module, entries)
        _APPLIED[module] = entries
    return KindHandle(module, kind, dict(options), token)


def _set_class(module: nn.Module, entries: List[tuple]) -> None:
    applied = []
    for _, kind, key in entries:
        if (kind, key) not in applied:
            applied.append((kind, key))
    current = type(module)
    expected = _CLASSES.get((base_class(module), tuple(getattr(current, "_kinds_applied", ()))), current)
    if current is not expected or (not hasattr(current, "_kinds_base") and module in _APPLIED):
        raise RuntimeError(f"the class of {base_class(module).__name__} module was changed by someone else after "
                           f"kinds were applied to it (now {current.__module__}.{current.__qualname__}); its kinds "
                           "cannot be changed safely")
    base = base_class(module)
    target = _subclass(base, tuple(applied)) if applied else base
    if target is not current:
        try:
            module.__class__ = target
        except TypeError as exc:
            raise ValueError(f"cannot apply kinds to a {base.__qualname__} module: {exc}") from None


def _subclass(base: type, applied: tuple) -> type:
    cls = _CLASSES.get((base, applied))
    if cls is not None:
        return cls
    forward = base.forward
    for kind, key in applied:
        try:
            forward = _KINDS[kind](forward, **dict(key))
        except TypeError as exc:
            raise ValueError(f"kind {kind!r} refused its options {dict(key)}: {exc}") from None
    cls = type(base.__name__, (base,), {
        "forward": forward,
        "_kinds_base": base,
        "_kinds_applied": applied,
        "__reduce_ex__": _reduce_ex,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
    })
    _CLASSES[(base, applied)] = cls
    return cls


def _reduce_ex(self, protocol):
    # A copy or a pickle is of the base class: the kinds stay with their owners' module (see the module docstring).
    # copyreg.__newobj__ would do, but pickle insists that its class is the object's own.
    reduced = super(type(self), self).__reduce_ex__(protocol)
    if not isinstance(reduced, tuple) or len(reduced) < 2 or not reduced[1] or reduced[1][0] is not type(self):
        return reduced
    if reduced[0] is copyreg.__newobj__ and len(reduced[1]) == 1:
        return (copyreg._reconstructor, (type(self)._kinds_base, object, None)) + tuple(reduced[2:])
    return (reduced[0], (type(self)._kinds_base,) + tuple(reduced[1][1:])) + tuple(reduced[2:])


class OwnedHandles:
    """Handles (anything with ``remove()``) removed together: by :meth:`remove`, or when `owner` is garbage
    collected (``weakref.finalize``: the handles never keep the owner alive)."""

    def __init__(self, owner=None):
        self._handles: Dict[object, object] = {}
        self._finalizer = None if owner is None else weakref.finalize(owner, _remove_all, self._handles)
        if self._finalizer is not None:
            self._finalizer.atexit = False  # at exit the models go too; nothing to give back

    def add(self, handle, key=None):
        """Own `handle` (None is ignored; a callable without ``remove`` is an undo, called once) under `key`
        (default: the handle itself); returns what it owns (the handle, or the undo as a handle)."""
        if handle is not None:
            if not hasattr(handle, "remove"):
                if not callable(handle):
                    raise TypeError(f"handle must have remove() or be callable, got {type(handle).__name__}")
                handle = _Undo(handle)
            self._handles[handle if key is None else key] = handle
        return handle

    def pop(self, key):
        """The handle owned under `key`, no longer owned (not removed); None if there is none."""
        return self._handles.pop(key, None)

    def discard(self, handle) -> None:
        for key, owned in list(self._handles.items()):
            if owned is handle:
                del self._handles[key]

    def keys(self) -> tuple:
        return tuple(self._handles)

    def __contains__(self, key) -> bool:
        return key in self._handles

    def __len__(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        """Remove every owned handle, the newest first (idempotent)."""
        _remove_all(self._handles)


class _Undo:
    __slots__ = ("undo",)

    def __init__(self, undo):
        self.undo = undo

    def remove(self) -> None:
        undo, self.undo = self.undo, None
        if undo is not None:
            undo()


def _remove_all(handles: dict) -> None:
    first = None
    while handles:
        try:
            handles.pop(next(reversed(handles))).remove()
        except Exception as exc:  # the others still come off; the first failure is raised after them
            first = first or exc
    if first is not None:
        raise first


# ---------------------------------------------------------------------------- kinds


def to_fp32(value):
    """Floating-point tensors (also inside tuples, lists and dicts) -> fp32; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.dtype != torch.float32 else value
    if isinstance(value, (tuple, list)):
        items = [to_fp32(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuples too
    if isinstance(value, dict):
        return type(value)((k, to_fp32(v)) for k, v in value.items())
    return value


def _fp32(forward, device_type: str):
    def fp32_forward(self, *args, **kwargs):
        # Autocast would recast the layer's ops to the compute dtype; turning it off alone is not enough,
        # since inputs already produced in fp16/bf16 would keep the ops in that dtype.
        with torch.autocast(device_type, enabled=False):
            return forward(self, *to_fp32(args), **to_fp32(kwargs))
    return fp32_forward


def _checkpoint(forward):
    def checkpointed_forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
    return checkpointed_forward


register_kind("fp32", _fp32)
register_kind("checkpoint", _checkpoint)
