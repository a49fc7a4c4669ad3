"""Lightning's two packages, whichever are installed.

``pytorch_lightning`` (with ``lightning_fabric``) and the unified ``lightning``
(``lightning.pytorch``, ``lightning.fabric``) ship separate copies of the same
classes: ``lightning.pytorch.Trainer`` refuses a plugin derived from
``pytorch_lightning``'s ``Precision`` and the other way round. The plugins in
:mod:`adaptive_amp.integrations.lightning` derive from the ``Precision`` of
every package found here, so one plugin object goes into either Trainer.
"""

from __future__ import annotations

import importlib
from typing import List, Tuple

# (Trainer package, its Fabric package), in the order their bases come in the plugins' MRO.
_PACKAGES = (("pytorch_lightning", "lightning_fabric"), ("lightning.pytorch", "lightning.fabric"))


def _installed() -> List[Tuple[object, object]]:
    found = []
    for trainer_name, fabric_name in _PACKAGES:
        try:
            found.append((importlib.import_module(trainer_name), importlib.import_module(fabric_name)))
        except ImportError:
            continue
    if not found:
        raise ImportError("adaptive_amp.integrations.lightning needs PyTorch Lightning: pip install "
                          "pytorch-lightning (or the unified package: pip install lightning)")
    return found


_FOUND = _installed()

TRAINER_PRECISION_BASES = tuple(importlib.import_module(t.__name__ + ".plugins.precision").Precision
                                for t, _ in _FOUND)
FABRIC_PRECISION_BASES = tuple(importlib.import_module(f.__name__ + ".plugins").Precision for _, f in _FOUND)
LIGHTNING_MODULES = tuple(t.LightningModule for t, _ in _FOUND)
# A string enum whose members compare equal to the other package's ("norm" == "norm").
GradClipAlgorithmType = importlib.import_module(_FOUND[0][0].__name__ + ".utilities").GradClipAlgorithmType
PACKAGE_NAMES = tuple(t.__name__ for t, _ in _FOUND)

__all__ = ["FABRIC_PRECISION_BASES", "GradClipAlgorithmType", "LIGHTNING_MODULES", "PACKAGE_NAMES",
           "TRAINER_PRECISION_BASES"]
