"""The process group the package's collective decisions run over.

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
