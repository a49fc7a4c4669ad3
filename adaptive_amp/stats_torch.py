"""tensor_stats as a ``torch.library`` custom op, so that a compiled graph measures its layers itself.

``adaptive_amp::tensor_stats(tensors, fmt) -> rows``: the native kernel's
rows, ``(len(tensors), len(FIELDS))`` float64 on the tensors' device, the
same bits as :func:`adaptive_amp.ops.tensor_stats` gives for the same
tensors. With a fake implementation, dynamo traces a call without a graph
break, and inductor runs it inside the graph as an extern kernel.

Why (collect.py): a compiled statistics step used to return each layer's
input and output from its graph and measure them after it ran. Those tensors
then lived until the forward ended, among them every output that autograd
does not save, and a compiled statistics step peaked 2.3 GiB (GPT-2 medium,
8x1024) to 4.2 GiB above an ordinary step's: more than the tuning's trials
measure. Measured inside the graph, each tensor is freed after its last use,
as in an ordinary step, and the graph returns only the rows.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from . import stats


@torch.library.custom_op("adaptive_amp::tensor_stats", mutates_args=())
def tensor_stats_op(tensors: List[Tensor], fmt: Optional[str]) -> Tensor:
    return stats.compute(tensors, fmt=fmt).raw


@tensor_stats_op.register_fake
def _tensor_stats_fake(tensors, fmt):
    return tensors[0].new_empty((len(tensors), len(stats.FIELDS)), dtype=torch.float64)
