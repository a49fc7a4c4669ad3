"""The demo: TinyLM on a synthetic Markov language (:mod:`.model`), trained under fp32,
torch AMP and adaptive_amp side by side (:mod:`.run`, ``python -m adaptive_amp demo``).
"""

from .model import MarkovCorpus, TinyLM, TrainResult, train_lm
from .run import main

__all__ = ["MarkovCorpus", "TinyLM", "TrainResult", "main", "train_lm"]
