"""Statistics steps of a model compiled whole, run with its repeated blocks compiled instead.

The controller's per-layer statistics hooks are traced into the graph of a statistics step (adaptive_amp.collect),
so a model compiled whole compiles twice: at its first step, a statistics step, a graph with the hooks, and at
its second the ordinary one. Measured on an H200 (torch 2.11, each model compiled whole, 2026-11-30): GPT-2
medium at 8 x 1024 tokens took 72 s of one-time work against torch's 45 s, the 1.1B Llama at 4 x 256 74 s
against 38 s.

So a statistics step of such a model runs it eagerly around its repeated blocks
(``torch.compiler.set_stance("force_eager")`` for the whole-model graph) and each block through one compiled
graph that every block shares, compiled with the user's backend: the second compile is one block's. This is the
regional compilation that collect.py already measures (blocks compiled one at a time), and the ordinary steps
run the user's whole-model graph, traced without the hooks. A model compiled whole is a torch.compile wrapper, a
module compiled in place, or one whose forward the instance replaced by a compiled one (Lightning's way). Models
whose blocks are compiled on their own, or that have no repeated blocks, or torch without ``set_stance`` (before
2.6), keep the whole-model statistics graph. Blocks handed a transformers key-value cache run eagerly at
statistics steps (:meth:`RegionalStatistics._call_block` says why).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import List, Optional

import torch
from torch import nn

from .layers import compiled_whole, is_instance_named, unwrap_model
from .recipes import find_blocks


def compile_backend(context):
    """The backend of `context` (a torch.compile wrapper's ``dynamo_ctx``, or
    :func:`~adaptive_amp.layers.compile_context`'s), so that the blocks compile as the user's model does (inductor
    with the user's mode and options, or aot_eager, ...); "inductor" where it cannot be read."""
    backend = getattr(context, "callback", None)
    while getattr(backend, "_torchdynamo_orig_backend", None) is not None:
        backend = backend._torchdynamo_orig_backend
    return backend if callable(backend) and not isinstance(backend, type) and \
        type(backend).__name__ not in ("ConvertFrame", "CatchErrorsWrapper") else "inductor"


def _statistics_block(module: nn.Module, *args, **kwargs):
    """A block's call at a statistics step: the module is an argument, so that every block of one class runs the
    same graph, kept on this function's code alone (not the tuner's, whose graphs go when a tuning ends)."""
    return module._call_impl(*args, **kwargs)


def _holds_a_cache(args, kwargs) -> bool:
    """Whether a block's call carries a transformers key-value cache."""
    return any(is_instance_named(v, "transformers.cache_utils", "Cache") for v in (*args, *kwargs.values()))


def _stance() -> Optional[str]:
    """The current compile stance ("default" unless set), None where torch cannot set one."""
    if getattr(torch.compiler, "set_stance", None) is None:
        return None
    state = getattr(getattr(torch._dynamo, "eval_frame", None), "_stance", None)
    return getattr(state, "stance", "default")


def _compiling() -> bool:
    check = getattr(torch.compiler, "is_compiling", None)
    return bool(check()) if check is not None else False


class RegionalStatistics:
    """For the model a controller wraps: :meth:`step` is the context of a statistics step's forward, which runs
    the repeated blocks compiled and the rest eagerly when the model is compiled whole (see the module
    docstring), and changes nothing otherwise."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._compiled = None  # torch.compile of _statistics_block with the user's backend, made when first used
        self._warned_cache = False

    def blocks(self) -> List[nn.Module]:
        """The blocks a statistics step compiles: the repeated blocks of a model compiled whole (see
        :func:`~adaptive_amp.layers.compiled_whole`), none of them compiled on its own; [] where the whole-model
        statistics graph stays (or nothing is compiled, or the stance was set by the user, or this runs while
        compiling)."""
        # (first: while tracing, nothing below may be read, and the stance is the user's to set)
        if _stance() != "default" or _compiling():
            return []
        if not compiled_whole(self.model)[0]:
            return []
        root = unwrap_model(self.model)
        blocks = [b for _, b in find_blocks(root)]
        if not blocks or any(getattr(b, "_compiled_call_impl", None) is not None for b in blocks):
            return []
        return blocks

    def _call_block(self, module: nn.Module, *args, **kwargs):
        """A block's call at a statistics step: through the shared block graph, in the default stance (the
        whole-model graph is set aside by force_eager)."""
        if _holds_a_cache(args, kwargs):
            # A block handed a transformers key-value cache (transformers keeps one in training while the model's
            # config.use_cache is on) fills its own layer of it, so each block's graph would be one of its own: as
            # many compiles as blocks, up to dynamo's recompile limit. Run eagerly instead (one eager step every
            # stats_every steps, nothing compiled).
            if not self._warned_cache:
                self._warned_cache = True
                warnings.warn("AdaptiveMixedPrecision: the statistics steps run the model eagerly: its blocks are "
                              "handed a transformers key-value cache (config.use_cache is on), which would compile "
                              "one graph per block. Training does not use the cache: set "
                              "model.config.use_cache = False to run them through one compiled block graph (and "
                              "save the cache's memory).", stacklevel=2)
            return module._call_impl(*args, **kwargs)
        with torch.compiler.set_stance("default"):
            return self._compiled(module, *args, **kwargs)

    @contextlib.contextmanager
    def step(self):
        blocks = self.blocks()
        if not blocks:
            yield []
            return
        if self._compiled is None:
            self._compiled = torch.compile(_statistics_block, backend=compile_backend(compiled_whole(self.model)[1]))
        with torch.compiler.set_stance("force_eager"):
            for b in blocks:
                b._compiled_call_impl = functools.partial(self._call_block, b)
            try:
                yield blocks
            finally:
                for b in blocks:
                    b._compiled_call_impl = None
