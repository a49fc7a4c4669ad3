"""Checks of command-line values shared by the ``python -m adaptive_amp`` commands.

A bad value ends the command the way argparse ends it for a bad option: the usage, one line
``prog: error: --flag ...: why`` and exit status 2, before any work starts.
"""

from __future__ import annotations

import argparse
import importlib


def device(parser: argparse.ArgumentParser, text, flag: str = "--device"):
    """`text` as a torch.device that this process can use (a GPU only where torch sees one)."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        parser.error(f"{flag} {text!r}: not a device; use cpu or cuda (cuda:1 for another GPU)")
    if dev.type not in ("cpu", "cuda"):
        parser.error(f"{flag} {text!r}: use cpu or cuda (cuda:1 for another GPU)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"{flag} {text!r}: torch sees no CUDA GPU; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            parser.error(f"{flag} {text!r}: there are {torch.cuda.device_count()} GPU(s)")
    return dev


def at_least(parser: argparse.ArgumentParser, value, least, flag: str, what: str = ""):
    """`value` (None passes) if it is >= `least`, else the usage error."""
    if value is not None and not value >= least:
        parser.error(f"{flag} is {value}; pass at least {least}{' (' + what + ')' if what else ''}")
    return value


def positive(parser: argparse.ArgumentParser, value, flag: str, what: str = ""):
    """`value` (None passes) if it is a finite number > 0, else the usage error."""
    import math

    if value is not None and not (math.isfinite(value) and value > 0):
        parser.error(f"{flag} is {value}; pass a number > 0{' (' + what + ')' if what else ''}")
    return value


def factory(parser: argparse.ArgumentParser, spec: str, returns: str):
    """``--model package.module:factory`` -> the callable; `returns` says what it should return."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        parser.error(f"--model {spec!r}: expected package.module:factory (a function returning {returns})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        parser.error(f"--model {spec!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?")
    made = getattr(module, attr, None)
    if not callable(made):
        parser.error(f"--model {spec!r}: {module_name} has no callable {attr!r}")
    return made
