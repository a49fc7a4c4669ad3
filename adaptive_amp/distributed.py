"""AdaptiveMixedPrecision under torch.distributed: every rank takes the same decision at the same step.

What the controller decides from must be the same on every rank, or ranks
that train one model would run it under different policies (and, with DDP,
a different set of islands changes nothing in the all-reduce but everything
in the arithmetic). Its inputs are:

* the skipped-step rate and the loss scale: the same on every rank once the
  scaler all-reduces found_inf (``process_group``), which this class sets up;
* whether an overflowing step's loss was finite (when no layer is to blame,
  a non-finite loss counts towards a switch of the compute dtype): each rank
  has its own loss, so :meth:`CollectiveAdaptiveMixedPrecision._loss_finite`
  takes the minimum over ranks (one all-reduce, at an overflowing watched
  step only, which every rank reaches together: found_inf is all-reduced);
* whether a step's loss was finite (a non-finite one skips the step): the maximum of the ranks' flags,
  one all-reduce of one number a step;
* the layers whose outputs overflowed, taken from each rank's own activation
  statistics: a rank whose batch overflows alone would promote a layer the
  others never saw. :func:`agree_on_layers` makes it the union over ranks
  (one small all-reduce, only at a read step of an overflow storm, which
  every rank reaches together because the storm test itself agrees).

* the fp8 guard's rows (each fp8 layer's input statistics and output error,
  from each rank's own batch): :func:`agree_on_rows` makes each the worst over
  ranks (one small all-reduce at a statistics step), so that every rank's
  guard holds the same history and demotes the same layer at the same step;
* a measured fp8 map (which layers gain and tolerate fp8, timed and measured
  on each rank) and a tuning (``policy="tune"``: every rank runs the trials,
  whose steps are collective, and measures them): rank 0's, broadcast, each
  trial's measurements as soon as they are taken (adaptive_amp.tune), so that
  every rank runs the same trial steps, then the same recipe and the same
  layers in fp8.

The monitor's own detectors (loss spikes and the like) stay per rank: they
log events and decide nothing.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from torch import nn

from ._process_group import comm_device, rank_zeros, world_group
from .controller import AdaptiveMixedPrecision

__all__ = ["CollectiveAdaptiveMixedPrecision", "agree_on_layers", "agree_on_rows", "world_group"]

#: The fp8 guard's row fields agreed over ranks, each as its worst (largest) value on any rank.
ROW_FIELDS = ("amax", "underflow", "saturated", "error")


def agree_on_layers(layers: Sequence[str], candidates: Sequence[str], group=None,
                    device: Optional[torch.device] = None) -> List[str]:
    """The union over the ranks of `group` of each rank's `layers`, in the order of `candidates`.

    `candidates` are the layer names every rank knows in the same order (the
    model's layers of the watched types); a name outside them is kept only on
    the rank that named it, so it is refused instead. Collective: every rank
    of the group must call it at the same point.
    """
    index = {name: i for i, name in enumerate(candidates)}
    unknown = [name for name in layers if name not in index]
    if unknown:
        raise ValueError(f"layers {unknown} are not among the model's candidate layers; every rank must "
                         "be able to name a layer for the ranks to agree on it")
    mask = torch.zeros(len(candidates), dtype=torch.int32, device=device or torch.device("cpu"))
    for name in layers:
        mask[index[name]] = 1
    torch.distributed.all_reduce(mask, op=torch.distributed.ReduceOp.MAX, group=group)
    chosen = mask.cpu().tolist()
    return [name for name, hit in zip(candidates, chosen) if hit]


def agree_on_rows(rows: Sequence[dict], names: Sequence[str], group=None,
                  device: Optional[torch.device] = None) -> List[dict]:
    """The fp8 guard's rows (adaptive_amp.fp8.Fp8Guard), each field the largest over the ranks of `group`:
    a layer one rank sees in trouble is in trouble. A row comes back for each of `names` (the watched fp8
    layers, the same on every rank, in the same order) that any rank has, in that order, with the fields any
    rank gave; a non-finite amax stays non-finite, and an error no rank measured is NaN. Collective: every rank
    calls it at the same statistics step."""
    index = {name: i for i, name in enumerate(names)}
    unknown = [row["name"] for row in rows if row["name"] not in index]
    if unknown:
        raise ValueError(f"rows of layers {unknown} are not among the watched layers; every rank must watch a "
                         "layer for the ranks to agree on it")
    # One column a field and one that says the row is there; -inf: no value on this rank (the maximum takes
    # any rank's). A NaN amax (a non-finite input) goes as +inf; a NaN error (not measured) as no value.
    table = torch.full((len(names), len(ROW_FIELDS) + 1), -math.inf, dtype=torch.float64)
    for row in rows:
        i = index[row["name"]]
        table[i, -1] = 1.0
        for j, field in enumerate(ROW_FIELDS):
            value = float(row.get(field, math.nan))
            if field == "amax" and field in row and math.isnan(value):
                value = math.inf
            if not math.isnan(value):
                table[i, j] = value
    table = table.to(device or torch.device("cpu"))
    torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX, group=group)
    agreed = []
    for name, values in zip(names, table.cpu().tolist()):
        if values[-1] == -math.inf:
            continue  # no rank read this layer
        row = {"name": name}
        row.update((field, v) for field, v in zip(ROW_FIELDS, values) if v != -math.inf)
        row.setdefault("error", math.nan)
        agreed.append(row)
    return agreed


class CollectiveAdaptiveMixedPrecision(AdaptiveMixedPrecision):
    """:class:`AdaptiveMixedPrecision` whose decisions are collective over a process group.

    Takes the controller's arguments, plus ``process_group`` (default: the
    world group). The scaler gets the group too (unless ``scaler_kwargs``
    names another), so every rank skips a step when any rank overflows, and
    the layers to promote are the union of what each rank saw. Create it on
    every rank with the same arguments, after ``init_process_group``.
    """

    def __init__(self, model: nn.Module, optimizer_or_optimizers, policy="auto", sample_inputs=None, *,
                 process_group=None, scaler_kwargs: Optional[dict] = None, **kwargs):
        group = process_group if process_group is not None else world_group()
        if group is None:
            raise RuntimeError("CollectiveAdaptiveMixedPrecision needs torch.distributed initialized with "
                               "several ranks (or a process_group); use AdaptiveMixedPrecision for one process")
        self.process_group = group
        scaler_kwargs = dict(scaler_kwargs or {})
        scaler_kwargs.setdefault("process_group", group)
        super().__init__(model, optimizer_or_optimizers, policy, sample_inputs, scaler_kwargs=scaler_kwargs,
                         **kwargs)

    def _candidate_layers(self) -> List[str]:
        return [name for name, _ in self.layers]

    def _comm_device(self) -> torch.device:
        return comm_device(self.process_group, self.device)

    def _overflowing_layers(self, step: Optional[int] = None) -> List[str]:
        mine = super()._overflowing_layers(step)
        islands = set(self.adjuster.islands)
        agreed = agree_on_layers(mine, self._candidate_layers(), self.process_group, self._comm_device())
        return [name for name in agreed if name not in islands]

    def _agree_skip(self, skip: torch.Tensor) -> torch.Tensor:
        # A non-finite loss on one rank skips the step on every rank (its gradients may be finite: a rank
        # that stepped alone would leave the replicas, or the shards, out of step). On the device for NCCL:
        # no host sync.
        flag = skip.to(self._comm_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
        return flag.to(skip.device, non_blocking=True)

    def _agree_fp8_rows(self, rows: List[dict]) -> List[dict]:
        return agree_on_rows(rows, list(self._fp8_watch.kinds), self.process_group, self._comm_device())

    def _measure_fp8(self, name: str, base: str, sample_inputs, overrides):
        # Each rank measures (under FSDP2 the captures run the sharded forward, a collective); rank 0's map is
        # the one every rank runs: gains timed on each GPU and errors on each rank's batches may differ.
        return self._rank_zeros(super()._measure_fp8(name, base, sample_inputs, overrides))

    def _agree_tuning(self, result):
        # Each rank runs every trial (their steps are collective under DDP and FSDP2); the step times each
        # measured may rank the candidates differently: rank 0's result, its table included, is applied on all.
        return self._rank_zeros(result)

    def _rank_zeros(self, value):
        return rank_zeros(self.process_group, self.device)(value)

    def _loss_finite(self, step: int) -> bool:
        # A NaN loss on one rank alone must count on every rank, or that rank alone would switch.
        flag = torch.tensor([int(super()._loss_finite(step))], dtype=torch.int32, device=self._comm_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self.process_group)
        return bool(flag.item())
