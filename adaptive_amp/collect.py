"""Per-layer activation capture that works the same in an eager and in a compiled model.

The controller needs, at statistics steps, each layer's input and output.
:class:`ActivationCollector` registers one forward hook per layer, once,
when it is created, and the hooks record only while ``collector.active`` is
true. Why persistent, gated hooks rather than hooks added for a statistics
step and removed after it: dynamo traces the hooks a module has when a
compiled model first runs and (``torch._dynamo.config.skip_nnmodule_hook_guards``,
on by default) does not notice hooks added or removed later, so hooks added
per step would never run in a compiled model.

Under ``torch.compile`` the hooks are traced like the rest of the forward;
``active`` is a plain bool that dynamo guards, so a compiled model gets two
graphs per policy, each compiled once: one for statistics steps, which also
returns the recorded tensors (appended to ``records`` after the graph runs,
as dynamo replays list mutations), and one for the other steps, in which the
hooks leave no trace. No graph break. In an eager model a step without
statistics costs one Python call per layer (module calls with a hook take
``nn.Module``'s general path).

Dynamo keeps its graphs on the forward's code object, shared by every
instance of a model class (and, for transformers' decorated forwards, by
many classes): without guards on hooks, a model with our hooks reuses a graph
traced from another instance without them (a plain copy, a teacher, an EMA
model compiled first) and records nothing. So the first collector turns on
dynamo's hook guards for the process (``skip_nnmodule_hook_guards = False``:
graphs traced from then on check the hooks they traced, a few dictionary
checks per module and call) and, if graphs were traced before without them,
clears dynamo's caches once (``torch.compiler.reset()``: other compiled
models recompile at their next call).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

#: Dtypes tensor_stats reads; other outputs (integer ids, fp64) are not recorded.
STATS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def guard_hooks_under_compile() -> None:
    """Make dynamo check module hooks in its guards from now on (see the module's docstring)."""
    from torch._dynamo import config
    from torch._dynamo.utils import counters

    if not config.skip_nnmodule_hook_guards:
        return
    config.skip_nnmodule_hook_guards = False
    if counters["stats"]["unique_graphs"]:  # graphs traced before have no hook guards
        torch.compiler.reset()


class ActivationCollector:
    """Hooks on `layers` ((name, module) pairs) that record ``(name, input or None, output)`` while active.

    Usage::

        collector = ActivationCollector(find_layers(model))
        collector.active = True
        model(x)
        collector.active = False
        for name, x, out in collector.take(): ...
        collector.remove()   # the model's hooks are as before
    """

    def __init__(self, layers: Sequence[Tuple[str, nn.Module]]):
        self.active = False
        self.records: List[tuple] = []
        self.names = tuple(name for name, _ in layers)
        if layers:
            guard_hooks_under_compile()
        self._handles = [module.register_forward_hook(self._hook(name), with_kwargs=True) for name, module in layers]

    def _hook(self, name: str):
        def record(module, args, kwargs, output):
            if not self.active:
                return None
            out = first_tensor(output)
            if out is None or out.dtype not in STATS_DTYPES or out.numel() == 0:
                return None
            x = first_tensor(args)
            x = first_tensor(kwargs) if x is None else x
            ok = x is not None and x.dtype in STATS_DTYPES and x.numel() > 0
            # As they are: tensor_stats reads strided tensors (channels_last natively, other views through
            # its own copy), so a statistics step adds no copy to the graph.
            self.records.append((name, x.detach() if ok else None, out.detach()))
            return None
        return record

    def take(self) -> List[tuple]:
        """The records since the last take, in forward order; the collector starts empty again."""
        # The same list object, emptied: a compiled graph that appends to it must find the list it traced.
        records = list(self.records)
        self.records.clear()
        return records

    def remove(self) -> None:
        """Remove the hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.active = False
        self.records.clear()
