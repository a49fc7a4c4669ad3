"""fp8 layers in a training run: the measured map, the measured policies, and the guard fed at statistics steps.

:func:`measure_fp8_map` turns :func:`~adaptive_amp.fp8.select.select_fp8_layers`'
decisions into an :class:`Fp8Map`: the entries of a policy's per-layer map
(``policy.layers``) for the layers measured to gain and tolerate fp8, each
layer's decision (chosen or left as it was) as a reason, and why no layer
when none. :func:`measured_policy` adds it to a base policy: what
``AdaptiveMixedPrecision(policy="<base>+fp8")`` runs (:data:`MEASURED_PRESETS`:
fp8 over bf16 autocast, over bf16 weights, over bf16-pure).
:func:`tuning_fp8_map` measures the map a tuning's ``+fp8`` candidates share,
once, on the tuning's batches and loss function.

:class:`Fp8Watch` is the controller's eye on its fp8 layers: armed at a
statistics step, a forward pre-hook on each keeps a copy of at most
``max_rows`` rows of its input; as the forward ends :meth:`Fp8Watch.settle`
turns them into the guard's rows (:func:`~adaptive_amp.fp8.guard.fp8_layer_row`:
cast statistics and the output error against a float32 recompute) and frees
the copies before the backward, where a step peaks; after the step
:meth:`Fp8Watch.observe` hands the rows to
:class:`~adaptive_amp.fp8.guard.Fp8Guard`. A layer the guard demotes
stays watched (its rows say what fp8 would do), so that it can come back.
:func:`policy_after` is the policy change each of the guard's events asks for,
through the map: ``fp8_demote`` moves the layer to ``"bf16"``,
``fp8_restore`` back to its fp8 kind.
"""

from __future__ import annotations

import fnmatch
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..detectors import Event
from ..layer_precision import OwnedHandles
from ..layers import collapse_names, compiled_layers, gathered_layer, unwrap_model
from ..names import FP8_BASES
from .guard import Fp8Guard, fp8_layer_row
from .select import select_fp8_layers

#: The policy names of AdaptiveMixedPrecision that measure which layers go to fp8: the base recipe's policy
#: (adaptive_amp.names.FP8_BASES) plus the measured layers; adaptive_amp.names.fp8_preset reads them.
MEASURED_PRESETS = tuple(f"{base}+fp8" for base in FP8_BASES)
#: The first of them: bf16 autocast, and fp8 in each layer measured to gain and tolerate it.
MEASURED_PRESET = MEASURED_PRESETS[0]


@dataclass(frozen=True)
class Fp8Map:
    """What a measurement puts in fp8: ``layers``, entries of a policy's per-layer map (name, fp8 kind);
    ``reasons``, one per measured layer (chosen or not, and why); ``why_none``, when no layer was chosen, why
    (the one reason every layer shares, such as no GPU with fp8 matmuls, or a summary); ``saved_ms``, the
    milliseconds its fp8 layers' forwards and backwards took less than in bf16, summed over the layers, each at
    its shape (None when a layer's gain was not timed here: a ``gain_fn``)."""

    layers: Tuple[Tuple[str, str], ...] = ()
    reasons: Tuple[str, ...] = ()
    why_none: Optional[str] = None
    saved_ms: Optional[float] = None


def measure_fp8_map(model: nn.Module, batches: Iterable[Any], **options) -> Fp8Map:
    """The :class:`Fp8Map` of :func:`select_fp8_layers` on `model` and `batches` (``**options``: its keyword
    arguments). Nothing on the model changes."""
    spent = options.pop("seconds", None)
    spent = {} if spent is None else spent
    choices = select_fp8_layers(model, batches, seconds=spent, **options)
    layers, reasons, why_not = [], [], []
    for choice in choices.values():
        if choice.kind is not None:
            layers.append((choice.name, choice.kind))
            reasons.append(f"layer {choice.name}: {choice.kind}, {choice.reason}")
        else:
            why = choice.reason[len("skipped: "):] if choice.reason.startswith("skipped: ") else choice.reason
            why_not.append(why)
            reasons.append(f"layer {choice.name}: stays as it was, not fp8 ({why})")
    if not choices:
        reasons.append("fp8: the model has no nn.Linear or Conv1D layer")
        return Fp8Map((), tuple(reasons), "the model has no nn.Linear or Conv1D layer")
    why_none = None
    if not layers:
        shared = set(why_not)
        why_none = (why_not[0] if len(shared) == 1 else
                    f"no layer gains and tolerates fp8 ({len(why_not)} measured: " + "; ".join(reasons[:3])
                    + ("; ..." if len(reasons) > 3 else "") + ")")
    total = spent["inputs"] + spent["gains"] + spent["errors"]
    reasons.append(f"fp8: {len(choices)} layers measured in {total:.1f} s (inputs {spent['inputs']:.1f} s, "
                   f"{spent['shapes']} gains timed in {spent['gains']:.1f} s"
                   + (f", {spent['inferred']} judged from a larger shape" if spent.get("inferred") else "")
                   + f", errors {spent['errors']:.1f} s)")
    # A repeated block's layers that all went the same way are one pattern entry: the policy string of a
    # 32-layer model then reads as its block does, not as 225 names.
    chosen = [c.saved_ms for c in choices.values() if c.kind is not None]
    saved = sum(chosen) if chosen and None not in chosen else None
    return Fp8Map(tuple(collapse_names(layers, model)), tuple(reasons), why_none, saved)


def measured_policy(model: nn.Module, base, batches: Iterable[Any], **options):
    """`base` (a PrecisionPolicy) with every layer :func:`select_fp8_layers` chooses (``**options``: its
    keyword arguments) in its fp8 kind; each layer's decision, taken or not, is a reason."""
    measured = measure_fp8_map(model, batches, **options)
    return base.replace(layers=tuple(base.layers) + measured.layers,
                        reasons=tuple(base.reasons) + measured.reasons)


#: select_fp8_layers' options a tuning takes (its `fp8=`): its batches and run are the tuning's.
_TUNING_OPTIONS = ("kinds", "min_gain", "max_error", "dtype", "warmup", "iters", "compiled", "max_tokens",
                   "gain_fn", "weight_dtype", "infer_smaller")


def check_tuning_options(fp8) -> dict:
    """A tuning's `fp8` argument checked (before anything changes): None or a dict of select_fp8_layers'
    options but ``run`` and ``batches``."""
    if fp8 is None:
        return {}
    if not isinstance(fp8, dict):
        raise TypeError(f"fp8 is a {type(fp8).__name__}; pass a dict of select_fp8_layers' options "
                        f"({', '.join(_TUNING_OPTIONS)}) or None")
    unknown = sorted(set(fp8) - set(_TUNING_OPTIONS))
    if unknown:
        raise ValueError(f"fp8: unknown key(s) {', '.join(map(repr, unknown))}; a tuning measures on its own batches "
                         f"and loss_fn, and takes {', '.join(_TUNING_OPTIONS)}")
    return dict(fp8)


def tuning_fp8_map(model: nn.Module, batches: Sequence[Any], loss_fn: Callable[[nn.Module, Any], Any],
                   **options) -> Fp8Map:
    """The fp8 map every ``+fp8`` candidate of a tuning shares, measured once: each layer's inputs captured from
    ``loss_fn(model, batch)`` on the tuning's `batches`, run on the eager model (a compiled model's own module)
    in eval mode, so that nothing trains and no dropout draws from the RNG; the layers that run compiled timed
    compiled (``compiled=``, unless given: :func:`~adaptive_amp.layers.compiled_layers`), from the weights as
    they are (one map for every base: bf16 weights would time the bf16 baseline without its weight cast;
    ``weight_dtype=`` to time as if they were in it). The RNG states and every module's training flag are left as they
    were (the tuning restores nothing it did not snapshot). ``**options``: :func:`check_tuning_options`."""
    from ..tune import _rng_states, _set_rng_states  # (the tuning's own: what its snapshot restores)

    options = check_tuning_options(options)
    root = unwrap_model(model)
    options.setdefault("compiled", compiled_layers(model))
    modes = [(m, m.training) for m in root.modules()]
    rng = _rng_states()
    try:
        root.eval()
        return measure_fp8_map(root, list(batches), run=loss_fn, **options)
    finally:
        for m, training in modes:
            m.training = training
        _set_rng_states(rng)


def _kind_in(layers, name: str) -> Optional[str]:
    """The kind the map's entries (not the islands) give layer `name`: the last entry that names or matches it."""
    kind = None
    for entry, k in layers:
        if entry == name or fnmatch.fnmatchcase(name, entry):
            kind = k
    return kind


def policy_after(event: Event, policy, kind: str):
    """The policy an Fp8Guard event asks for: ``fp8_demote`` puts the layer in bf16, ``fp8_restore`` back in
    `kind` (its fp8 kind), each as the layer's own entry of the map (an island on it stays and wins)."""
    name = event.layer
    layers = tuple((n, k) for n, k in policy.layers if n != name)
    if event.kind == Fp8Guard.kind:
        return policy.replace(layers=layers + ((name, "bf16"),))
    if event.kind == Fp8Guard.restore_kind:
        # Where a pattern already says `kind`, dropping the demotion's entry is the whole move.
        return policy.replace(layers=layers if _kind_in(layers, name) == kind else layers + ((name, kind),))
    raise ValueError(f"event kind is {event.kind!r}; expected {Fp8Guard.kind!r} or {Fp8Guard.restore_kind!r}")


class Fp8Watch:
    """The inputs of a model's fp8 layers at statistics steps, turned into Fp8Guard's rows and events.

    Args:
        guard: the Fp8Guard deciding (default: one with its defaults).
        max_rows: rows (tokens) of each input the rows are computed from (1024), copied at a statistics step:
            a view would keep the whole input alive until the forward ends, with it the activations that
            checkpointing frees (on a Llama-3-8B shape at 8 x 2048 tokens with checkpointed blocks, about 26
            GiB); 1024 rows of each fp8 layer's input there take 2.4 GiB in bf16, freed as the forward ends
            (:meth:`settle`).
        error: measure each layer's output error against a float32 recompute (one extra matmul pair a
            layer at a statistics step).
    """

    def __init__(self, guard: Optional[Fp8Guard] = None, max_rows: int = 1024, error: bool = True):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.guard = guard if guard is not None else Fp8Guard()
        self.max_rows, self.error = int(max_rows), bool(error)
        self.kinds: Dict[str, str] = {}  # layer -> the fp8 kind it runs in, or returns to once restored
        self.rows: List[dict] = []  # the last statistics step's rows
        self.armed = False
        self.due = False  # armed since the last settle(): the fp8 layers may hold inputs to read
        self._settled: Optional[Tuple[Optional[int], List[dict]]] = None  # (step, rows) settle() made, until read
        self._hooks = OwnedHandles(self)
        self._modules: Dict[str, "weakref.ref[nn.Module]"] = {}

    def sync(self, adjuster) -> None:
        """Watch the fp8 layers of `adjuster`'s policy and the layers the guard holds in bf16."""
        current = {n: k for n, k in adjuster.layer_kinds.items() if k.startswith("fp8-")}
        for name in self.guard.demoted:
            if name in self.kinds:
                current.setdefault(name, self.kinds[name])
        self.kinds = current
        modules = dict(adjuster.model.named_modules())
        for name in [n for n in self._hooks.keys() if n not in current]:
            self._hooks.pop(name).remove()
            module = self._modules.pop(name, lambda: None)()
            if module is not None:
                module.__dict__.pop(_KEPT, None)
        ref = weakref.ref(self)
        for name in current:
            if name not in self._hooks:
                self._hooks.add(modules[name].register_forward_pre_hook(_capture(ref)), key=name)
                self._modules[name] = weakref.ref(modules[name])

    def observe(self, step: int) -> List[Event]:
        """The guard's events from the inputs captured since the last call (none: no events)."""
        return self.decide(step, self.read())

    @property
    def settled_at(self) -> Optional[int]:
        """The step whose forward settled the rows waiting to be read (None: none wait). Under gradient
        accumulation the later forwards of that step need not capture again."""
        return self._settled[0] if self._settled is not None else None

    def settle(self, step: Optional[int] = None) -> None:
        """Turn the inputs captured since the last call into rows now and free their copies: called as a
        forward ends, so that no copy is held through the backward, where a training step peaks (1024 rows of
        every matmul's input of a Llama-3-8B take 2.4 GiB in bf16). The rows wait for :meth:`read`, dated
        `step`; a later settle that captured anything replaces them, one that captured nothing (a forward that
        called no fp8 layer) leaves them. Under FSDP2 each captured layer's whole weight is gathered for its
        recompute (a collective: every rank's forward called the same layers)."""
        if not self.due:
            return
        self.due = False
        kept = {name: self._take(name) for name in self.kinds}  # (all taken first: none stays if a row fails)
        rows = [fp8_layer_row(name, gathered_layer(module) if self.error else module, x, self.kinds[name],
                              error=self.error)
                for name, (module, x) in kept.items() if x is not None]
        if rows:
            self._settled = (step, rows)

    def read(self) -> Optional[List[dict]]:
        """The rows of the inputs captured since the last call (settled as the forward ended, or now), in the
        order of :attr:`kinds`; None when nothing was armed since (every step asks; only a statistics step has
        anything to read)."""
        self.settle()
        rows, self._settled = (self._settled[1] if self._settled is not None else None), None
        return rows

    def drop(self) -> None:
        """Forget the inputs captured and the rows settled since the last read: a step that failed and runs
        again captures its own (the copies of the failed attempt would otherwise stay on the modules, memory
        held where it is short)."""
        self.due = False
        self._settled = None
        for name in list(self._modules):
            self._take(name)

    def _take(self, name: str) -> Tuple[Optional[nn.Module], Optional[torch.Tensor]]:
        """(the watched layer `name`, the copy it holds, removed from it); (None, None) when it is gone."""
        module = self._modules[name]() if name in self._modules else None
        return (module, module.__dict__.pop(_KEPT, None)) if module is not None else (None, None)

    def decide(self, step: int, rows: Optional[List[dict]]) -> List[Event]:
        """The guard's events from `rows` (:meth:`read`'s, or the same agreed over ranks)."""
        if not rows:
            return []
        self.rows = rows
        return self.guard.observe(step, rows)

    def state_dict(self) -> dict:
        """What a resumed run needs: the guard's state and the fp8 kind of each watched layer (a demoted one's
        is the kind it returns to)."""
        return {"guard": self.guard.state_dict(), "kinds": dict(self.kinds)}

    def remove(self) -> None:
        self._hooks.remove()
        self.drop()
        self._modules.clear()


#: The attribute an fp8 layer keeps its input's copy in from a statistics step's forward until the watch settles it.
_KEPT = "_fp8_watch_input"


def _capture(watch_ref):
    # Every fp8 layer's hook is the same function over the same watch: nothing in it is the layer's own (its
    # name is looked up after the step), so that dynamo traces one graph for blocks compiled one at a time
    # (``block.compile()``), as it does without the watch, instead of one per layer.
    def capture_fp8_input(module, args):
        watch = watch_ref()
        if watch is not None and watch.armed and args and isinstance(args[0], torch.Tensor):
            x = args[0].detach()
            # A copy: a view would hold the whole input (a second call, as in a checkpointed recompute: the last).
            # Made by a multiplication, not clone(): inductor drops a clone of a slice as a no-op before it
            # partitions a compiled graph, which then returns a view of the layer's input, and the partitioner
            # does not recompute an input the graph returns in the backward: a statistics step saved more for it
            # than an ordinary step (see adaptive_amp.collect). x * 1 has the values of x. (Inductor's no-op
            # removal leaves a product with a number alone; tests/test_zoo_compile.py fails where it would not.)
            setattr(module, _KEPT, x.reshape(-1, x.shape[-1])[:watch.max_rows] * 1)
    return capture_fp8_input
