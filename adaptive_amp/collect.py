"""Per-layer activation capture that works the same in an eager and in a compiled model.

The controller needs, at statistics steps, each layer's input and output.
:class:`ActivationCollector` registers one forward hook per layer, once,
when it is created, and the hooks record only while ``collector.active`` is
true. Why persistent, gated hooks rather than hooks added for a statistics
step and removed after it: dynamo traces the hooks a module has when a
compiled model first runs and (``torch._dynamo.config.skip_nnmodule_hook_guards``,
on by default) does not notice hooks added or removed later, so hooks added
per step would never run in a compiled model.

Between statistics steps the hooks are parked: taken out of the modules'
hook dictionaries (same keys, same functions) and put back by
:meth:`ActivationCollector.start`. An eager module call with a hook takes
``nn.Module``'s general path, about 3 µs a layer on the host, which an eager
GPT-2 small step (host-bound on an H200) would pay at every step.

Under ``torch.compile`` the hooks are traced like the rest of the forward.
(A model compiled whole that the controller wraps runs its statistics steps
with its repeated blocks compiled instead, so that their graph is one
block's: adaptive_amp.regional.)
A compiled model gets two graphs per policy, each compiled once: one for
statistics steps, which also returns each layer's statistics rows (added
to the collector's records after the graph runs, as dynamo replays the
hooks' attribute sets), and
one for the other steps, traced with the hooks parked, which has nothing of
them. No graph break. Dynamo must not run the second at a statistics step,
and by default (``torch._dynamo.config.skip_nnmodule_hook_guards``) its
guards do not check the modules' hook dictionaries. So a statistics step
flips torch's autocast weight-cache flag (``torch.set_autocast_cache_enabled``)
until :meth:`ActivationCollector.stop`: dynamo guards it in every graph, so
a graph traced at another step (or before the collector existed, or from
another instance of the model's class: dynamo keeps graphs on the forward's
code object, shared by every instance, and for transformers' decorated
forwards by many classes) does not run at a statistics step, and the one
traced there has our hooks. The flag changes no value and no compiled
graph: the cache only spares an eager forward casting a weight it uses
twice in one autocast region a second time.
Dynamo's hook guards would also tell the graphs apart, but they check each
module's hook dictionaries at every compiled call of every model of the
process: +0.66 ms a training forward of a 22-layer Llama on an H200 host's
CPU, 2.6% of the 1.1B Llama's compiled step.
Keeping the hooks in instead cost that step 12% on H200s: dynamo then checks
every hook's closure at every call. A graph without our hooks can still run
at a statistics step if it was traced inside one (another model of the class
run inside the controller's autocast there); the step then records nothing,
and the collector turns the hook guards on for the process and drops
dynamo's graphs (:func:`guard_hooks_under_compile`; the controller warns):
that step's statistics are lost, the next ones record.

In an eager model a hook measures its layer at once (one ``tensor_stats``
launch for the layer's output and input) and keeps only that statistics
row: keeping the tensors until the forward ends would keep alive, through
the whole forward and the loss, every layer output that autograd does not
save (under CUDA autocast: the fp32 outputs of layer norms, the fp32 GELU
outputs that feed an MLP's down projection, the projections' outputs
added to the residual), more memory than the parameters at GPT-2's size,
and a statistics step would raise the run's peak by that much. A compiled
graph measures them inside the graph, through the kernel's custom op
(stats_torch.py): the same rows, and the graph returns the rows, not the
tensors. There a call measures the layers waiting when a module holding
them returns (each child of the model; in a compiled block, each child that
holds layers: its attention, its MLP), or LAYERS_PER_CALL layers at once
where more wait (the host cost is per call). Not in the middle of such a
module: there the call would read a tensor (an MLP's up projection) before
its other uses (the product with the gate), and the partitioner of the
forward and backward graphs (torch._functorch's min-cut, "used far apart")
then recomputes none of those uses in the backward but saves them. With
the same effect of the fp8 guard's copies (adaptive_amp.fp8.training), a
statistics step's graph saved 0.33 GiB more a decoder layer than the
ordinary one's and peaked that much higher (an 8B Llama, 8 sequences of
2048, fp8 MLPs, H200); measured at returns, and with the guard's copies
made as below and freed as the forward ends, it peaks as an ordinary step.

Blocks compiled one at a time (``block.compile()`` on each decoder layer,
regional compilation) share one graph, as dynamo inlines modules and keeps
graphs on the forward's code object: the graph traced for the first block
runs for every block whose state passes its guards. So a traced hook reads
nothing that differs from block to block. It holds no layer name (the
layer's module goes into the record, and its name is looked up after the
step); the records are a chain, each record holding the one before it
(``_tail``), which a traced hook extends without reading it (an attribute
set, which dynamo replays after the graph with no guard, where appending to
a list guards on its length); and the layers waiting for their call are
measured when each compiled module returns (hooks added by
:meth:`ActivationCollector.start` on the modules compiled by then; dynamo
starts a module's graph at its forward, so such a hook runs just after the
block's graph, in a small graph of its own, also shared by every block), so
that every graph starts with none waiting. Within a block they are measured
when its attention and its MLP return (hooks added with the block's, traced
into its graph); the rows keep forward order.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _native, adjust, ops, stats_torch
from .layers import compiled_parts

#: Dtypes tensor_stats reads; other outputs (integer ids, fp64) are not recorded.
STATS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Layers a compiled statistics step measures with one custom-op call. Each call costs tens of microseconds
#: on the host (the dispatcher, the op's wrapper, the launch), and a 1B Llama has 201 layers: one call a layer
#: made a compiled statistics step 20-25 ms longer on an H200, a host-bound step. A layer's tensors wait for
#: their call, at most this many layers' (most of which autograd keeps anyway). Calls come sooner where a module
#: holding layers returns (see the module docstring).
LAYERS_PER_CALL = 8

#: The end of the records' chain: a record is (layer modules, their rows, whether each has an input row, the
#: record before it). The same length as a record, so a traced hook that starts the chain and one that extends it
#: pass the same guards.
_NO_RECORD: tuple = ((), None, (), None)


def first_tensor(value) -> Optional[torch.Tensor]:
    """The first floating-point tensor in a (nested) output or argument list, or None."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, dict):
        items = list(value.values())
    else:
        return None
    for v in items:
        t = first_tensor(v)
        if t is not None:
            return t
    return None


def hooks_guarded() -> bool:
    """Whether dynamo's graphs traced from now on check module hooks (off by default; see the module's
    docstring)."""
    from torch._dynamo import config

    return not config.skip_nnmodule_hook_guards


def guard_hooks_under_compile() -> None:
    """Make dynamo check module hooks in its guards from now on, and drop the graphs traced without them (see
    the module's docstring: what a collector does when a graph without its hooks may run)."""
    from torch._dynamo import config

    if hooks_guarded():
        return
    config.skip_nnmodule_hook_guards = False
    adjust.forget_compiled_graphs()


def _compiling() -> bool:
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if check is None:  # torch < 2.3
        check = getattr(torch._dynamo, "is_compiling", lambda: False)
    return bool(check())


class ActivationCollector:
    """Hooks on `layers` ((name, module) pairs) that record each layer's input and output statistics while
    active.

    Usage::

        collector = ActivationCollector(find_layers(model))
        collector.start(fmt="float16")        # the format the output statistics count against
        model(x)
        collector.stop()
        outputs, inputs = collector.stats()   # TensorStats (rows named by layer, forward order), or None
        collector.remove()                    # the model's hooks are as before
    """

    def __init__(self, layers: Sequence[Tuple[str, nn.Module]], root: Optional[nn.Module] = None):
        self.active = False
        self.fmt: Optional[str] = None
        self.skip: frozenset = frozenset()
        self._tail: tuple = _NO_RECORD  # the last record (see _NO_RECORD), in forward order through the chain
        self.names = tuple(name for name, _ in layers)
        self._name_of = {id(module): name for name, module in layers}
        # One hook for every layer: nothing in it is a layer's own (see the module docstring).
        record = self._hook()
        self._handles = [module.register_forward_hook(record, with_kwargs=True) for _, module in layers]
        # Layers a compiled forward has recorded and not yet measured (see LAYERS_PER_CALL). The rest are measured
        # when each of `root`'s (the model's) children returns: inside the model's graph, whose end is a child's.
        # (The model's own hooks run outside its graph.) Left over without a root: after the graph, by stop().
        self._waiting: List[tuple] = []
        self._root = root if layers else None
        self._flushed: set = set()  # ids of the modules whose return measures the layers waiting
        if self._root is not None:
            for child in root.children():
                self._measure_on_return(child)
        self._parked: Optional[list] = None  # [(hook dict, key, hook)] while the hooks are out of the modules
        self._layouts: dict = {}  # see _layout
        self._cache_flag: Optional[bool] = None  # the autocast cache flag start() flipped, until stop()
        #: Whether the last statistics step recorded no layer in a process that compiles, and so turned dynamo's
        #: hook guards on (see the module's docstring).
        self.missed = False
        self._park()

    def start(self, fmt: Optional[str] = None, skip=()) -> None:
        """Record from the next forward: outputs counted against `fmt`; layers named in `skip` (islands) not.
        Until :meth:`stop`, the autocast cache flag is flipped (see the module's docstring)."""
        self._tail = _NO_RECORD
        self._waiting.clear()
        self.fmt, self.skip = fmt, frozenset(skip)
        self._unpark()
        if self._root is not None:
            for _, module in compiled_parts(self._root):
                for part in (module, *self._containers(module)):
                    if id(part) not in self._flushed:
                        self._measure_on_return(part)
        if self._cache_flag is None:
            self._cache_flag = torch.is_autocast_cache_enabled()
            torch.set_autocast_cache_enabled(not self._cache_flag)
        self.active = True

    def stop(self) -> None:
        """Stop recording; the hooks leave the modules until the next :meth:`start`."""
        self._measure_waiting()
        if self._cache_flag is not None:
            torch.set_autocast_cache_enabled(self._cache_flag)
            self._cache_flag = None
        if self.active and not self._tail[0] and set(self.names) - self.skip and adjust.graphs_traced() \
                and not hooks_guarded():
            # A graph traced without our hooks, in a statistics step's state, ran for our model (see the module's
            # docstring): from now on dynamo tells graphs with and without them apart.
            guard_hooks_under_compile()
            self.missed = True
        else:
            self.missed = False
        self.active = False
        self._park()

    def _measure_on_return(self, module: nn.Module) -> None:
        """Measure the layers waiting when `module` (compiled on its own, or a child of the model) returns, so that
        the next graph starts with none waiting (see the module docstring)."""
        self._flushed.add(id(module))
        self._handles.append(module.register_forward_hook(lambda module, args, output: self._measure_waiting()))

    def _containers(self, module: nn.Module) -> List[nn.Module]:
        """The children of `module` that hold layers (a block's attention and MLP), looking through those without a
        call of their own (a ModuleList or ModuleDict, as T5's blocks hold theirs)."""
        found = []
        for child in module.children():
            if type(child).forward is nn.Module.forward:
                found += self._containers(child)
            elif any(id(m) in self._name_of for m in child.modules() if m is not child):
                found.append(child)
        return found

    def _park(self) -> None:
        if self._parked is not None:
            return
        parked = []
        for h in self._handles:
            for ref in (h.hooks_dict_ref, *getattr(h, "extra_dict_ref", ())):
                hooks = ref()
                if hooks is not None and h.id in hooks:
                    parked.append((hooks, h.id, hooks.pop(h.id)))
        self._parked = parked

    def _unpark(self) -> None:
        if self._parked is None:
            return
        for hooks, key, hook in self._parked:
            hooks[key] = hook
        self._parked = None

    def _hook(self):
        def record(module, args, kwargs, output):
            if not self.active:
                return None
            out = first_tensor(output)
            if out is None or out.dtype not in STATS_DTYPES or out.numel() == 0:
                return None
            # Traced: every layer, islands too (they are left out after the graph, so that their set is not in
            # its guards).
            compiling = _compiling()
            if not compiling and self._name_of[id(module)] in self.skip:
                return None
            x = first_tensor(args)
            x = first_tensor(kwargs) if x is None else x
            ok = x is not None and x.dtype in STATS_DTYPES and x.numel() > 0
            # Measured now (eager) or within LAYERS_PER_CALL layers (traced), so the forward keeps no tensor for
            # us past that (see the module docstring). One launch: the
            # input's format counts are computed too and not shown (its TensorStats has no format). The
            # tensors as they are: the kernel reads strided tensors (channels_last natively, other views
            # through its own copy), so a compiled statistics step adds no copy to its graph.
            tensors = (out.detach(), x.detach()) if ok else (out.detach(),)
            if compiling:
                self._waiting.append((module, tensors, ok))
                if len(self._waiting) >= LAYERS_PER_CALL:
                    self._measure_waiting()
            else:
                self._measure_waiting()  # (layers a graph before a graph break left waiting: forward order)
                self._tail = ((module,), ops.tensor_stats(tensors, fmt=self.fmt).raw, (ok,), self._tail)
            return None
        return record

    def _measure_waiting(self) -> None:
        """One tensor_stats call for the layers waiting: a record of their modules, rows and inputs."""
        if not self.active or not self._waiting:
            return
        waiting = list(self._waiting)
        self._waiting.clear()  # (the same list object: a compiled graph must find the list it traced)
        tensors = [t for _, ts, _ in waiting for t in ts]
        rows = stats_torch.tensor_stats_op(tensors, self.fmt) if _compiling() else \
            ops.tensor_stats(tensors, fmt=self.fmt).raw
        self._tail = (tuple(m for m, _, _ in waiting), rows, tuple(ok for _, _, ok in waiting), self._tail)

    def take(self) -> List[object]:
        """The records since the last take, in forward order; the collector starts empty again. A record is
        (layer names, their rows, whether each has an input row): each layer's output row, then its input's."""
        records, node = [], self._tail
        while node[0]:  # (a record has a layer; the end, none: whether or not dynamo's replay kept the object)
            modules, rows, oks, node = node
            records.append((tuple(self._name_of[id(m)] for m in modules), rows, oks))
        records.reverse()
        self._tail = _NO_RECORD
        self._waiting.clear()
        return records

    def stats(self):
        """(output statistics, input statistics) of the layers recorded since :meth:`start`, each a
        TensorStats with one row per layer in forward order (None when no layer was recorded). Nothing is read
        to the host."""
        from .stats import TensorStats

        records = self.take()
        if not records:
            return None, None
        rows = torch.cat([raw for _, raw, _ in records])  # each record's output row, then its input's if any
        recorded = tuple((name, ok) for names, _, oks in records for name, ok in zip(names, oks))
        out_names, out_at, in_names, in_at = self._layout(recorded, rows.device)
        if not out_names:
            return None, None
        device = _native.device_of(rows)

        def picked(at, names, fmt):
            return TensorStats(rows.index_select(0, at), len(names), fmt=fmt, names=names, framework="torch",
                               device=device)
        return (picked(out_at, out_names, self.fmt), picked(in_at, in_names, None) if in_names else None)

    def _layout(self, recorded, device):
        """(output names, their rows' indices, input names, their rows' indices) of the rows of `recorded`
        ((name, has input) pairs in forward order), islands left out; the indices on `device`.

        Kept per layout: a statistics step records the same layers every time, and gathering the rows with
        one index_select each replaced two slices a layer (3.5 ms of host time a statistics step on a 1B
        Llama's 201 layers). Made once, since copying indices to a GPU waits for it."""
        key = (recorded, self.skip, device)
        layout = self._layouts.get(key)
        if layout is None:
            out_names, out_at, in_names, in_at, row = [], [], [], [], 0
            for name, has_input in recorded:
                if name not in self.skip:
                    out_names.append(name)
                    out_at.append(row)
                    if has_input:
                        in_names.append(name)
                        in_at.append(row + 1)
                row += 2 if has_input else 1
            layout = (out_names, torch.tensor(out_at, dtype=torch.long, device=device), in_names,
                      torch.tensor(in_at, dtype=torch.long, device=device))
            if len(self._layouts) >= 4:  # (islands moved, another model's forward: a few layouts at most)
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = layout
        return layout

    def remove(self) -> None:
        """Remove the hooks (idempotent). Removed between start and stop, the next stop still gives the autocast
        cache flag back."""
        self._unpark()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._flushed.clear()
        self._root = None
        self.active = False
        self._tail = _NO_RECORD

