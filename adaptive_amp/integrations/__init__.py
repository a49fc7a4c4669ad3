"""Thin adapters from training frameworks to adaptive_amp, one module per framework.

* :mod:`adaptive_amp.integrations.lightning`: ``Trainer(plugins=[AdaptivePrecision("auto")])``
  and its Fabric twin ``AdaptiveFabricPrecision``.
* :mod:`adaptive_amp.integrations.accelerate`: ``attach(accelerator, model, optimizer, "auto")``
  after ``accelerator.prepare``.
* :mod:`adaptive_amp.integrations.transformers`: ``attach(trainer, "auto")`` before ``trainer.train()``.

Each module imports its framework when it is imported, never before, so
``import adaptive_amp`` stays free of them. The adapters translate the
framework's calls into :class:`adaptive_amp.AdaptiveMixedPrecision`'s
(``autocast``, ``backward``, ``step``, ``state_dict``); the decisions are the
controller's (collective under several processes: :mod:`adaptive_amp.distributed`).
"""
