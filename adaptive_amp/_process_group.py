"""The process group the package's collective decisions run over, and rank 0's values shared over it.

Its own module so that the controller's collaborators (the memory guard) and
the collective controller (``distributed``, which imports the controller)
can both ask for it without importing each other.
"""

from __future__ import annotations

import torch


def world_group():
    """The default process group when torch.distributed runs with several ranks, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def comm_device(group, device: torch.device) -> torch.device:
    """Where `group`'s collectives take their tensors: `device` for NCCL (CUDA tensors only), else the CPU."""
    return device if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu")


def rank_zeros(group, device: torch.device):
    """``agree(value) -> rank 0's value`` on every rank of `group` (pickled and broadcast: a collective, which
    every rank calls at the same point); without a group, the value itself."""
    if group is None:
        return lambda value: value
    src = torch.distributed.get_global_rank(group, 0)
    where = comm_device(group, device)

    def agree(value):
        box = [value]
        torch.distributed.broadcast_object_list(box, src=src, group=group, device=where)
        return box[0]
    return agree
