"""``bench scale --fsdp2``: the scale suite's model sharded by FSDP2 over the GPUs of one torchrun.

Each decoder layer and the root are sharded (``fully_shard``), as torchtitan shards a Llama. Every rank
trains on its own batches of the same stream (``--batch`` sequences a rank); tokens/s counts every rank's
tokens, peak memory is the largest rank's, and the losses are the mean over ranks. Per recipe:

* torch's and torchao's: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (float32
  weights and gradients sharded, bf16 all-gathered), bf16 autocast and AdamW as on one GPU; torchao's
  tensorwise recipe all-gathers its weights in float8 (``enable_fsdp_float8_all_gather``) and precomputes
  their scales after each step, as torchao advises (``--float8-all-gather off``: in bf16, to see what the
  float8 all-gather is worth);
* ours: the controller is :class:`~adaptive_amp.distributed.CollectiveAdaptiveMixedPrecision`; a bf16-pure
  recipe casts the model to bf16 before sharding (FSDP2 fixes each parameter's dtype when it shards it).

There is no batch search (an out-of-memory error on one rank would leave the others waiting in a
collective): give ``--batch``. The ``bf16-weights`` recipes do not run sharded. ``tune`` runs the choice of a
tuning made in one process (``--gpus`` makes it: the tuning itself does not run sharded).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional, Tuple

import torch

from .tuning import final_loss


def start(args, error) -> Tuple[int, int, torch.device]:
    """Join torchrun's process group: (rank, world size, this rank's device). `error(message)` refuses an
    argument (argparse's ``parser.error``); ranks after the first print nothing."""
    if "WORLD_SIZE" not in os.environ:
        error("--fsdp2 runs under torchrun, one process a GPU: torchrun --standalone --nproc_per_node=2 "
              "-m adaptive_amp bench scale --fsdp2 --batch N ...")
    if args.batch is None:
        error("--fsdp2: give --batch (sequences a step on each GPU); the batch search runs on one GPU only")
    if args.max_seconds is not None:
        error("--fsdp2: every rank runs --steps steps; --max-seconds could stop the ranks at different steps")
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if rank:
        sys.stdout = open(os.devnull, "w")  # rank 0 reports for all
    return rank, world, torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def skip_reason(recipe: str, tuned: bool = False) -> Optional[str]:
    """Why `recipe` does not run sharded (None: it does); `tuned`: a tuning made in one process comes with it."""
    if recipe == "tune" and not tuned:
        return ("the tuning runs in one process: --gpus N tunes on one GPU, then runs its choice sharded "
                "(or tune on one GPU and run the recipe it chose with --fsdp2)")
    if recipe.startswith("bf16-weights"):
        return ("FSDP2 keeps one dtype per sharded unit, and bf16-weights keeps float32 norms beside bf16 matmul "
                "weights; bf16-pure and torch's MixedPrecisionPolicy run sharded")
    return None


def torchao_config(config, recipe: str, all_gather: bool = True):
    """torchao's float8 config for a sharded run: float8 all-gather where torchao supports it (tensorwise), unless
    `all_gather` is False."""
    if all_gather and recipe.endswith("tensorwise"):
        return dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def shard(model: torch.nn.Module, recipe: str, ours: bool) -> None:
    """Shard each decoder layer and the root of the Llama `model`, in place, for `recipe`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if ours:
        if recipe.startswith("bf16-pure"):
            model.to(torch.bfloat16)
        mp = MixedPrecisionPolicy()
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def after_step(model: torch.nn.Module, recipe: str) -> None:
    """torchao's tensorwise float8 all-gather: the next step's weight scales, in one pass over the shards."""
    if recipe == "torchao-tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def agree(result: dict, world: int, device: torch.device) -> dict:
    """One rank's run as the whole run's: the losses averaged over ranks (each trained its own batches), the
    largest rank's peak memory. `device`: this rank's (NCCL reduces CUDA tensors only)."""
    losses = torch.tensor(result["losses"], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(losses)
    values = (losses / world).tolist()
    result.update(losses=values, final_loss=final_loss(values), first_loss=values[0], ranks=world)
    if result.get("peak_gib") is not None:
        peak = torch.tensor([result["peak_gib"]], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        result["peak_gib"] = float(peak.item())
    return result
