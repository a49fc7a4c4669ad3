"""``python -m adaptive_amp bench scale``: a Llama-3-8B-shaped model on one GPU, torch's and torchao's recipes
against ours.

The model is transformers' ``LlamaForCausalLM`` built on the GPU from its config with random weights
(hidden 4096, 32 layers, MLP 14336, 32 heads / 8 key-value heads, 2048 tokens a sequence, vocabulary 32000;
``--layers N`` keeps the first N layers' shapes: a slice of the same model that fits in less time), compiled
(``torch.compile``, inductor), and trained with AdamW (lr 1e-4, no warm-up, no clipping) on the zoo's
learnable synthetic token stream (arithmetic progressions: the next token follows from the two before it),
the same batches for every recipe and seed. Recipes (``--recipes``):

  torch-bf16          torch's bf16 autocast, fp32 weights, ``torch.optim.AdamW(fused=True)``
  torchao-tensorwise  torchao's float8 training (``convert_to_float8_training``, tensorwise scaling) on every
                      linear layer but the output head, under bf16 autocast, fused AdamW
  torchao-rowwise     the same with rowwise scaling
  tune                ``AdaptiveMixedPrecision(model, AdamW(fused=True), policy="tune")``: measured selection
                      among --tune-candidates on the model's own batches, then ``amp.train_step``
  bf16-weights        ``AdaptiveMixedPrecision(policy="bf16-weights")`` with ``adaptive_amp.optim.AdamW``
                      (stochastic rounding): the matmul weights in bf16, compute under bf16 autocast
  bf16-pure           ``AdaptiveMixedPrecision(policy="bf16-pure")``, the same optimizer: everything in bf16
  bf16+fp8            ``AdaptiveMixedPrecision(policy="bf16+fp8")`` with fused AdamW: bf16 autocast, and fp8
                      (torchao's float8 matmul) in each layer measured on this GPU to gain and tolerate it
  bf16-weights+fp8    the same fp8 layers over bf16-weights (``adaptive_amp.optim.AdamW``, stochastic rounding)
  bf16-pure+fp8       the same fp8 layers over bf16-pure, fp32 moments
  bf16-pure+bf16-moments+fp8
                      the same with the optimizer's moments in bf16

The torchao recipes are skipped, with the reason, when torchao is missing or the GPU has no float8 matmuls.

Each recipe runs at the largest batch that fits (a short search: 1, 2, 4, ... sequences until the peak grows
along a straight line, then the batch at which it reaches --memory-fraction of the GPU, checked by a try; see
largest_batch; a recipe with an fp8 map measures it at each try's batch, as its run does), or at --batch (one
number for every recipe, or ``recipe=N,...``). With --checkpointing auto,
a recipe that does not fit one sequence retries with activation checkpointing (transformers'
``gradient_checkpointing_enable``). Then --steps steps per seed:
tokens/s over the steps after warm-up and at steady state (the median of ten windows), peak memory, and the
final loss (the mean of the last 10% of the training losses; every batch is new).

On several GPUs (``torchrun --nproc_per_node=N -m adaptive_amp bench scale --fsdp2 --batch B``) each recipe
runs sharded by FSDP2, B sequences a GPU, its decisions collective (scale_fsdp2.py says how each recipe is
sharded). There is no batch search inside torchrun (a rank out of memory ends them all); ``--gpus N`` runs
from one plain command instead: one torchrun a try of the batch search and one a recipe, at its largest batch.
``tune`` does not run sharded (a trial's snapshot would write whole tensors into the shards): under ``--gpus``
the tuning runs first in a process of its own, the model unsharded on one GPU (--tune-batch), among the
candidates the sharded run trains (fp32, bf16, bf16+fp8 and the bf16-pure recipes), and its choice is then
searched and run sharded as the tuned run, as a user would tune a model that FSDP2 then trains.

Compiled (--compile): ``blocks`` (the default on a GPU) compiles each decoder layer (``module.compile()``; the
32 layers share one graph, so compiling takes the time of one layer, as torchtitan does), ``model`` the whole
model (``torch.compile(model)``), ``off`` none. Every recipe is compiled the same way. Each process starts
inductor before its first recipe's set-up (a small function compiled with its backward, and its compile workers
waited for; the time is printed and kept as ``inductor_start_seconds``, 0.0 for the process's later recipes):
every compiled run pays it once a process, so it is left out of each recipe's set-up, tuning and first step
alike.

A full comparison takes longer than one sitting may allow: with --json PATH and --resume, the runs already in
PATH are kept (a run of the same recipe, seed and batch is replaced), a recipe's batch search is reused, and
the verdict is drawn over all of them, so that the recipes, and with --seed S their seeds, can run one command
at a time on the same machine. Runs side by side (a seed a GPU: ``CUDA_VISIBLE_DEVICES=1 ... --seed 1 --json
s1.json``) write a report each, and ``--merge s0.json s1.json ...`` draws the verdict over them all; a tuned run
made apart from seed 0's tunes for itself, where one command's later seeds train seed 0's choice.

The verdict compares ours (the tuned run, else the fastest of our named recipes) with the fastest torch
recipe and the fastest torchao recipe: tokens/s (targets: >= 1.3x torch's, >= 1.1x torchao's), peak memory at
the same batch (target: <= 0.8x torch's, from the batch search's records or the runs themselves), and the
final loss against torch's seed spread. A larger batch trains on more tokens a step, so the loss is compared
at torch's batch, over runs of the same number of steps: torch's two seeds or more, and ours at that batch
(``--batch tune=3``, say, beside the run at its own largest batch).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..compile_cache import describe_graphs

TORCH_RECIPES = ("torch-bf16",)
TORCHAO_RECIPES = ("torchao-tensorwise", "torchao-rowwise")
FP8_RECIPES = ("bf16+fp8", "bf16-weights+fp8", "bf16-weights+bf16-moments+fp8", "bf16-pure+fp8",
               "bf16-pure+bf16-moments+fp8")
OUR_NAMED_RECIPES = ("bf16-weights", "bf16-pure", *FP8_RECIPES)
RECIPES = (*TORCH_RECIPES, *TORCHAO_RECIPES, "tune", *OUR_NAMED_RECIPES)
DEFAULT_RECIPES = ("torch-bf16", "torchao-tensorwise", "torchao-rowwise", "tune", "bf16-weights")


def is_ours(recipe: str) -> bool:
    """Whether `recipe` trains under our controller (not torch's or torchao's recipe)."""
    return recipe not in TORCH_RECIPES and recipe not in TORCHAO_RECIPES

#: Llama-3-8B's shape (vocabulary 32000, Llama 2's, as the zoo's Llamas).
FULL = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=32000, seq_len=2048)
#: --tiny: the same structure at widths a CPU trains in seconds.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, seq_len=32)

TARGET_VS_TORCH, TARGET_VS_TORCHAO, TARGET_MEMORY = 1.3, 1.1, 0.8
#: The most a tuning may cost at this size: a share of 10,000 steps at the chosen recipe's steady step time.
TARGET_TUNING = 0.02


def build(shape: dict, seed: int, device):
    """A ZooModel: LlamaForCausalLM of `shape`, random weights drawn from `seed` on `device`."""
    import transformers

    from ..zoo.model import ZooModel, causal_lm_batches, next_token_loss

    seq = shape["seq_len"]
    config = transformers.LlamaConfig(**{k: v for k, v in shape.items() if k != "seq_len"},
                                      max_position_embeddings=seq, attention_dropout=0.0, use_cache=False,
                                      tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed_all(seed)
        model = transformers.LlamaForCausalLM(config)
    model.train()
    return ZooModel("llama", "scale", model, causal_lm_batches(config.vocab_size, seq), ("input_ids",),
                    next_token_loss, seq, config)


def stream(shape: dict, batch: int, n: int, seed: int, device, rank: int = 0) -> list:
    """Seed `seed`'s n batches (rank `rank`'s, under --fsdp2), on the device before any timing (the same for
    every recipe)."""
    from ..zoo.model import causal_lm_batches

    make_batch = causal_lm_batches(shape["vocab_size"], shape["seq_len"])
    return [make_batch(batch, seed=seed * 1_000_003 + rank * 100_003 + k, device=device) for k in range(n)]


def skip_reason(recipe: str, device, sharded: bool = False, tuned: bool = False) -> Optional[str]:
    """Why `recipe` cannot run here (None: it can); `sharded`: under --fsdp2 (`tuned`: with a tuning made in
    one process, which --gpus makes)."""
    if sharded:
        from .scale_fsdp2 import skip_reason as sharded_skip_reason

        why = sharded_skip_reason(recipe, tuned)
        if why:
            return why
    if recipe in TORCHAO_RECIPES:
        from ..fp8 import fp8_unavailable

        why = fp8_unavailable(device)
        if why:
            return why
        try:
            from torchao.float8 import Float8LinearConfig  # noqa: F401
        except ImportError as exc:
            return f"this torchao has no float8 training ({exc})"
    return None


@dataclass
class Trainer:
    """One recipe applied to a fresh model: ``step(batch) -> loss``, and what to free afterwards."""

    recipe: str
    zm: object
    model: object  # the model the loss runs (compiled or not)
    step: object
    amp: object = None
    info: Dict[str, object] = field(default_factory=dict)

    def close(self):
        if self.amp is not None:
            self.amp.remove()
        self.zm = self.model = self.step = self.amp = None


def compile_model(zm, mode: str):
    """The model the loss runs under --compile `mode`: ``blocks`` compiles each decoder layer in place (one
    graph for all of them), ``model`` wraps the whole model, ``off`` leaves it eager."""
    if mode == "blocks":
        for layer in zm.model.model.layers:
            layer.compile()
        return zm.model
    return torch.compile(zm.model) if mode == "model" else zm.model


_INDUCTOR_STARTED: Dict[str, Optional[float]] = {}


def start_inductor(device) -> Optional[float]:
    """Seconds to start torch.compile's inductor in this process on `device` (its imports, its pool of compile
    workers and first kernels: a function with a backward compiled and run); 0.0 once started, None where it
    could not start (said once). Any compiled run pays this once a process, whatever its recipe. Started before
    a recipe's set-up, it falls in no recipe's measured seconds: else a tuning or an fp8 map, which compile first,
    would carry it and the same recipe run without them would not (its first step finds inductor started)."""
    key = str(device)
    if key in _INDUCTOR_STARTED:
        return None if _INDUCTOR_STARTED[key] is None else 0.0
    t0 = time.perf_counter()
    try:
        x = torch.ones(64, device=device, requires_grad=True)
        torch.compile(lambda t: (t * 2).sin().sum(), dynamic=False)(x).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - the runs compile (and report) for themselves
        print(f"   inductor did not start ahead of the recipes ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
        _INDUCTOR_STARTED[key] = None
        return None
    try:  # The workers start in the background, so the first compile may run without them: wait until they are up.
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.wait_pool_ready()
    except Exception:  # noqa: BLE001 - a torch without that pool: the compiles run in this process
        pass
    _INDUCTOR_STARTED[key] = time.perf_counter() - t0
    return _INDUCTOR_STARTED[key]


def make_trainer(recipe: str, shape: dict, seed: int, device, args, tune_batches=None, choice=None) -> Trainer:
    """`recipe` on a fresh model of seed `seed` (compiled as --compile says); `choice`: tune only this
    candidate (seed 0's choice, for the other seeds' loss spread). ``tune`` with --tuned PATH (under --gpus)
    runs the choice of the tuning made in one process, recorded in PATH, as the tuned run."""
    name, tuned = recipe, getattr(args, "tuned_record", None) if recipe == "tune" else None
    if tuned is not None:
        # (checkpointing is the batch search's to decide here: sharded, a recipe may fit without it)
        recipe = tuned["chosen"].removesuffix("+ckpt")
    started = start_inductor(device) if args.compile != "off" else None
    if started:
        print(f"   inductor started in {started:.1f} s, before any set-up (a compiled run pays it once a process)",
              flush=True)
    zm = build(shape, seed, device)
    if args.checkpointing_now:
        zm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cuda = device.type == "cuda"
    info: Dict[str, object] = {"parameters": zm.num_parameters(), "checkpointing": bool(args.checkpointing_now),
                               "compile": args.compile}
    if args.compile != "off":  # (0.0: started by an earlier recipe of this process; None: it could not start)
        info["inductor_start_seconds"] = None if started is None else round(started, 2)
    sharded, float8_gather = args.world > 1, False
    if recipe in TORCHAO_RECIPES:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe.split("-", 1)[1])
        if sharded:
            from .scale_fsdp2 import torchao_config

            config = torchao_config(config, recipe, getattr(args, "float8_all_gather", None) != "off")
            float8_gather = info["float8_all_gather"] = config.enable_fsdp_float8_all_gather
        # torchtitan's choice too: the output head stays in bf16 (its gradients feed every layer).
        convert_to_float8_training(zm.model, config=config, module_filter_fn=lambda mod, fqn: fqn != "lm_head"
                                   and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)
    if sharded:
        from .scale_fsdp2 import after_step, shard

        shard(zm.model, recipe, ours=is_ours(recipe))
        info["fsdp2"] = args.world
    model = compile_model(zm, args.compile)
    if not is_ours(recipe):
        opt = torch.optim.AdamW(zm.model.parameters(), lr=args.lr, fused=cuda)

        def step(batch):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = zm.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sharded:
                after_step(zm.model, recipe)
            return loss
        info["policy"] = "autocast bf16" + (f" + torchao float8 {recipe.split('-', 1)[1]}"
                                            if recipe in TORCHAO_RECIPES else "") + \
            (", FSDP2 bf16 params, fp32 reduce" if sharded else "") + \
            (", float8 all-gather" if float8_gather else "")
        return Trainer(recipe, zm, model, step, info=info)
    if sharded:
        from ..distributed import CollectiveAdaptiveMixedPrecision as AdaptiveMixedPrecision
    else:
        from .. import AdaptiveMixedPrecision

    t0 = time.perf_counter()
    if recipe == "tune":
        opt = torch.optim.AdamW(zm.model.parameters(), lr=args.lr, fused=cuda)
        amp = AdaptiveMixedPrecision(
            model, opt, policy="tune", progress=False, stats_every=_stats_every(args),
            tune=dict(batches=tune_batches, loss_fn=zm.loss, candidates=[choice] if choice else args.tune_candidates,
                      steps=args.tune_steps, rounds=1, timed_steps=args.tune_timed_steps,
                      progress=(lambda m: print(f"   {m}", flush=True)) if args.verbose else None))
        # Every trial and phase (where the tuning's seconds went), as bench tune keeps them.
        info.update(chosen=amp.tuning.recipe.name, tuning=amp.tuning.to_dict())
        print(amp.tuning.table(), flush=True)
    else:
        base = recipe[:-len("+fp8")] if recipe in FP8_RECIPES else recipe
        if base in ("bf16", "fp32"):
            opt = torch.optim.AdamW(zm.model.parameters(), lr=args.lr, fused=cuda)
        else:
            from ..optim import AdamW

            opt = AdamW(zm.model.parameters(), lr=args.lr, stochastic_rounding=True,
                        moment_dtype=torch.bfloat16 if base.endswith("+bf16-moments") else torch.float32)
        policy = base.replace("+bf16-moments", "") + ("+fp8" if recipe in FP8_RECIPES else "")
        if policy == "bf16":  # (the name alone is ambiguous as a policy: here bf16 autocast over float32 weights)
            policy = "params=float32,compute=bfloat16"
        # Each layer's inputs are captured from the eager model; each gain is timed as its layer runs (compiled in
        # a compiled block, the head beside the blocks eagerly: the controller's default).
        fp8 = dict(batches=(tune_batches or stream(shape, 1, 2, 0, device, args.rank))[:2],
                   run=lambda _, batch: zm.loss(zm.model, batch)) if recipe in FP8_RECIPES else None
        amp = AdaptiveMixedPrecision(model, opt, policy=policy, progress=False, fp8=fp8,
                                     stats_every=_stats_every(args))
        if fp8 is not None:
            info["fp8_layers"] = sum(kind.startswith("fp8-") for kind in amp.adjuster.layer_kinds.values())
            info["fp8_measured"] = next((r for r in amp.policy.reasons if r.startswith("fp8: ") and
                                         " measured in " in r), None)
            print(f"   {recipe}: {info['fp8_layers']} layers in fp8; {info['fp8_measured']}", flush=True)
    info.update(tuning_seconds=round(time.perf_counter() - t0, 2), policy=str(amp.policy),
                stats_every=amp.monitor.stats_every)
    if tuned is not None:
        info.update(chosen=tuned["chosen"], tuned_batch=tuned["batch"])
        if seed == 0:  # (the record once: the other seeds train the same choice)
            info["tuning"] = tuned["tuning"]
    return Trainer(name, zm, model, lambda batch: amp.train_step(lambda: zm.loss(model, batch)), amp, info)


#: Steps between statistics steps in a batch search's tries: every step, so that each try's peak is a statistics
#: step's with the optimizer's state (every step after the search's first). Such a step measures every layer, in a
#: compiled graph of its own, and with fp8 layers copies rows of each fp8 input for the guard; on a Llama-3-8B it
#: peaks as an ordinary step (bench/RESULTS.md, "Statistics steps and the peak"), on a model whose statistics graph
#: saves more for the backward higher. A run's first statistics step, its first step, comes before that state, and
#: the next after --stats-every steps (200 by default). A torchrun's try then compiles the statistics graph alone.
SEARCH_STATS_EVERY = 1


def _reusable_search(recipe: str, search: dict, path: str, sharded: bool = False) -> bool:
    """Whether the batch search `search`, kept in the report at `path` (--resume), found a batch that holds for
    `recipe`: ours searched with a statistics step in its tries (SEARCH_STATS_EVERY, recorded with it) and, on
    one GPU, each try's fp8 map measured at its batch (``fp8_map`` recorded; a sharded try is a process of its
    own, which always did); said where not. Torch's and torchao's take neither."""
    if not search.get("batch"):
        return False
    if not is_ours(recipe):
        return True
    if search.get("stats_every") != SEARCH_STATS_EVERY:
        why = "tried no statistics step after the optimizer's state existed"
    elif not sharded and "fp8_map" not in search and (recipe == "tune" or _mapped_recipe(recipe) is not None):
        why = "measured its tries' fp8 map at one sequence, not at each try's batch"
    else:
        return True
    print(f"-- {recipe}: the batch search in {path} {why}; searching again (its runs at batch {search['batch']} "
          "stay in the report)", flush=True)
    return False


def _search_record(recipe: str, record: dict) -> dict:
    """A batch search's record for the report, with the statistics cadence of its tries where it is ours."""
    return {**record, "stats_every": SEARCH_STATS_EVERY} if is_ours(recipe) else record


def _stats_every(args) -> Optional[int]:
    """The controller's stats_every for our recipes: --stats-every, None for the controller's default."""
    return getattr(args, "stats_every", None)


def _free(device):
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


#: How far apart the growths of the peak a sequence over two doublings of the batch search may be (a fraction of
#: the later) for the peak to be taken as a straight line in the batch.
STRAIGHT = 0.25


def largest_batch(measure, max_batch: int, limit: Optional[float] = None) -> int:
    """The largest batch up to `max_batch` that fits (0: not even 1), by a short search. ``measure(batch) ->
    (fits, peak)``: whether a try at that batch fits, and its peak memory (None: not known, or out of memory).

    The batch doubles (1, 2, 4, ..., then `max_batch` itself) until one does not fit, then one batch between
    the last that fit and the first that did not is tried. With `limit` (the most a peak may be, in the peaks'
    unit), once the peak grew by about as much a sequence (within STRAIGHT) from the batch before last to the
    last as from the one before that, the next try is the batch at which that line reaches `limit`
    (:func:`_extrapolated`). The state is the same at every batch and the activations grow with it, so past the
    smallest batches a step's peak grows linearly; at the smallest, something else can set it (H200, the 8B model
    sharded over two GPUs: 55.8 and 60.1 GiB at 1 and 2 sequences a GPU, then 9.3 GiB a sequence: the line
    through 1 and 2 pointed at 19, where 9 was the largest)."""
    peaks: Dict[int, Optional[float]] = {}

    def fits(b: int) -> bool:
        ok, peaks[b] = measure(b)
        return ok

    good, bad, b = 0, None, 1
    while b <= max_batch:
        if not fits(b):
            bad = b
            break
        good = b
        known = sorted(k for k in peaks if peaks[k] is not None and k <= good)[-3:]
        if limit is not None and len(known) == 3:
            (a, m, z) = known
            before, last = (peaks[m] - peaks[a]) / (m - a), (peaks[z] - peaks[m]) / (z - m)
            if last > 0 and abs(last - before) <= STRAIGHT * last:
                return _extrapolated(fits, peaks, (m, z), good, max_batch, limit)
        b = max_batch if b < max_batch < 2 * b else 2 * b
    if good and bad and bad - good > 1 and fits((good + bad) // 2):
        good = (good + bad) // 2
    return good


def _extrapolated(fits, peaks: dict, pair: Tuple[int, int], good: int, max_batch: int, limit: float) -> int:
    """largest_batch from the line through the peaks of `pair` (two batches that fit, the later at `good`, its
    peak the higher): try the batch where the line reaches `limit`; after a try that fits, the line through the
    two largest batches that fit (while the peak still grows between them); after one that does not, the batch
    below it, or half way when more than four batches lie between; until the next try would be a batch known
    to fit."""
    upper = None  # the smallest batch known not to fit
    while True:
        a, b = pair
        slope = (peaks[b] - peaks[a]) / (b - a)
        guess = min(max_batch, b + int((limit - peaks[b]) // slope))
        if upper is not None and guess >= upper:  # the line says it fits where a try did not: below, or half way
            guess = upper - 1 if upper - good <= 4 else (good + upper) // 2
        if guess <= good:
            return good
        if not fits(guess):
            upper = guess
            continue
        good = guess
        if peaks.get(guess) is not None and peaks[guess] > peaks[b]:
            pair = (b, guess)


def _mapped_recipe(recipe: str, chosen: str = "") -> Optional[str]:
    """The recipe whose fp8 map a batch search measures at each try's batch (None: no fp8 map): `recipe` itself,
    or for ``tune`` the tuning's choice `chosen`, without "+ckpt"."""
    name = chosen.removesuffix("+ckpt") if recipe == "tune" else recipe
    return name if name in FP8_RECIPES else None


def search_batch(recipe: str, shape: dict, device, args) -> dict:
    """The largest batch at which `recipe` fits: {"batch", "tried": {batch: peak GiB or "out of memory"},
    "fp8_map": "each try's" or "none"} (with "error" where building or tuning ran out of memory).

    A recipe with an fp8 map (or a tuning that chose one) builds each try anew, its map measured on that try's
    batches, as the run at that batch measures its own: the map depends on the batch (more layers gain from fp8
    at more tokens), and with them the memory (Llama-3-8B on an H200: 96 layers in fp8 at one sequence, 224 at
    eight)."""
    capacity = torch.cuda.get_device_properties(device).total_memory
    limit = args.memory_fraction * capacity
    tried: Dict[int, object] = {}
    seq = shape["seq_len"]
    # (every step of a try a statistics step: from the search's second on, with the optimizer's state)
    settings = argparse.Namespace(**{**vars(args), "stats_every": SEARCH_STATS_EVERY})
    trainer, mapped = None, _mapped_recipe(recipe)
    try:
        if recipe == "tune":  # tuned once at one sequence a step; the search then grows the choice's batch
            trainer = make_trainer(recipe, shape, 0, device, settings, stream(shape, 1, 8, 0, device))
            chosen = trainer.info["chosen"]
            mapped = _mapped_recipe(recipe, chosen)
            if mapped is not None and chosen.endswith("+ckpt"):
                settings.checkpointing_now = True
        elif mapped is None:
            trainer = make_trainer(recipe, shape, 0, device, settings)

        def measure(b: int):
            nonlocal trainer
            batches, peak = stream(shape, b, 2, 0, device), None
            try:
                if mapped is not None:  # this try's own model, its fp8 map measured on this try's batches
                    if trainer is not None:
                        trainer.close()
                        trainer = None
                    _free(device)  # (also what a try that ran out of memory while building left)
                    trainer = make_trainer(mapped, shape, 0, device, settings, batches)
                torch.cuda.reset_peak_memory_stats(device)
                for batch in batches:
                    trainer.step(batch)
                _sync(device)
                peak = torch.cuda.max_memory_allocated(device)
            except torch.OutOfMemoryError:
                pass  # (freed below, once the error's traceback no longer holds the try's tensors)
            finally:
                del batches
            if peak is None:
                tried[b] = "out of memory"
                if trainer is not None:
                    trainer.zm.model.zero_grad(set_to_none=True)  # what the failed step left, before the next try
                gc.collect()
                torch.cuda.empty_cache()
                return False, None
            tried[b] = round(peak / 2**30, 2)
            print(f"   {recipe}: batch {b} ({b * seq} tokens) peaks at {peak / 2**30:.1f} GiB"
                  + (f" ({trainer.info['fp8_layers']} layers in fp8)" if mapped is not None else ""), flush=True)
            return peak <= limit, peak / 2**30

        return {"batch": largest_batch(measure, args.max_batch, limit / 2**30), "tried": tried,
                "fp8_map": "each try's" if mapped is not None else "none"}
    except torch.OutOfMemoryError as exc:  # building or tuning did not fit
        return {"batch": 0, "tried": tried, "error": f"out of memory before a step ran: {str(exc)[:600]}"}
    finally:
        if trainer is not None:
            trainer.close()
        trainer = None
        _free(device)


def run(recipe: str, shape: dict, batch: int, seed: int, device, args, choice=None) -> dict:
    """`--steps` steps of `recipe` at `batch` from seed `seed`'s weights on seed `seed`'s batches."""
    from .tuning import timed_loop

    trainer = batches = None
    began = time.perf_counter()
    deadline = began + args.max_seconds if args.max_seconds is not None else None
    try:
        batches = stream(shape, batch, args.steps, seed, device, args.rank)
        trainer = make_trainer(recipe, shape, seed, device, args, batches[:8], choice)
        setup = time.perf_counter() - began - (trainer.info.get("inductor_start_seconds") or 0.0)
        print(f"   {recipe}: built and set up in {setup:.0f} s; training", flush=True)
        r = timed_loop(trainer.step, batches, args.steps, device, batch * shape["seq_len"] * args.world, deadline)
        if args.world > 1:
            from .scale_fsdp2 import agree

            r = agree(r, args.world, device)
        r.update(trainer.info, recipe=recipe, seed=seed, batch=batch, steps_asked=args.steps)
        peak = f"peak {r['peak_gib']:.1f} GiB, " if r["peak_gib"] is not None else ""
        print(f"   {recipe}: {r['steps']} steps, {r['steady_tokens_per_s']:.0f} tokens/s at steady state, {peak}"
              f"final loss {r['final_loss']:.4f} (first step "
              f"{r['first_step_seconds'] or 0:.0f} s; {time.perf_counter() - began:.0f} s in all)", flush=True)
        if trainer.amp is not None:
            r["events"] = [e.to_dict() for e in trainer.amp.events]
        return r
    except torch.OutOfMemoryError as exc:
        if args.world > 1:
            raise  # (the other ranks wait in a collective for this one: torchrun stops them all)
        return {"recipe": recipe, "seed": seed, "batch": batch, "error": f"out of memory: {str(exc)[:600]}"}
    finally:
        if trainer is not None:
            trainer.close()
        trainer = batches = None
        _free(device)


# ------------------------------------------------------------------------------------- FSDP2 from one command

#: The options a run launched by --gpus takes as given here: the model's shape and how it trains.
_FORWARDED = (("--layers", "layers"), ("--hidden", "hidden"), ("--mlp", "mlp"), ("--heads", "heads"),
              ("--kv-heads", "kv_heads"), ("--seq", "seq"), ("--vocab", "vocab"), ("--lr", "lr"),
              ("--compile", "compile"), ("--device", "device"), ("--checkpointing", "checkpointing"))
#: Steps of a batch search's try under --gpus (the first compiles; the second shows the steady peak).
SEARCH_STEPS = 3


def _forwarded(args) -> List[str]:
    """The options of this command that a process it starts takes as given here (_FORWARDED, --tiny, --verbose)."""
    out: List[str] = []
    for flag, dest in _FORWARDED:
        value = getattr(args, dest)
        if value is not None:
            # (each process takes its own GPU: the device's type, not a driver-side index such as cuda:1)
            out += [flag, torch.device(value).type if dest == "device" else str(value)]
    return out + (["--tiny"] if args.tiny else []) + (["--verbose"] if args.verbose else [])


def _sharded_command(args, recipe: str, batch: int, steps: int, path: str, *extra: str,
                     stats_every: Optional[int] = None) -> List[str]:
    """torchrun over --gpus processes of this machine: `recipe` sharded at `batch`, its report written to `path`;
    the options that are one recipe's go to its runs alone: --float8-all-gather to torchao-tensorwise's,
    `stats_every` (default --stats-every) to ours. `extra` last, so that its --checkpointing (the search's) is
    the one that counts."""
    own = []
    gather, stats_every = getattr(args, "float8_all_gather", None), stats_every or _stats_every(args)
    if gather is not None and recipe == "torchao-tensorwise":
        own += ["--float8-all-gather", gather]
    if stats_every is not None and is_ours(recipe):
        own += ["--stats-every", str(stats_every)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
            "-m", "adaptive_amp", "bench", "scale", "--fsdp2", "--recipes", recipe, "--batch", f"{recipe}={batch}",
            "--steps", str(steps), "--json", path, *_forwarded(args), *own, *extra]


def tune_only(args, shape: dict, device) -> int:
    """--tune-only PATH: the tuning alone, in this process on `device`, at --batch tune=N sequences (default 1;
    what tune_alone passes for --tune-batch), on seed 0's batches; its choice and record written to PATH for the
    tuned run's sharded torchruns (--tuned PATH)."""
    batch = (args.batch or {}).get("tune", 1)
    args.checkpointing_now = args.checkpointing == "on"
    trainer = make_trainer("tune", shape, 0, device, args, stream(shape, batch, 8, 0, device))
    try:
        with open(args.tune_only, "w") as f:
            json.dump({"chosen": trainer.info["chosen"], "tuning": trainer.info["tuning"], "batch": batch},
                      f, indent=1, default=str)
    finally:
        trainer.close()
    return 0


def _tuned_record(args, error) -> dict:
    """--tuned PATH: the record of the tuning whose choice the tuned run trains sharded; `error(message)` refuses
    it where it is not used (--fsdp2, --recipes tune) or cannot be read, or its choice cannot run sharded."""
    if not args.fsdp2 or args.recipes != ["tune"]:
        error("--tuned is what --gpus gives the sharded runs of tune: it needs --fsdp2 and --recipes tune alone")
    try:
        with open(args.tuned) as f:
            record = json.load(f)
        chosen, batch = record["chosen"], int(record["batch"])
        if "tuning" not in record:
            raise KeyError("tuning")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        error(f"--tuned {args.tuned}: not a tuning's record ({type(exc).__name__}: {exc})")
    if not isinstance(chosen, str) or chosen.removesuffix("+ckpt") not in SHARDED_CHOICES:
        error(f"--tuned {args.tuned}: the tuning chose {chosen!r}; the sharded run trains "
              f"{', '.join(SHARDED_CHOICES)} (each also +ckpt)")
    return dict(record, batch=batch)


def _tuning_batch(args) -> int:
    """Sequences a step the tuning under --gpus runs at: --tune-batch, else one (as a batch search on one GPU
    tunes; --batch is the sharded run's, a GPU's share of a model it does not hold whole)."""
    return args.tune_batch or 1


#: The recipes a tuned run under --gpus may choose, by candidate name (less "+ckpt": the sharded batch search
#: decides checkpointing): those the sharded run trains.
SHARDED_CHOICES = ("fp32", "bf16", "bf16+fp8", "bf16-pure", "bf16-pure+bf16-moments", "bf16-pure+fp8",
                   "bf16-pure+bf16-moments+fp8")


def _sharded_candidates(args) -> Tuple[List[str], Dict[str, str]]:
    """(the tuning's candidates that run sharded, {candidate left out: why})."""
    from .scale_fsdp2 import skip_reason as sharded_skip_reason

    kept, left_out = [], {}
    for c in args.tune_candidates:
        why = sharded_skip_reason(c.removesuffix("+ckpt")) or (
            None if c.removesuffix("+ckpt") in SHARDED_CHOICES else
            f"the sharded run trains {', '.join(SHARDED_CHOICES)} (each also +ckpt)")
        if why:
            left_out[c] = why
        else:
            kept.append(c)
    return kept, left_out


def _tuning_settings(args) -> dict:
    """What a tuning under --gpus was made with: one kept in a report is reused only where these are the same."""
    return {"batch": _tuning_batch(args), "candidates": _sharded_candidates(args)[0], "steps": args.tune_steps,
            "timed_steps": args.tune_timed_steps, "compile": args.compile, "checkpointing": args.checkpointing,
            "lr": args.lr}


def tune_alone(args, tmp: str) -> dict:
    """--gpus with tune: the tuning, in a process of its own on one GPU of this machine, the model unsharded,
    among the candidates that run sharded (_sharded_candidates); its record (``--tune-only``) with the settings
    it was made with. RuntimeError when it fails."""
    import subprocess

    candidates, left_out = _sharded_candidates(args)
    if not candidates:
        raise RuntimeError("none of the tuning's candidates runs sharded: " +
                           "; ".join(f"{c}: {why}" for c, why in left_out.items()))
    path = os.path.join(tmp, "tuning.json")
    command = [sys.executable, "-m", "adaptive_amp", "bench", "scale", "--tune-only", path, "--recipes", "tune",
               "--batch", f"tune={_tuning_batch(args)}", "--tune-candidates", ",".join(candidates),
               "--tune-steps", str(args.tune_steps), "--tune-timed-steps", str(args.tune_timed_steps),
               *_forwarded(args)]
    print(f"-- tune: tuning in one process, unsharded on one GPU, at batch {_tuning_batch(args)}, among "
          f"{', '.join(candidates)}" + "".join(f"; {c} left out: {why}" for c, why in left_out.items()), flush=True)
    done = subprocess.run(command)
    if done.returncode != 0:
        raise RuntimeError(f"the tuning failed (exit {done.returncode}; its output is above)")
    with open(path) as f:
        return {**json.load(f), "settings": _tuning_settings(args)}


def run_sharded(args, report_path: str, device, capacity_gib: Optional[float], earlier: dict,
                keep=None) -> dict:
    """--gpus N: each recipe sharded by FSDP2 over N GPUs of this machine, each in its own torchrun (a rank that
    runs out of memory ends them all), at its largest batch a GPU: searched as on one GPU (:func:`largest_batch`,
    a try of SEARCH_STEPS steps that fits where it ends well and every rank's peak stays under --memory-fraction
    of `capacity_gib`, None: no limit; a try whose output says "out of memory", CUDA's or NCCL's, does not fit),
    with --checkpointing auto again with checkpointing where not one sequence fits, unless --batch names the
    batch or `earlier` (the searches of the report resumed) holds one over as many GPUs; then run for --steps
    (and --seeds or --seed) into the report at `report_path`. Returns {"search", "skipped", "failed", "ran"}:
    the searches made, the recipes that cannot run (why), the runs that failed (the end of their output), and
    whether any run wrote the report. A try that fails for another reason than memory is a failed run.
    `keep(search)`, when given, is called with the searches (and tunings) made so far as each is made, and says
    whether it wrote them into the report at `report_path` (then the runs add to it): under --resume a command
    cut short, by a time limit say, leaves them for the next."""
    import subprocess
    import tempfile

    out = {"search": {}, "skipped": {}, "failed": {}, "ran": False}
    resume = bool(args.resume)

    def kept() -> bool:
        return keep is not None and keep(out["search"])

    limit = None if capacity_gib is None else args.memory_fraction * capacity_gib
    seeds = ["--seed", str(args.seed)] if args.seed is not None else ["--seeds", str(args.seeds)]
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes:
            why = skip_reason(recipe, device, sharded=True, tuned=True)
            if why:
                out["skipped"][recipe] = why
                print(f"-- {recipe}: skipped: {why}", flush=True)
                continue
            checkpointing, batch = args.checkpointing == "on", None
            given = None if args.batch is None else args.batch.get(recipe, args.batch.get("*"))
            found = earlier.get(recipe, {})
            try:
                tuned: List[str] = []  # (--tuned PATH: the tuning whose choice a tuned recipe's torchruns run)
                if recipe == "tune":
                    tuning = found.get("tuned")
                    if not tuning or tuning.get("settings") != _tuning_settings(args):
                        tuning = tune_alone(args, tmp)
                        if tuning["chosen"] != found.get("tuned", {}).get("chosen"):
                            found = {}  # (a search of another choice's batch)
                    tuned = ["--tuned", os.path.join(tmp, "tuned.json")]
                    with open(tuned[1], "w") as f:
                        json.dump(tuning, f, default=str)
                    out["search"][recipe] = {**found, "tuned": tuning}
                    resume = kept() or resume
                batch = given
                if batch is None and _reusable_search(recipe, found, args.json, sharded=True) and \
                        found.get("gpus") == args.gpus:
                    batch, checkpointing = found["batch"], bool(found.get("checkpointing"))
                    print(f"-- {recipe}: batch {batch} a GPU, from the batch search already in {args.json}",
                          flush=True)
                if batch is None:
                    tried: Dict[int, object] = {}

                    def measure(b: int, recipe=recipe, tried=tried):
                        path = os.path.join(tmp, f"{recipe}-{b}.json")
                        flags = ["--checkpointing", "on" if checkpointing else "off"]
                        done = subprocess.run(_sharded_command(args, recipe, b, SEARCH_STEPS, path, *flags, *tuned,
                                                               stats_every=SEARCH_STATS_EVERY),
                                              capture_output=True, text=True)
                        printed = done.stdout + done.stderr
                        if done.returncode != 0:
                            if "OutOfMemoryError" not in printed and "out of memory" not in printed:
                                raise RuntimeError(f"the try at batch {b} failed:\n{printed[-3000:]}")
                            tried[b] = "out of memory"
                            print(f"   {recipe}: batch {b} a GPU runs out of memory", flush=True)
                            return False, None
                        with open(path) as f:
                            runs = json.load(f)["runs"]
                        peak = runs[0].get("peak_gib") if runs else None
                        tried[b] = peak
                        print(f"   {recipe}: batch {b} a GPU" + (f" peaks at {peak:.1f} GiB" if peak is not None
                                                                 else " runs"), flush=True)
                        return bool(runs) and (peak is None or limit is None or peak <= limit), peak

                    print(f"-- {recipe}: searching the largest batch a GPU that fits, one torchrun a try",
                          flush=True)
                    batch = largest_batch(measure, args.max_batch, limit)
                    if batch == 0 and args.checkpointing == "auto":
                        print(f"-- {recipe}: one sequence a GPU does not fit; again with activation checkpointing",
                              flush=True)
                        checkpointing = True
                        tried.clear()
                        batch = largest_batch(measure, args.max_batch, limit)
                    out["search"][recipe] = _search_record(recipe, {"batch": batch, "tried": tried,
                                                                    "gpus": args.gpus,
                                                                    "checkpointing": checkpointing})
                    if tuned:
                        out["search"][recipe]["tuned"] = tuning
                    resume = kept() or resume
                    if batch == 0:
                        out["skipped"][recipe] = "not even one sequence a GPU fits"
                        print(f"-- {recipe}: {out['skipped'][recipe]}", flush=True)
                        continue
                print(f"-- {recipe}: batch {batch} a GPU, {args.steps} steps, sharded over {args.gpus} GPUs",
                      flush=True)
                done = subprocess.run(_sharded_command(
                    args, recipe, batch, args.steps, report_path, *seeds, *tuned,
                    "--checkpointing", "on" if checkpointing else "off", *(["--resume"] if resume else [])))
                if done.returncode != 0:
                    raise RuntimeError(f"the run at batch {batch} failed (exit {done.returncode}; its output is above)")
            except RuntimeError as exc:
                out["failed"][recipe] = {"batch": batch or given or 0, "error": str(exc)}
                print(f"-- {recipe}: {exc}", flush=True)
                continue
            out["ran"] = resume = True  # (the next recipe's runs join this one's report)
    return out


def _main_sharded(args, shape: dict, device, error) -> int:
    """main() under --gpus: run_sharded, then the report's table and verdict, its searches, skips and failures in
    it."""
    import tempfile

    if args.max_seconds is not None:
        error("--gpus: every rank runs --steps steps; --max-seconds could stop the ranks at different steps")
    if device.type == "cuda" and torch.cuda.device_count() < args.gpus:
        error(f"--gpus {args.gpus}: torch sees {torch.cuda.device_count()} GPU(s) here")
    earlier = _resumed(args.json, shape, args.gpus, error).get("search", {}) if args.resume else {}
    capacity = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    with tempfile.TemporaryDirectory() as tmp:
        path = args.json or os.path.join(tmp, "scale.json")

        def keep(search: dict) -> bool:
            if not (args.json and args.resume):  # (without --resume the report is the runs' of this command)
                return False
            report = _resumed(path, shape, args.gpus, error) or _new_report(args, shape, device, args.gpus)
            report["search"].update(search)
            _write_report(path, report)
            return True

        done = run_sharded(args, path, device, capacity, earlier, keep)
        if not done["ran"] and not (args.resume and os.path.exists(path)):
            why = {**done["skipped"], **{k: v["error"] for k, v in done["failed"].items()}}
            print("No recipe ran. " + " ".join(f"{k}: {v}." for k, v in why.items()), flush=True)
            return 1
        with open(path) as f:
            report = json.load(f)
        report["search"].update(done["search"])
        report["skipped"].update(done["skipped"])
        report["runs"] += [{"recipe": recipe, "seed": args.seed or 0, "batch": failed["batch"],
                            "error": failed["error"][:600]} for recipe, failed in done["failed"].items()]
        report["verdict"] = verdict(report)
        if args.json:
            _write_report(path, report)
    return _show(report)


# ------------------------------------------------------------------------------------------------ report


def _best(runs: List[dict], names, search: Optional[dict] = None) -> Optional[dict]:
    """The fastest seed-0 run (steady tokens/s) among `names`: of a recipe whose batch `search` (the report's)
    found, its runs at that batch where there are any (a search made again leaves the runs at the batch it
    replaced in the report); of torchao's tensorwise recipe, its runs as torchao advises (float8 all-gather,
    where sharded) where there are any."""
    found = [r for r in runs if r["recipe"] in names and r.get("seed") == 0 and "error" not in r]

    def standing(r):  # (at its recipe's searched batch first, then as torchao advises)
        return r.get("batch") == (search or {}).get(r["recipe"], {}).get("batch"), \
            r.get("float8_all_gather") is not False
    top = {}
    for r in found:
        top[r["recipe"]] = max(top.get(r["recipe"], standing(r)), standing(r))
    # (in the report's order: of runs equally fast, the first)
    return max((r for r in found if standing(r) == top[r["recipe"]]), key=lambda r: r["steady_tokens_per_s"],
               default=None)


def _peak_at(report: dict, recipe: str, batch: int) -> Optional[float]:
    """`recipe`'s peak GiB at `batch`: from its runs, else from its batch search."""
    for r in report["runs"]:
        if r["recipe"] == recipe and r.get("batch") == batch and r.get("peak_gib") is not None:
            return r["peak_gib"]
    tried = report["search"].get(recipe, {}).get("tried", {})
    peak = tried.get(batch, tried.get(str(batch)))  # (a report read back from JSON has string keys)
    return peak if isinstance(peak, float) else None


def verdict(report: dict) -> List[str]:
    """What the runs show, as sentences, against the targets."""
    runs, lines = report["runs"], []
    search = report.get("search")
    torch_best = _best(runs, TORCH_RECIPES, search)
    torchao_best = _best(runs, TORCHAO_RECIPES, search)
    ours = _best(runs, ("tune",), search) or _best(runs, OUR_NAMED_RECIPES, search)
    for name, why in report["skipped"].items():
        lines.append(f"{name} did not run: {why}.")
    for r in runs:
        if "error" in r:
            lines.append(f"{r['recipe']} (seed {r['seed']}, batch {r['batch']}) failed: {r['error']}")
    for r in runs:
        if r.get("stopped_early"):
            lines.append(f"{r['recipe']} (seed {r['seed']}) stopped after {r['steps']} of "
                         f"{r.get('steps_asked', report['args']['steps'])} steps (--max-seconds): its final loss is "
                         "not comparable.")
    if ours is None:
        return lines + ["No run of ours finished: nothing to compare."]
    what = f"ours ({ours['recipe']}" + (f", chose {ours['chosen']}" if "chosen" in ours else "") + \
        f", batch {ours['batch']})"
    if torch_best is not None:
        ratio = ours["steady_tokens_per_s"] / torch_best["steady_tokens_per_s"]
        lines.append(f"Speed: {what} trained at {ratio:.2f}x the tokens/s of torch's bf16 autocast (batch "
                     f"{torch_best['batch']}): {'meets' if ratio >= TARGET_VS_TORCH else 'misses'} the "
                     f"{TARGET_VS_TORCH}x target.")
        same = torch_best["batch"]
        mine, theirs = _peak_at(report, ours["recipe"], same), _peak_at(report, torch_best["recipe"], same)
        if mine is not None and theirs:
            m = mine / theirs
            lines.append(f"Memory at torch's batch ({same}): {mine:.1f} against {theirs:.1f} GiB, {m:.2f}x: "
                         f"{'meets' if m <= TARGET_MEMORY else 'misses'} the {TARGET_MEMORY}x target.")
        elif report["device"] == "cpu":
            lines.append("Memory: not measured on the CPU.")
        else:
            lines.append(f"Memory: ours was not measured at torch's batch ({same}); run both with --batch {same}.")
    cadence = ours.get("stats_every")
    if cadence and ours.get("peak_gib") is not None and ours["steps"] <= cadence:
        lines.append(f"Peaks: ours ran {ours['steps']} steps, none of them a statistics step after the optimizer's "
                     f"state existed (one every {cadence} steps, --stats-every), which measures every layer: its "
                     "peak memory leaves them out.")
    if torchao_best is not None:
        ratio = ours["steady_tokens_per_s"] / torchao_best["steady_tokens_per_s"]
        # (A sharded tensorwise run with --float8-all-gather off is not torchao's recipe as advised: named.)
        bf16_gather = torchao_best["recipe"].endswith("tensorwise") and torchao_best.get("float8_all_gather") is False
        lines.append(f"Against torchao's best ({torchao_best['recipe']}, batch {torchao_best['batch']}"
                     f"{', its weights all-gathered in bf16: --float8-all-gather off' if bf16_gather else ''}): "
                     f"{ratio:.2f}x its tokens/s: {'meets' if ratio >= TARGET_VS_TORCHAO else 'misses'} the "
                     f"{TARGET_VS_TORCHAO}x target.")
    if report["device"] != "cpu" and not report["search"].get(ours["recipe"], {}).get("batch"):
        lines.append(f"Ours ({ours['recipe']}) ran only at the batch given ({ours['batch']}), not searched for its "
                     f"largest: the speed above is at that batch. Run --recipes {ours['recipe']} without --batch, "
                     "with --json PATH --resume, for its largest.")
    lines += _tuning_lines(runs)
    if torch_best is not None:
        lines += _loss_lines(runs, ours["recipe"], torch_best)
    return lines


def _tuning_lines(runs: List[dict]) -> List[str]:
    """Each tuned run's tuning against 10,000 of its steps at its steady rate (not the one-candidate tunings of
    the seeds after the first, which train its choice); where the report also has its choice run alone at the same
    batch and seed, with the compile a run makes anyway counted once, as ``bench tune`` counts it: the tuning plus
    the tuned run's one-time seconds (its compile, warm with the tuning's), less the choice's one-time seconds."""
    lines = []
    for r in runs:
        tuning = r.get("tuning") or {}
        seconds = tuning.get("seconds")
        if r["recipe"] != "tune" or "error" in r or seconds is None or not r.get("steady_ms_per_step") or \
                len(tuning.get("trials", ())) + len(tuning.get("skipped", ())) < 2:
            continue
        steps_s = 10000 * r["steady_ms_per_step"] / 1e3
        share = seconds / steps_s
        where = (f", made in one process on one GPU at batch {r['tuned_batch']}" if r.get("tuned_batch") else "")
        # (a machine whose inductor cache holds the tuning's graphs, from an earlier run, tunes faster)
        graphs = describe_graphs(tuning.get("inductor_graphs"))
        line = (f"Tuning (seed {r['seed']}, batch {r['batch']}{where}): {seconds:.1f} s" +
                (f" ({graphs})" if graphs else "") +
                f", {share:.2%} of 10,000 steps at its steady {r['steady_ms_per_step']:.0f} ms")
        # (none for a tuning made on one GPU for a sharded run: no run alone is comparable)
        alone = None if r.get("tuned_batch") else next(
            (a for a in runs if a["recipe"] == r.get("chosen") and a.get("batch") == r["batch"]
             and a.get("seed") == r["seed"] and "error" not in a and a.get("one_time_seconds") is not None), None)
        if alone is not None and _started_first(alone) != _started_first(r):
            # One of them carries inductor's start in its one-time seconds (a report of a version that did not
            # start it ahead): their difference would count it.
            line += (f"; not counted once against {alone['recipe']}'s run alone: one of the two started inductor "
                     "ahead of its set-up and the other did not (run both again for the count)")
        elif alone is not None and r.get("one_time_seconds") is not None:
            once = seconds + r["one_time_seconds"] - alone["one_time_seconds"]
            share = once / steps_s
            line += (f"; with the compile counted once (+ its one-time {r['one_time_seconds']:.1f} s - "
                     f"{alone['recipe']}'s run alone, {alone['one_time_seconds']:.1f} s): {once:.1f} s, {share:.2%}")
        lines.append(f"{line}: {'meets' if share <= TARGET_TUNING else 'misses'} the {TARGET_TUNING:.0%} target.")
    return lines


def _started_first(run: dict) -> bool:
    """Whether `run`'s process had inductor started before its set-up (start_inductor), so that neither its set-up
    nor its one-time seconds carry that start."""
    return run.get("inductor_start_seconds") is not None


def _loss_lines(runs: List[dict], ours: str, torch_best: dict) -> List[str]:
    """The final loss of `ours` against torch's seed spread: runs at torch's batch (a larger batch trains on
    more tokens a step, so its loss is not comparable) and the same number of steps, the most steps both have."""
    batch, recipe = torch_best["batch"], torch_best["recipe"]
    complete = [r for r in runs if "error" not in r and not r.get("stopped_early") and r.get("batch") == batch]
    theirs = [r["steps"] for r in complete if r["recipe"] == recipe]
    mine = {r["steps"] for r in complete if r["recipe"] == ours}
    again = "with --json PATH --resume: the runs join this report"
    if not theirs:
        return [f"Loss: torch's {recipe} has no complete run at its batch ({batch}); run --recipes {recipe} "
                f"--batch {recipe}={batch} --seed 0 (and 1), {again}."]
    if not mine:
        return [f"Loss: ours ({ours}) has no complete run at torch's batch ({batch}), the only batch its loss can be "
                f"compared at; run --recipes {ours} --batch {ours}={batch} --seed 0 (and 1), {again}."]
    common = mine & set(theirs)
    if not common:
        return [f"Loss: ours and torch's runs at batch {batch} ran different numbers of steps ({sorted(mine)} "
                f"against {sorted(set(theirs))}); run both with the same --steps."]
    steps = max(common, key=lambda n: (theirs.count(n) > 1, n))  # where torch has a spread, then the longest
    torch_losses = [r["final_loss"] for r in complete if r["recipe"] == recipe and r["steps"] == steps]
    mine_runs = [r for r in complete if r["recipe"] == ours and r["steps"] == steps]
    our_losses = [r["final_loss"] for r in mine_runs]
    chose = sorted({r["chosen"] for r in mine_runs if r.get("chosen")})
    what = f"ours ({ours}" + (f", chose {', '.join(chose)}" if chose else "") + ")"
    mean, theirs_mean = statistics.mean(our_losses), statistics.mean(torch_losses)
    # The other recipes run at the same batch and steps (torchao's fp8, our recipe without fp8) tell a reader
    # what each part of a difference comes from.
    others: Dict[str, List[float]] = {}
    for r in complete:
        if r["recipe"] not in (recipe, ours) and r["steps"] == steps:
            others.setdefault(r["recipe"], []).append(r["final_loss"])
    beside = [f"Beside them at batch {batch} over {steps} steps: " + ", ".join(
        f"{name} {statistics.mean(losses):.4f} ({len(losses)} seed(s))" for name, losses in others.items()) + "."
    ] if others else []
    sooner = _sooner_lines([r for r in complete if r["recipe"] == recipe and r["steps"] == steps], mine_runs)
    if len(torch_losses) < 2:
        return [f"Loss after {steps} steps at batch {batch}: {what} {mean:.4f}, torch's {theirs_mean:.4f} (one "
                f"seed: no spread to judge by; --seed 1 too)."] + sooner + beside
    lo, hi = min(torch_losses), max(torch_losses)
    return [f"Loss after {steps} steps at batch {batch}: {what} {mean:.4f} ({len(our_losses)} seed(s)) against "
            f"torch's {theirs_mean:.4f} (its seeds {lo:.4f} .. {hi:.4f}): "
            f"{'inside' if abs(mean - theirs_mean) <= hi - lo else 'outside'} torch's seed spread."] + sooner + beside


def _sooner_lines(torch_runs: List[dict], our_runs: List[dict]) -> List[str]:
    """For each seed both ran (on the same batches): how soon each reached the loss both reach, at its steady
    step time (bench tune's time_to_common_loss). A run a few steps behind may still get there sooner."""
    from .tuning import time_to_common_loss

    theirs = {r.get("seed"): r for r in torch_runs if r.get("losses")}
    lines = []
    for r in sorted((r for r in our_runs if r.get("losses") and r.get("seed") in theirs), key=lambda r: r["seed"]):
        c = time_to_common_loss(r, theirs[r["seed"]])
        lines.append(f"Seed {r['seed']}: to the loss both reach ({c['loss']:.4f}), ours took {c['tuned_steps']} "
                     f"steps, {c['tuned_seconds']:.1f} s at its steady rate, torch's {c['torch_steps']} steps, "
                     f"{c['torch_seconds']:.1f} s: {c['tuned_sooner']:.2f}x as fast.")
    return lines


def table(report: dict) -> str:
    head = (f"{'recipe':19} {'seed':>4} {'batch':>5} {'ckpt':>4} {'tokens/s':>10} {'steady':>10} {'peak GiB':>8} "
            f"{'final loss':>10}  policy")
    lines = [head]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"{r['recipe']:19} {r['seed']:>4} {r['batch']:>5}  {r['error']}")
            continue
        peak = f"{r['peak_gib']:8.1f}" if r.get("peak_gib") is not None else f"{'-':>8}"
        lines.append(f"{r['recipe']:19} {r['seed']:>4} {r['batch']:>5} {'yes' if r['checkpointing'] else 'no':>4} "
                     f"{r['tokens_per_s']:10.0f} {r['steady_tokens_per_s']:10.0f} {peak} {r['final_loss']:10.4f}  "
                     f"{r.get('policy', '')}" + (f" (set-up {r['tuning_seconds']:.0f} s)" if "tuning_seconds" in r
                                                 else ""))
    return "\n".join(lines)


def _with_run(runs: List[dict], run: dict) -> List[dict]:
    """`runs` with `run` in place of a run of the same recipe, seed, batch and all-gather (else added): a
    --float8-all-gather off run joins the float8 one it is compared with."""
    def key(r):
        return r.get("recipe"), r.get("seed"), r.get("batch"), r.get("float8_all_gather")
    return [old for old in runs if key(old) != key(run)] + [run]


def _resumed(path: str, shape: dict, fsdp2: Optional[int], error) -> dict:
    """The report at `path` that --resume adds to, {} where there is none yet; `error(message)` refuses one that
    cannot be read, holds another model, or was not sharded over `fsdp2` GPUs (None: one GPU)."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            before = json.load(f)
    except (OSError, ValueError) as exc:
        error(f"--resume: cannot read {path}: {exc}")
    if before.get("shape") != shape:
        error(f"--resume: {path} holds runs of shape {before.get('shape')}, not of {shape}; name another --json")
    if before.get("fsdp2") != fsdp2:
        error(f"--resume: {path} holds runs " + (f"sharded over {before['fsdp2']} GPUs" if before.get("fsdp2")
                                                  else "on one GPU") + ", not these; name another --json")
    return before


def merge(paths: List[str], error) -> dict:
    """One report of the runs in the reports at `paths` (written by separate commands: seeds run side by side on
    two GPUs, say), with its verdict. A later report's run of the same recipe, seed and batch replaces an earlier
    one's, as --resume does. `error(message)` refuses a report that cannot be read, holds another model or
    ran on another device."""
    reports = []
    for path in paths:
        try:
            with open(path) as f:
                reports.append(json.load(f))
        except (OSError, ValueError) as exc:
            error(f"--merge: cannot read {path}: {exc}")
        report = reports[-1]
        if not isinstance(report, dict) or not all(k in report for k in ("shape", "device", "args")) or \
                not isinstance(report.get("runs"), list) or \
                not all(isinstance(r, dict) and isinstance(r.get("recipe"), str) for r in report["runs"]):
            error(f"--merge: {path} is not a report of bench scale --json")
    first = reports[0]
    for path, report in zip(paths[1:], reports[1:]):
        if report["shape"] != first["shape"]:
            error(f"--merge: {path} holds a model of shape {report['shape']}, {paths[0]} one of {first['shape']}")
        if report["device"] != first["device"]:
            error(f"--merge: {path} ran on {report['device']}, {paths[0]} on {first['device']}: their speeds and "
                  "memory do not compare")
        if report.get("fsdp2") != first.get("fsdp2"):
            error(f"--merge: {path} and {paths[0]} were not sharded alike (--fsdp2 {report.get('fsdp2')} against "
                  f"{first.get('fsdp2')})")
    out = dict(first, runs=[], search={}, skipped={}, earlier=[], merged=[])
    for path, report in zip(paths, reports):
        for run in report["runs"]:
            out["runs"] = _with_run(out["runs"], run)
        out["search"].update(report.get("search", {}))
        out["skipped"].update(report.get("skipped", {}))
        out["earlier"] += report.get("earlier", [])
        out["merged"].append({"path": path, **{k: report.get(k) for k in
                                               ("date", "device", "torch", "transformers", "torchao")}})
    # A recipe that ran in one report is not skipped because another command skipped it.
    ran = {run["recipe"] for run in out["runs"] if "error" not in run}
    out["skipped"] = {name: why for name, why in out["skipped"].items() if name not in ran}
    out["verdict"] = verdict(out)
    return out


def _write_report(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def _show(report: dict) -> int:
    """The report's table and verdict printed; the exit code (1 where a run failed)."""
    print(table(report))
    print("\n".join(report["verdict"]), flush=True)
    return 1 if any("error" in r for r in report["runs"]) else 0


def _new_report(args, shape: dict, device, fsdp2: Optional[int]) -> dict:
    """A report with no runs yet: where, when and what ran (`fsdp2`: over how many GPUs; None: one GPU)."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", **_versions(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": shape, "fsdp2": fsdp2,
            "args": {k: v for k, v in vars(args).items()}, "search": {}, "skipped": {}, "runs": []}


def _versions() -> dict:
    out = {"torch": torch.__version__}
    for name in ("transformers", "torchao"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    return out


def _recipe_list(text: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: choose recipes from {', '.join(RECIPES)} (comma-separated)")
    return names


def _batches(text: str) -> Dict[str, int]:
    """--batch: ``N`` (every recipe; key "*") or ``recipe=N,recipe=N``."""
    out: Dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, number = part.rpartition("=")
        name = name.strip() or "*"
        if name != "*" and name not in RECIPES:
            raise argparse.ArgumentTypeError(f"{part!r}: {name!r} is no recipe; choose from {', '.join(RECIPES)}")
        out[name] = _positive(number)
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: give a batch (4) or batches per recipe (torch-bf16=1,tune=4)")
    return out


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


_EPILOG = """examples:
  python -m adaptive_amp bench scale --layers 8 --recipes torch-bf16 --max-seconds 360   # one recipe, < 10 min
  python -m adaptive_amp bench scale --steps 700 --seeds 2 --json scale.json         # the full comparison
  python -m adaptive_amp bench scale --recipes torch-bf16 --batch 1 --steps 100 --json s.json --resume
                                                                                   # one recipe a command
  python -m adaptive_amp bench scale --tiny --device cpu --steps 6                   # CPU smoke run, seconds
  CUDA_VISIBLE_DEVICES=0 python -m adaptive_amp bench scale --recipes torch-bf16 --batch 3 --seed 0 --json t0.json &
  CUDA_VISIBLE_DEVICES=1 python -m adaptive_amp bench scale --recipes torch-bf16 --batch 3 --seed 1 --json t1.json &
  wait; python -m adaptive_amp bench scale --merge t0.json t1.json tune0.json tune1.json  # seeds side by side
  torchrun --standalone --nproc_per_node=2 -m adaptive_amp bench scale --fsdp2 --batch 4 --steps 700 \
      --recipes torch-bf16,torchao-tensorwise,bf16-pure+fp8 --json fsdp2.json   # two GPUs, FSDP2
  python -m adaptive_amp bench scale --gpus 2 --steps 40 --recipes torch-bf16,torchao-tensorwise,tune \
      --json fsdp2.json                             # each recipe at its largest batch a GPU, tune's choice too
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaptive_amp bench scale", description=__doc__.split("\n", 1)[1],
                                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", type=_recipe_list, default=list(DEFAULT_RECIPES),
                   help=f"comma-separated, from {', '.join(RECIPES)} (default {','.join(DEFAULT_RECIPES)})")
    p.add_argument("--layers", type=_positive, default=None, help="decoder layers (default 32; tiny 2)")
    p.add_argument("--hidden", type=_positive, default=None, help="hidden size (default 4096)")
    p.add_argument("--mlp", type=_positive, default=None, help="MLP size (default 14336)")
    p.add_argument("--heads", type=_positive, default=None, help="attention heads (default 32)")
    p.add_argument("--kv-heads", type=_positive, default=None, help="key-value heads (default 8)")
    p.add_argument("--seq", type=_positive, default=None, help="tokens a sequence (default 2048)")
    p.add_argument("--vocab", type=_positive, default=None, help="vocabulary (default 32000)")
    p.add_argument("--batch", type=_batches, default=None,
                   help="sequences a step: N for every recipe, or recipe=N,... (default, and for a recipe not "
                        "named: the largest that fits)")
    p.add_argument("--max-batch", type=_positive, default=64, help="the batch search stops here (default 64)")
    p.add_argument("--memory-fraction", type=float, default=0.95,
                   help="a batch fits when its peak stays under this share of the GPU's memory (default 0.95)")
    p.add_argument("--checkpointing", choices=("auto", "on", "off"), default="auto",
                   help="activation checkpointing: auto (only for a recipe that does not fit one sequence), "
                        "on, off (default auto)")
    p.add_argument("--steps", type=_positive, default=700,
                   help="training steps per recipe and seed (default 700: at 500 the stream's loss still falls "
                        "steeply, and a recipe a few steps behind is far off in loss)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="a run (building, compiling and tuning included) starts no new window of steps after "
                        "this many seconds and reports the steps it ran (the batch search is not counted)")
    p.add_argument("--seeds", type=_positive, default=1,
                   help="seeds per recipe (weights and batches); 2 or more give torch's loss spread (default 1)")
    p.add_argument("--seed", type=int, default=None,
                   help="run this seed only (0, 1, ...): with --resume, one seed a command")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--tune-candidates", default="fp32,bf16,bf16-weights,bf16+fp8,bf16-weights+fp8,bf16-pure+fp8",
                   help="tune: the candidates (default: fp32 as the reference, torch's bf16 autocast, bf16 weights, "
                        "and fp8 over each; on a compiled model only the finalists compile)")
    p.add_argument("--tune-steps", type=_positive, default=4, help="tune: trial steps per candidate")
    p.add_argument("--tune-timed-steps", type=_positive, default=2, help="tune: timed steps per candidate")
    p.add_argument("--tune-batch", type=_positive, default=None, metavar="N",
                   help="tune under --gpus: sequences a step of the tuning made on one GPU, the model unsharded "
                        "(default 1); the sharded run's batch is --batch's or the largest")
    p.add_argument("--compile", choices=("blocks", "model", "off"), default=None,
                   help="torch.compile each decoder layer (blocks), the whole model (model) or nothing (off) "
                        "(default: blocks on a GPU, off on the CPU)")
    p.add_argument("--device", default=None, help="cuda (default when torch sees a GPU) or cpu")
    p.add_argument("--fsdp2", action="store_true",
                   help="shard the model with FSDP2 over the processes of torchrun (one a GPU); --batch is "
                        "per GPU (adaptive_amp/bench/scale_fsdp2.py)")
    p.add_argument("--stats-every", type=_positive, default=None, metavar="N",
                   help="our recipes: steps between the controller's statistics steps (default: the "
                        "controller's, 200). With fp8 layers a statistics step peaked higher than an ordinary "
                        "one; the first, the run's first step, comes before the optimizer's state, so a run's "
                        "peak includes one with that state only when it is longer than N steps. Every step of the "
                        "batch search's tries is one")
    p.add_argument("--float8-all-gather", choices=("on", "off"), default=None,
                   help="sharded (--fsdp2, --gpus): torchao's tensorwise recipe all-gathers its weights in float8 "
                        "(on, the default, as torchao advises) or in bf16 (off: what the float8 all-gather is worth)")
    p.add_argument("--gpus", type=_positive, default=None, metavar="N",
                   help="run each recipe sharded by FSDP2 over N GPUs of this machine, from this command: one "
                        "torchrun a recipe, at its largest batch a GPU (searched with one torchrun a try, as a "
                        "rank that runs out of memory ends them all) unless --batch names it; tune tunes first "
                        "in one process on one GPU, unsharded (--tune-batch)")
    # What --gpus gives the processes it starts with tune: the tuning alone, written to PATH; a tuning's record,
    # whose choice the tuned run trains sharded.
    p.add_argument("--tune-only", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--tuned", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same structure (a CPU smoke run)")
    p.add_argument("--json", metavar="PATH", help="also write every run, the searches and the verdict as JSON")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in --json PATH (the same shape) and add these recipes' runs to them")
    p.add_argument("--verbose", action="store_true", help="print the tuning's progress")
    p.add_argument("--merge", nargs="+", metavar="PATH",
                   help="run nothing: the table and verdict over the runs in these reports (--json files of the "
                        "same shape written by separate commands, one a GPU say); with --json, write them as one")
    args = p.parse_args(argv)
    if args.merge:
        # Which options were given, whatever their values: parsed again over a namespace that already holds a
        # marker for each (argparse sets only the defaults that a namespace lacks).
        unset = object()
        options = [a for a in p._actions if a.option_strings and a.dest not in ("merge", "json", "help")]
        seen = p.parse_args(argv, namespace=argparse.Namespace(**{a.dest: unset for a in options}))
        given = [a.option_strings[0] for a in options if getattr(seen, a.dest) is not unset]
        if given:
            p.error(f"--merge runs nothing: leave out {', '.join(given)}")
        if args.json and any(os.path.realpath(args.json) == os.path.realpath(path) for path in args.merge):
            p.error(f"--json {args.json} is one of the reports merged; name a new file")
        report = merge(args.merge, p.error)
        if args.json:
            _write_report(args.json, report)
        return _show(report)
    if args.gpus is not None and args.fsdp2:
        p.error("--gpus starts torchrun itself: leave out --fsdp2 (what each of its processes runs with)")
    if args.tune_batch is not None and (args.gpus is None or "tune" not in args.recipes):
        p.error("--tune-batch is for tune under --gpus, where the tuning runs apart from the sharded run; on one "
                "GPU the tuning runs on the run's own batches (--batch tune=N)")
    if args.stats_every is not None and not any(is_ours(r) for r in args.recipes):
        p.error("--stats-every is for our recipes (the controller's statistics steps): add one to --recipes")
    if args.float8_all_gather is not None and not (args.fsdp2 or args.gpus is not None):
        p.error("--float8-all-gather is for sharded runs (--fsdp2 or --gpus): on one GPU there is no all-gather")
    if args.float8_all_gather is not None and "torchao-tensorwise" not in args.recipes:
        p.error("--float8-all-gather is torchao-tensorwise's (torchao's float8 all-gather is tensorwise only): add "
                "it to --recipes")
    args.rank, args.world = 0, 1
    if args.tune_only and (args.fsdp2 or args.gpus is not None or args.tuned):
        p.error("--tune-only is what --gpus runs in a process of its own: leave out --fsdp2, --gpus and --tuned")
    args.tuned_record = _tuned_record(args, p.error) if args.tuned else None  # (before joining a process group)
    if args.fsdp2:
        from .scale_fsdp2 import start

        args.rank, args.world, device = start(args, p.error)
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU; use --device cpu (with --tiny)")
    if device.type != "cuda" and not args.tiny:
        p.error("the full-size model needs a CUDA GPU; on the CPU add --tiny")
    if not 0.1 <= args.memory_fraction <= 1.0:
        p.error("--memory-fraction must be in [0.1, 1]")
    try:
        import transformers  # noqa: F401
    except ImportError:
        p.error("the scale suite builds transformers' LlamaForCausalLM: pip install transformers")
    shape = dict(TINY if args.tiny else FULL)
    for key, value in (("num_hidden_layers", args.layers), ("hidden_size", args.hidden),
                       ("intermediate_size", args.mlp), ("num_attention_heads", args.heads),
                       ("num_key_value_heads", args.kv_heads), ("seq_len", args.seq), ("vocab_size", args.vocab)):
        if value is not None:
            shape[key] = value
    if shape["hidden_size"] % shape["num_attention_heads"] or \
            shape["num_attention_heads"] % shape["num_key_value_heads"]:
        p.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    args.compile = args.compile or ("blocks" if device.type == "cuda" else "off")
    if args.resume and not args.json:
        p.error("--resume adds to the report in --json PATH: give --json")
    if args.seed is not None and args.seed < 0:
        p.error(f"--seed {args.seed}: seeds are 0, 1, ...")
    seeds = list(range(args.seeds)) if args.seed is None else [args.seed]
    args.tune_candidates = [c.strip() for c in args.tune_candidates.split(",") if c.strip()]
    if args.tune_only:
        return tune_only(args, shape, device)
    if args.gpus is not None:
        return _main_sharded(args, shape, device, p.error)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 work outside autocast, as torch users run it
    report = _new_report(args, shape, device, args.world if args.fsdp2 else None)
    print(f"scale: LlamaForCausalLM {shape} on {report['device']}, torch {report['torch']}, transformers "
          f"{report['transformers']}, torchao {report['torchao']}"
          + (f"; sharded by FSDP2 over {args.world} processes, --batch sequences each" if args.fsdp2 else ""),
          flush=True)

    before = _resumed(args.json, shape, report["fsdp2"], p.error) if args.resume else {}
    if before:
        report["runs"] = before.get("runs", [])  # (a run of the same recipe, seed and batch is replaced below)
        report["skipped"] = {k: v for k, v in before.get("skipped", {}).items() if k not in args.recipes}
        # A recipe's batch search is kept, and its batch reused unless --batch names another now.
        report["search"] = before.get("search", {})
        # Where and when the kept runs ran, should it differ from this command's.
        report["earlier"] = before.get("earlier", []) + [
            {k: before.get(k) for k in ("date", "device", "torch", "transformers", "torchao")}]

    def save():
        if args.json and args.rank == 0:
            _write_report(args.json, report)

    for recipe in args.recipes:
        why = skip_reason(recipe, device, sharded=args.fsdp2, tuned=bool(args.tuned))
        if why:
            report["skipped"][recipe] = why
            print(f"-- {recipe}: skipped: {why}", flush=True)
            continue
        args.checkpointing_now = args.checkpointing == "on"
        batch = None if args.batch is None else args.batch.get(recipe, args.batch.get("*"))
        if batch is None and device.type != "cuda":
            batch = 2  # no device memory to search on the CPU
        earlier = report["search"].get(recipe, {})
        if batch is None and _reusable_search(recipe, earlier, args.json):
            batch, args.checkpointing_now = earlier["batch"], bool(earlier.get("checkpointing"))
            print(f"-- {recipe}: batch {batch}, from the batch search already in {args.json}", flush=True)
        if batch is None:
            print(f"-- {recipe}: searching the largest batch that fits", flush=True)
            found = search_batch(recipe, shape, device, args)
            if found["batch"] == 0 and args.checkpointing == "auto":
                print(f"-- {recipe}: one sequence does not fit; again with activation checkpointing", flush=True)
                args.checkpointing_now = True
                found = search_batch(recipe, shape, device, args)
            found["checkpointing"] = args.checkpointing_now
            report["search"][recipe] = found = _search_record(recipe, found)
            save()  # a later run cut short keeps the search for --resume
            batch = found["batch"]
            if batch == 0:
                report["skipped"][recipe] = "not even one sequence a step fits" + \
                    (f" ({found['error']})" if "error" in found else "")
                print(f"-- {recipe}: {report['skipped'][recipe]}", flush=True)
                save()
                continue
        # The tuned run of another seed trains seed 0's choice at this batch (from this command or the report
        # resumed).
        choice = next((r.get("chosen") for r in report["runs"] if r["recipe"] == recipe and r.get("seed") == 0
                       and r.get("batch") == batch and r.get("chosen")), None)
        for seed in seeds:
            print(f"-- {recipe}: seed {seed}, batch {batch}, {args.steps} steps"
                  + (f", tuning only seed 0's choice {choice}" if choice and seed and not args.tuned else ""),
                  flush=True)
            r = run(recipe, shape, batch, seed, device, args, choice if seed else None)
            if seed == 0:  # (run again now: its choice is the one the other seeds take)
                choice = r.get("chosen")
            report["runs"] = _with_run(report["runs"], r)
            save()
    report["verdict"] = verdict(report)
    save()
    code = _show(report)
    if args.fsdp2:
        from ._dist_exit import finish

        finish(code)  # (every rank together; _dist_exit.py says why not through the interpreter's shutdown)
    return code
