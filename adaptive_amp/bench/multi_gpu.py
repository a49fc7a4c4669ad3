"""``python -m adaptive_amp bench multi-gpu``: adaptive_amp.GradScaler under DDP and FSDP2 (parity, overhead).

    torchrun --standalone --nproc_per_node=2 -m adaptive_amp bench multi-gpu --out DIR [--steps N]
        [--backend nccl|gloo] [--device cuda|cpu]

All ranks run every section (rank 0 alone runs the single-process reference);
rank 0 writes DIR/multi_gpu.json and DIR/multi_gpu.txt after every section, so
a crash keeps what came before. Every check prints PASS or FAIL; checks marked
"(info)" record facts that explain others (run-to-run determinism) rather than
claims about the scaler. The exit status is 0 when every section ran, whatever
the checks say, and 1 when a section raised.

Sections
  a. DDP, fp16 autocast, TinyLM of adaptive_amp.demo, AdamW fused. Each rank
     has its own data. An inf is written into rank 1's gradient (after DDP's
     all-reduce, so rank 0's gradients stay finite) at fixed steps. Runs from
     one init: ours (process_group=WORLD); torch.amp.GradScaler with
     found_inf all-reduced (MAX) over WORLD (a subclass that adds just that,
     what any DDP user of torch's scaler must do for a rank-local inf); the
     same two with unscale_ + torch.nn.utils.clip_grad_norm_; ours with
     scaler.clip_grad_norm_; a control (ours without process_group: ranks
     must disagree, which shows the inf is rank-local); the textbook case
     (inf in rank 1's loss, which DDP spreads) with plain torch.amp.GradScaler
     vs ours; ours again (determinism) and ours with seed 1 (spread).
  b. FSDP2 (fully_shard on each block and the root), fp16 autocast (falls back
     to MixedPrecisionPolicy(param_dtype=fp16) if autocast fails), AdamW
     foreach. An inf is written into rank 1's local gradient shard. Ours
     (no process_group given: DTensor gradients use WORLD by themselves) vs
     ShardedGradScaler; ours.clip_grad_norm_ vs ShardedGradScaler.unscale_ +
     torch.nn.utils.clip_grad_norm_ on the DTensor parameters.
  c. Rank 0 alone trains a fresh TinyLM (no DDP) on both ranks' batches
     concatenated, same steps and injected infs; its final loss vs DDP's, the
     spread being DDP seed 0 vs seed 1.
  d. Overhead per step: GPT-2 small gradient shapes (adaptive_amp.bench.kernels) as
     plain parameters, random scaled gradients restored from a copy at the
     start of every step in every loop; AdamW fused and foreach, with and
     without clipping. Loops: plain (no scaler; clip = local
     clip_grad_norm_), torch (torch.amp.GradScaler, no collective), torch+AR
     (found_inf all-reduced; clip: local norm, its square all-reduced, then
     clip_grads_with_norm_), ours (no group), ours+AR (process_group=WORLD,
     sharded_grads=True: found_inf all-reduced, clip norm all-reduced in
     clip_grad_norm_). torch+AR and ours+AR do equal communication.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from .. import GradScaler, build_info  # noqa: E402
from ..demo import MarkovCorpus, TinyLM  # noqa: E402
from ._dist_exit import finish  # noqa: E402
from .kernels import gpt2_small_shapes  # noqa: E402

LR = 3e-3
MAX_NORM = 1.0


# ----------------------------------------------------------------------------- helpers

class TorchAllReduceScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler plus found_inf all-reduced (MAX) over a group, nothing else.

    Both of torch's paths (unscale_, and the read-only check before a fused
    optimizer's step) go through _unscale_grads_, so every found_inf torch
    uses is the reduced one (what ShardedGradScaler.unscale_ does, with SUM).
    """

    def __init__(self, *args, process_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._ar_group = process_group

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        for f in per_device.values():
            dist.all_reduce(f, op=dist.ReduceOp.MAX, group=self._ar_group)
        return per_device


def is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def local(t):
    return t.to_local() if is_dtensor(t) else t


def full(t):
    return t.full_tensor() if is_dtensor(t) else t


class Ctx:
    def __init__(self, args):
        self.args = args
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.dev_type = args.device
        if self.dev_type == "cuda":
            self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.steps = args.steps
        self.batch, self.length = args.batch, args.length
        self.growth_interval = args.growth_interval
        self.inject_steps = sorted({s for s in (args.steps // 5, args.steps // 2, (4 * args.steps) // 5)
                                    if 0 < s < args.steps})
        self.corpus = MarkovCorpus(device=self.device)
        self._data = {}
        self.checks = []
        self.results = {"meta": {}, "checks": self.checks, "errors": [], "sections": {}}

    def sync(self):
        if self.dev_type == "cuda":
            torch.cuda.synchronize(self.device)

    def shard(self, seed: int, rank: int) -> torch.Tensor:
        """Rank `rank`'s data for `seed`: (steps * batch, length + 1) tokens, made up front."""
        key = (seed, rank)
        if key not in self._data:
            gen = torch.Generator(device=self.device).manual_seed(1000 * seed + 17 + rank)
            self._data[key] = self.corpus.batch(self.steps * self.batch, self.length + 1, gen)
        return self._data[key]

    def check(self, section, name, passed, detail="", info=False):
        passed = bool(passed)
        entry = {"section": section, "name": name, "passed": passed, "info": info, "detail": detail}
        self.checks.append(entry)
        if self.rank == 0:
            tag = "PASS" if passed else "FAIL"
            print(f"[{tag}] {section}: {name}{' (info)' if info else ''} -- {detail}", flush=True)
        return passed

    def log(self, msg):
        if self.rank == 0:
            print(msg, flush=True)


def make_scaler(ctx, kind):
    dev, gi = ctx.dev_type, ctx.growth_interval
    world = dist.group.WORLD
    if kind == "ours":
        return GradScaler(dev, growth_interval=gi, process_group=world)
    if kind == "ours_default":  # no process_group: DTensor gradients reduce over WORLD by themselves
        return GradScaler(dev, growth_interval=gi)
    if kind == "ours_nopg":
        return GradScaler(dev, growth_interval=gi)
    if kind == "torch":
        return torch.amp.GradScaler(dev, growth_interval=gi)
    if kind == "torch_ar":
        return TorchAllReduceScaler(dev, growth_interval=gi, process_group=world)
    if kind == "sharded":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(dev, growth_interval=gi, process_group=world)
    raise ValueError(kind)


def found_sum(scaler, opt, device):
    found = scaler._found_inf_per_device(opt)
    return torch.stack([f.reshape(()).float().to(device) for f in found.values()]).sum()


def train(ctx, *, wrap, scaler_kind, clip=None, inject="grad", seed=0, optimizer="fused", fsdp_mode="autocast"):
    """Train TinyLM; wrap: "ddp", "fsdp" or "single" (rank 0 alone, both ranks' batches).

    clip: None, "torch" (scaler.unscale_ + torch.nn.utils.clip_grad_norm_) or
    "ours" (scaler.clip_grad_norm_). inject: None, "grad" (inf into the first
    parameter's local gradient, after backward) or "loss" (loss * inf), on
    rank 1 (rank 0 in "single"), at ctx.inject_steps. Nothing syncs per step
    but what the scaler/optimizer itself does; histories are read at the end.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device, steps, vocab = ctx.device, ctx.steps, ctx.corpus.vocab
    distributed = wrap != "single"
    torch.manual_seed(seed)
    model = TinyLM(vocab=vocab).to(device)
    net = model
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model, device_ids=[ctx.local_rank] if ctx.dev_type == "cuda" else None)
    elif wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard
        kw = {}
        if fsdp_mode == "mp_policy":
            from torch.distributed.fsdp import MixedPrecisionPolicy
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        for layer in model.blocks.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
    opt_kw = {"fused": True} if optimizer == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01, **opt_kw)
    scaler = make_scaler(ctx, scaler_kind)
    if wrap == "single":
        data = torch.cat([ctx.shard(seed, r).view(steps, ctx.batch, -1) for r in range(ctx.world)], dim=1)
        inject_rank = ctx.rank
    else:
        data = ctx.shard(seed, ctx.rank).view(steps, ctx.batch, -1)
        inject_rank = 1
    inject_here = inject is not None and ctx.rank == inject_rank
    first_param = next(iter(model.parameters()))
    use_autocast = not (wrap == "fsdp" and fsdp_mode == "mp_policy")
    losses, scales, founds, norms = [], [], [], []
    ctx.sync()
    t0 = time.perf_counter()
    with sdpa_kernel([SDPBackend.MATH]):  # deterministic attention backward on every device
        for step in range(steps):
            tokens = data[step]
            with torch.autocast(device_type=ctx.dev_type, dtype=torch.float16, enabled=use_autocast):
                logits = net(tokens[:, :-1])
                loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            losses.append(loss.detach().float())
            if inject == "loss" and inject_here and step in ctx.inject_steps:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            if inject == "grad" and inject_here and step in ctx.inject_steps:
                with torch.no_grad():
                    local(first_param.grad).view(-1)[0] = float("inf")
            if clip == "torch":
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
                norms.append(full(norm).detach().float().reshape(()))
            elif clip == "ours":
                norms.append(scaler.clip_grad_norm_(opt, MAX_NORM).detach().float().reshape(()))
            scaler.step(opt)
            founds.append(found_sum(scaler, opt, device))
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler._get_scale_async().detach().float().reshape(()).clone())
    ctx.sync()
    seconds = time.perf_counter() - t0
    hist = torch.stack([torch.stack(scales), torch.stack(founds).to(device), torch.stack(losses).to(device)])
    if wrap == "fsdp":
        params = torch.cat([full(p.detach()).float().reshape(-1) for p in model.parameters()])
    else:
        params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    out = {"seconds": seconds, "scaler": scaler_kind, "wrap": wrap, "clip": clip, "inject": inject, "seed": seed}
    if distributed:
        gathered = [torch.empty_like(hist) for _ in range(ctx.world)]
        dist.all_gather(gathered, hist)
        gathered = [g.cpu() for g in gathered]
        pg = [torch.empty_like(params) for _ in range(ctx.world)]
        dist.all_gather(pg, params)
        out["params_equal_across_ranks"] = all(torch.equal(pg[0], p) for p in pg[1:])
    else:
        gathered = [hist.cpu()]
    out["scales"] = [g[0].tolist() for g in gathered]     # per rank
    out["skips"] = [[i for i, f in enumerate(g[1].tolist()) if f != 0] for g in gathered]  # per rank
    out["losses"] = [g[2].tolist() for g in gathered]     # per rank (local batch)
    out["loss"] = torch.stack([g[2] for g in gathered]).mean(0).tolist()  # mean over ranks = global batch
    tail = max(1, min(50, steps // 5))
    out["final_loss"] = statistics.fmean(out["loss"][-tail:])
    out["params"] = params.cpu()
    if norms:
        out["norms"] = torch.stack(norms).cpu().tolist()
    if hasattr(scaler, "skipped_steps"):
        out["skipped_counter"] = scaler.skipped_steps
    del net, model, opt, scaler
    return out


def rank_agreement_checks(ctx, section, label, r, expect_inject=True):
    skips, scales = r["skips"], r["scales"]
    ctx.check(section, f"{label}: ranks agree on every skip", all(s == skips[0] for s in skips),
              f"skips per rank {skips}")
    ctx.check(section, f"{label}: scales identical on all ranks", all(s == scales[0] for s in scales),
              f"final scale per rank {[s[-1] for s in scales]}")
    if expect_inject:
        missing = [s for s in ctx.inject_steps if any(s not in sk for sk in skips)]
        ctx.check(section, f"{label}: every injected step skipped on every rank", not missing,
                  f"injected {ctx.inject_steps}, not skipped {missing}")
    if "skipped_counter" in r:
        ctx.check(section, f"{label}: skipped_steps counter equals the skips seen", r["skipped_counter"] == len(skips[0]),
                  f"counter {r['skipped_counter']}, seen {len(skips[0])}")


def init_params(ctx, seed):
    """The flat parameters TinyLM starts from for `seed` (what train() builds before training)."""
    key = ("init", seed)
    if key not in ctx._data:
        torch.manual_seed(seed)
        ctx._data[key] = torch.cat([p.detach().float().reshape(-1) for p in TinyLM(vocab=ctx.corpus.vocab).parameters()])
    return ctx._data[key]


def param_diff(ctx, a, b):
    """(max abs diff, |a - b| / |b - init|: the difference relative to the distance b travelled)."""
    travelled = float((b - init_params(ctx, 0)).norm())
    return float((a - b).abs().max()), float((a - b).norm()) / travelled if travelled > 0 else float("nan")


def parity_checks(ctx, section, label, ours, ref, mode="bitwise", rel_tol=1e-2):
    """mode "bitwise": scale history, skips and parameters bitwise (all strict);
    "close": scale history and skips strict, parameters within rel_tol of the distance travelled;
    "diverging": the runs differ in the last bits from the first clipped step on (another norm
    summation order) and AdamW amplifies that, so everything here is (info)."""
    info = mode == "diverging"
    ctx.check(section, f"{label}: scale history identical", ours["scales"][0] == ref["scales"][0],
              f"final scales {ours['scales'][0][-1]} vs {ref['scales'][0][-1]}", info=info)
    ctx.check(section, f"{label}: same skipped steps", ours["skips"][0] == ref["skips"][0],
              f"{ours['skips'][0]} vs {ref['skips'][0]}", info=info)
    diff, rel = param_diff(ctx, ours["params"], ref["params"])
    same = torch.equal(ours["params"], ref["params"])
    detail = f"max abs diff {diff:.3e}, |diff| / |distance travelled| {rel:.2e}"
    if mode == "bitwise":
        ctx.check(section, f"{label}: parameters bitwise identical", same, detail)
    else:
        ctx.check(section, f"{label}: parameters close (|diff| <= {rel_tol:g} x distance travelled)",
                  rel <= rel_tol, detail, info=info)
        ctx.check(section, f"{label}: parameters bitwise identical", same, detail, info=True)
    loss_a, loss_b = ours["final_loss"], ref["final_loss"]
    return {"max_abs_diff": diff, "rel_diff": rel, "bitwise": same, "final_loss": [loss_a, loss_b]}


def norm_checks(ctx, section, label, ours, ref):
    """At the first finite step both runs hold the same parameters and gradients: only the
    summation order of the norm differs. Later steps drift apart (info)."""
    a, b = ours.get("norms"), ref.get("norms")
    pairs = [(x, y) for x, y in zip(a, b) if math.isfinite(x) and math.isfinite(y) and y != 0]
    rel = [abs(x - y) / abs(y) for x, y in pairs]
    first = rel[0] if rel else float("nan")
    med = statistics.median(rel) if rel else float("nan")
    nonfinite_same = [not math.isfinite(x) for x in a] == [not math.isfinite(y) for y in b]
    ctx.check(section, f"{label}: clip norms agree (first finite step rel diff <= 1e-5; non-finite at the same steps)",
              bool(rel) and first <= 1e-5 and nonfinite_same,
              f"first finite step: {pairs[0][0] if pairs else float('nan'):.6g} vs "
              f"{pairs[0][1] if pairs else float('nan'):.6g} (rel {first:.2e}); later steps rel median {med:.2e}, "
              f"max {max(rel, default=float('nan')):.2e}; non-finite steps agree {nonfinite_same}")
    return {"first_rel": first, "median_rel": med, "max_rel": max(rel, default=float("nan"))}


def summary(r):
    s = {k: r[k] for k in ("scaler", "wrap", "clip", "inject", "seed", "seconds", "final_loss") if k in r}
    s["skips"] = r["skips"]
    s["final_scale"] = [x[-1] for x in r["scales"]]
    s["scale_history_rank0"] = r["scales"][0]
    s["loss_history"] = r["loss"]
    for k in ("params_equal_across_ranks", "skipped_counter", "norms"):
        if k in r:
            s[k] = r[k]
    s["ms_per_step"] = 1e3 * r["seconds"] / max(1, len(r["loss"]))
    return s


# ----------------------------------------------------------------------------- sections

def section_ddp(ctx, store):
    S = "ddp"
    runs = {}
    plan = [
        ("ours", dict(scaler_kind="ours")),
        ("torch_ar", dict(scaler_kind="torch_ar")),
        ("ours_clip_torch", dict(scaler_kind="ours", clip="torch")),
        ("torch_ar_clip_torch", dict(scaler_kind="torch_ar", clip="torch")),
        ("ours_clip_ours", dict(scaler_kind="ours", clip="ours")),
        ("control_ours_nopg", dict(scaler_kind="ours_nopg")),
        ("loss_inject_torch", dict(scaler_kind="torch", inject="loss")),
        ("loss_inject_ours", dict(scaler_kind="ours", inject="loss")),
        ("ours_repeat", dict(scaler_kind="ours")),
        ("ours_seed1", dict(scaler_kind="ours", seed=1)),
    ]
    for name, kw in plan:
        runs[name] = r = train(ctx, wrap="ddp", **kw)
        ctx.log(f"  ddp {name}: {r['seconds']:.2f} s, skips {r['skips'][0]}, final scale {r['scales'][0][-1]:g}, "
                f"final loss {r['final_loss']:.4f}")
    store["runs"] = {k: summary(v) for k, v in runs.items()}
    for name in ("ours", "torch_ar", "ours_clip_torch", "torch_ar_clip_torch", "ours_clip_ours"):
        rank_agreement_checks(ctx, S, name, runs[name])
        ctx.check(S, f"{name}: parameters identical on all ranks", runs[name]["params_equal_across_ranks"], "")
    ctl = runs["control_ours_nopg"]
    ctx.check(S, "control (ours, no process_group): ranks disagree on the injected steps, so the inf is rank-local",
              ctl["skips"][0] != ctl["skips"][1], f"skips per rank {ctl['skips']}")
    for name in ("loss_inject_torch", "loss_inject_ours"):
        rank_agreement_checks(ctx, S, name, runs[name])
    store["parity"] = {}
    for label, a, b in (("ours vs torch+allreduce", "ours", "torch_ar"),
                        ("clip (unscale_ + clip_grad_norm_) ours vs torch+allreduce", "ours_clip_torch",
                         "torch_ar_clip_torch"),
                        ("loss inf: ours vs plain torch.amp.GradScaler", "loss_inject_ours", "loss_inject_torch")):
        store["parity"][label] = parity_checks(ctx, S, label, runs[a], runs[b], mode="bitwise")
    label = "scaler.clip_grad_norm_ (ours) vs torch unscale_ + clip_grad_norm_"
    p = store["parity"][label] = parity_checks(ctx, S, label, runs["ours_clip_ours"], runs["torch_ar_clip_torch"],
                                               mode="diverging")
    p["norms"] = norm_checks(ctx, S, label, runs["ours_clip_ours"], runs["torch_ar_clip_torch"])
    rep_same = torch.equal(runs["ours"]["params"], runs["ours_repeat"]["params"])
    ctx.check(S, "run-to-run determinism (ours twice, same init and data)", rep_same,
              "max abs diff %.3e" % param_diff(ctx, runs["ours"]["params"], runs["ours_repeat"]["params"])[0],
              info=True)
    store["determinism_bitwise"] = rep_same
    return runs


def section_single(ctx, store, ddp_runs):
    S = "single_vs_ddp"
    # Rank 1's data for seed 0 comes to rank 0 exactly (no regeneration).
    mine = ctx.shard(0, ctx.rank)
    got = [torch.empty_like(mine) for _ in range(ctx.world)]
    dist.all_gather(got, mine)
    for r, t in enumerate(got):
        ctx._data[(0, r)] = t
    single, error = None, None
    if ctx.rank == 0:
        try:  # rank 1 waits at the barrier below whatever happens here
            single = train(ctx, wrap="single", scaler_kind="ours_nopg")
            ctx.log(f"  single {single['seconds']:.2f} s, skips {single['skips'][0]}, "
                    f"final loss {single['final_loss']:.4f}")
        except Exception:
            error = traceback.format_exc()
    dist.barrier()
    if error is not None:
        raise RuntimeError(f"single-process reference failed on rank 0:\n{error}")
    if ctx.rank != 0:
        return
    d0, d1 = ddp_runs["ours"]["final_loss"], ddp_runs["ours_seed1"]["final_loss"]
    s0 = single["final_loss"]
    spread = abs(d0 - d1)
    tol = max(spread, 0.02 * abs(d0))
    store.update({"single_final_loss": s0, "ddp_final_loss_seed0": d0, "ddp_final_loss_seed1": d1,
                  "spread": spread, "tolerance": tol, "single": summary(single),
                  "final_loss_window": max(1, min(50, ctx.steps // 5))})
    ctx.check(S, "single-process final loss matches DDP within the run-to-run spread (or 2% if larger)",
              abs(s0 - d0) <= tol, f"single {s0:.4f}, DDP {d0:.4f} (seed 1: {d1:.4f}), |diff| {abs(s0 - d0):.4f}, "
              f"tolerance {tol:.4f}")
    ctx.check(S, "single-process run skips the injected steps", all(s in single["skips"][0] for s in ctx.inject_steps),
              f"single skips {single['skips'][0]}, DDP skips {ddp_runs['ours']['skips'][0]}", info=True)


def section_fsdp(ctx, store):
    S = "fsdp2"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: F401
    except ImportError as exc:
        store["skipped"] = f"FSDP2 unavailable in torch {torch.__version__}: {exc}"
        ctx.log(f"  skipped: {store['skipped']}")
        return
    mode = "autocast"
    runs = {}
    try:
        runs["ours"] = train(ctx, wrap="fsdp", scaler_kind="ours_default", optimizer="foreach", fsdp_mode=mode)
    except Exception as exc:  # raised alike on every rank (it is the same code): retry with the policy
        store["autocast_error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        ctx.log(f"  fsdp2 with autocast failed ({store['autocast_error']}); retrying with MixedPrecisionPolicy")
        mode = "mp_policy"
        runs["ours"] = train(ctx, wrap="fsdp", scaler_kind="ours_default", optimizer="foreach", fsdp_mode=mode)
    store["mixed_precision"] = mode
    plan = [
        ("sharded", dict(scaler_kind="sharded")),
        ("ours_clip_ours", dict(scaler_kind="ours_default", clip="ours")),
        ("sharded_clip_torch", dict(scaler_kind="sharded", clip="torch")),
        ("ours_repeat", dict(scaler_kind="ours_default")),
    ]
    for name, kw in plan:
        runs[name] = train(ctx, wrap="fsdp", optimizer="foreach", fsdp_mode=mode, **kw)
    for name, r in runs.items():
        ctx.log(f"  fsdp2 {name}: {r['seconds']:.2f} s, skips {r['skips'][0]}, final scale {r['scales'][0][-1]:g}, "
                f"final loss {r['final_loss']:.4f}")
    store["runs"] = {k: summary(v) for k, v in runs.items()}
    for name in ("ours", "sharded", "ours_clip_ours", "sharded_clip_torch"):
        rank_agreement_checks(ctx, S, name, runs[name])
    store["parity"] = {}
    label = "ours vs ShardedGradScaler"
    store["parity"][label] = parity_checks(ctx, S, label, runs["ours"], runs["sharded"], mode="close")
    label = "ours.clip_grad_norm_ vs ShardedGradScaler.unscale_ + clip_grad_norm_ (DTensor)"
    p = store["parity"][label] = parity_checks(ctx, S, label, runs["ours_clip_ours"], runs["sharded_clip_torch"],
                                               mode="diverging")
    p["norms"] = norm_checks(ctx, S, label, runs["ours_clip_ours"], runs["sharded_clip_torch"])
    rep_same = torch.equal(runs["ours"]["params"], runs["ours_repeat"]["params"])
    ctx.check(S, "run-to-run determinism (ours twice)", rep_same,
              "max abs diff %.3e" % param_diff(ctx, runs["ours"]["params"], runs["ours_repeat"]["params"])[0],
              info=True)
    store["determinism_bitwise"] = rep_same


def section_overhead(ctx, store):
    cuda = ctx.dev_type == "cuda"
    device, world = ctx.device, dist.group.WORLD
    if cuda:
        shapes, steps, reps, warm = gpt2_small_shapes(), ctx.args.bench_steps, ctx.args.bench_reps, 3
        suite = "GPT-2 small (148 tensors, 124M fp32)"
    else:
        shapes, steps, reps, warm = [(256, 64), (64,), (64, 256), (256,)] * 4, 3, 2, 1
        suite = "tiny (16 tensors, CPU)"
    get_norm = getattr(torch.nn.utils, "get_total_norm", None)
    clip_with = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    rows = []
    for fused in (True, False):
        for clip in (False, True):
            gen = torch.Generator(device=device).manual_seed(0)
            params = [nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in shapes]
            scaled = [torch.randn(s, device=device, generator=gen) * 2.0**16 * 1e-3 for s in shapes]
            grads = [torch.empty_like(p) for p in params]
            for p, g in zip(params, grads):
                p.grad = g
            opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if fused else {"foreach": True}))
            one = torch.ones((), device=device, requires_grad=True)

            def restore():
                torch._foreach_copy_(grads, scaled)

            def plain():
                restore()
                if clip:
                    torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
                opt.step()

            def torch_loop(s):
                def fn():
                    restore()
                    s.scale(one)
                    if clip:
                        s.unscale_(opt)
                        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
                    s.step(opt)
                    s.update()
                return fn

            def torch_ar_loop(s):
                def fn():
                    restore()
                    s.scale(one)
                    if clip:
                        s.unscale_(opt)  # found_inf all-reduced inside
                        if get_norm is not None:
                            local_norm = get_norm(grads, 2.0, foreach=True)
                        else:
                            local_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
                        sq = local_norm * local_norm
                        dist.all_reduce(sq, group=world)
                        total = sq.sqrt()
                        if clip_with is not None:
                            clip_with(params, MAX_NORM, total, foreach=True)
                        else:
                            torch._foreach_mul_(grads, torch.clamp(MAX_NORM / (total + 1e-6), max=1.0))
                    s.step(opt)  # fused: found_inf all-reduced in torch's check pass
                    s.update()
                return fn

            def ours_loop(s):
                def fn():
                    restore()
                    s.scale(one)
                    if clip:
                        s.clip_grad_norm_(opt, MAX_NORM)
                    s.step(opt)
                    s.update()
                return fn

            loops = {
                "plain": plain,
                "torch": torch_loop(torch.amp.GradScaler(ctx.dev_type)),
                "torch+AR": torch_ar_loop(TorchAllReduceScaler(ctx.dev_type, process_group=world)),
                "ours": ours_loop(GradScaler(ctx.dev_type)),
                "ours+AR": ours_loop(GradScaler(ctx.dev_type, process_group=world, sharded_grads=True)),
            }
            for fn in loops.values():
                for _ in range(warm):
                    fn()
            times = {k: [] for k in loops}
            for _ in range(reps):
                for name, fn in loops.items():  # interleaved, so drift hits every loop alike
                    ctx.sync()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        fn()
                    ctx.sync()
                    times[name].append((time.perf_counter() - t0) * 1e3 / steps)
                    dist.barrier()
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"optimizer": "AdamW fused" if fused else "AdamW foreach", "clip": clip, "ms": med,
                   "overhead_ms": {k: med[k] - med["plain"] for k in loops if k != "plain"},
                   "all_ms": times}
            rows.append(row)
            ctx.log(f"  {row['optimizer']:14} clip={clip!s:5} plain {med['plain']:.3f} ms; overhead: "
                    + ", ".join(f"{k} {v:+.3f}" for k, v in row["overhead_ms"].items()))
            del params, scaled, grads, opt, loops
            if cuda:
                torch.cuda.empty_cache()
    store.update({"suite": suite, "steps_per_rep": steps, "reps": reps, "rows": rows,
                  "loops": {
                      "plain": "restore grads; clip: torch.nn.utils.clip_grad_norm_ (local, no collective); step",
                      "torch": "torch.amp.GradScaler: scale; clip: unscale_ + clip_grad_norm_ (local); step; update",
                      "torch+AR": "torch.amp.GradScaler + found_inf all_reduce(MAX) in every check/unscale pass; "
                                  "clip: unscale_, local get_total_norm, all_reduce(SUM) of its square, sqrt, "
                                  "clip_grads_with_norm_; step; update",
                      "ours": "adaptive_amp.GradScaler(): scale; clip: clip_grad_norm_ (local); step; update",
                      "ours+AR": "adaptive_amp.GradScaler(process_group=WORLD, sharded_grads=True): found_inf "
                                 "all_reduce(MAX); clip: clip_grad_norm_ with sum of squares all_reduce(SUM); "
                                 "step; update"}})


# ----------------------------------------------------------------------------- report

def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _clean(x.tolist())
    return x


def render_text(ctx) -> str:
    res = ctx.results
    meta = res["meta"]
    out = ["adaptive_amp.GradScaler multi-GPU validation", "=" * 44]
    for k in ("torch", "cuda", "nccl", "devices", "backend", "world_size", "steps", "batch_per_rank", "length",
              "growth_interval", "inject_steps", "NCCL_NVLS_ENABLE", "adaptive_amp"):
        if k in meta:
            out.append(f"{k:16} {meta[k]}")
    out.append("")
    secs = res["sections"]
    for name in ("ddp", "fsdp2"):
        sec = secs.get(name)
        if not sec or "runs" not in sec:
            continue
        out.append(f"[{name}]" + (f"  mixed precision: {sec.get('mixed_precision')}" if name == "fsdp2" else ""))
        if sec.get("autocast_error"):
            out.append(f"  autocast failed, fell back: {sec['autocast_error']}")
        head = f"  {'run':22} {'skips (rank 0)':28} {'ranks agree':>11} {'final scale':>12} {'final loss':>10} {'ms/step':>8}"
        out += [head, "  " + "-" * (len(head) - 2)]
        for run, r in sec["runs"].items():
            agree = all(s == r["skips"][0] for s in r["skips"])
            out.append(f"  {run:22} {str(r['skips'][0])[:28]:28} {str(agree):>11} {r['final_scale'][0]:12g} "
                       f"{r['final_loss']:10.4f} {r['ms_per_step']:8.2f}")
        for label, p in sec.get("parity", {}).items():
            line = (f"  parity {label}: max abs param diff {p['max_abs_diff']:.3e} (rel {p['rel_diff']:.2e}), "
                    f"bitwise {p['bitwise']}, final loss {p['final_loss'][0]:.4f} vs {p['final_loss'][1]:.4f}")
            if "norms" in p:
                line += f", norm rel diff first {p['norms']['first_rel']:.2e} median {p['norms']['median_rel']:.2e}"
            out.append(line)
        out.append(f"  run-to-run determinism (bitwise): {sec.get('determinism_bitwise')}")
        out.append("")
    sv = secs.get("single_vs_ddp")
    if sv and "single_final_loss" in sv:
        out.append("[single process vs DDP]")
        out.append(f"  final loss (mean of last {sv['final_loss_window']} steps): single {sv['single_final_loss']:.4f}, "
                   f"DDP seed 0 {sv['ddp_final_loss_seed0']:.4f}, DDP seed 1 {sv['ddp_final_loss_seed1']:.4f}; "
                   f"spread {sv['spread']:.4f}, tolerance {sv['tolerance']:.4f}")
        out.append("")
    ov = secs.get("overhead")
    if ov and "rows" in ov:
        out.append(f"[overhead per step, rank 0, {ov['suite']}; median of {ov['reps']} x {ov['steps_per_rep']} steps]")
        names = ["torch", "torch+AR", "ours", "ours+AR"]
        head = (f"  {'optimizer':14} {'clip':5} {'plain ms':>9} " + " ".join(f"{n + ' ovh':>13}" for n in names)
                + f" {'ours+AR/torch+AR':>17}")
        out += [head, "  " + "-" * (len(head) - 2)]
        for r in ov["rows"]:
            o = r["overhead_ms"]
            ratio = o["ours+AR"] / o["torch+AR"] if o["torch+AR"] > 0 else float("nan")
            out.append(f"  {r['optimizer']:14} {str(r['clip']):5} {r['ms']['plain']:9.3f} "
                       + " ".join(f"{o[n]:13.3f}" for n in names) + f" {ratio:17.2f}")
        out.append("  loops:")
        for k, v in ov["loops"].items():
            out.append(f"    {k}: {v}")
        out.append("")
    out.append("[checks]")
    for c in res["checks"]:
        out.append(f"  {'PASS' if c['passed'] else 'FAIL'} {c['section']}: {c['name']}{' (info)' if c['info'] else ''}"
                   f"{' -- ' + c['detail'] if c['detail'] else ''}")
    failed = [c for c in res["checks"] if not c["passed"] and not c["info"]]
    out.append(f"\n{len(res['checks'])} checks, {len(failed)} failed (not counting info)")
    if res["errors"]:
        out.append("\n[errors]")
        for e in res["errors"]:
            out.append(f"  section {e['section']} (rank {e['rank']}):\n{e['traceback']}")
    out.append(f"section seconds: {res.get('section_seconds')}")
    return "\n".join(out) + "\n"


def write_outputs(ctx):
    if ctx.rank != 0:
        return
    os.makedirs(ctx.args.out, exist_ok=True)
    with open(os.path.join(ctx.args.out, "multi_gpu.json"), "w") as f:
        json.dump(_clean(ctx.results), f, indent=1, allow_nan=False)
    with open(os.path.join(ctx.args.out, "multi_gpu.txt"), "w") as f:
        f.write(render_text(ctx))


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="torchrun --standalone --nproc_per_node=2 -m adaptive_amp bench multi-gpu",
                                 description=__doc__.split("\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank per step (16 on cuda, 4 on cpu)")
    ap.add_argument("--length", type=int, default=None, help="sequence length (64 on cuda, 32 on cpu)")
    ap.add_argument("--growth-interval", type=int, default=None, help="default max(2, steps // 6)")
    ap.add_argument("--bench-steps", type=int, default=20)
    ap.add_argument("--bench-reps", type=int, default=7)
    ap.add_argument("--sections", default="ddp,single,fsdp,overhead")
    ap.add_argument("--timeout", type=float, default=180.0, help="process-group timeout, seconds")
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.batch is None:
        args.batch = 16 if args.device == "cuda" else 4
    if args.length is None:
        args.length = 64 if args.device == "cuda" else 32
    if args.growth_interval is None:
        args.growth_interval = max(2, args.steps // 6)
    return args


def main(argv=None) -> int:
    """Parses `argv`; under torchrun, runs the sections and ends the process (see _dist_exit); else returns 2."""
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("multi-gpu: start it with torchrun, one process a GPU:\n  torchrun --standalone --nproc_per_node=2 "
              "-m adaptive_amp bench multi-gpu --out DIR\n(on the CPU: ... --backend gloo --device cpu)",
              file=sys.stderr)
        return 2
    finish(_run(args))  # not through the interpreter's shutdown: gloo's workers abort it (see _dist_exit)


def _run(args) -> int:
    t_start = time.perf_counter()
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout),
                                device_id=torch.device("cuda", local_rank))
    else:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    ctx = Ctx(args)
    meta = ctx.results["meta"]
    meta.update({"torch": torch.__version__, "cuda": torch.version.cuda, "backend": args.backend,
                 "world_size": ctx.world, "device": args.device, "steps": args.steps,
                 "batch_per_rank": args.batch, "length": args.length, "growth_interval": args.growth_interval,
                 "inject_steps": ctx.inject_steps, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
                 "adaptive_amp": build_info(), "argv": sys.argv})
    if args.device == "cuda":
        meta["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # pragma: no cover
            pass
    ctx.log(f"multi_gpu: world {ctx.world}, {args.backend}/{args.device}, {args.steps} steps, "
            f"inject inf on rank 1 at {ctx.inject_steps}")
    wanted = args.sections.split(",")
    sections = ctx.results["sections"]
    seconds = ctx.results["section_seconds"] = {}
    ddp_runs = None
    for name in ("ddp", "single", "fsdp", "overhead"):
        if name not in wanted:
            continue
        if name == "single" and ddp_runs is None:
            continue
        key = {"single": "single_vs_ddp", "fsdp": "fsdp2"}.get(name, name)
        store = sections[key] = {}
        ctx.log(f"== {key}")
        t0 = time.perf_counter()
        try:
            if name == "ddp":
                ddp_runs = section_ddp(ctx, store)
            elif name == "single":
                section_single(ctx, store, ddp_runs)
            elif name == "fsdp":
                section_fsdp(ctx, store)
            else:
                section_overhead(ctx, store)
        except Exception:
            tb = traceback.format_exc()
            print(f"[rank {ctx.rank}] section {key} raised:\n{tb}", file=sys.stderr, flush=True)
            ctx.results["errors"].append({"section": key, "rank": ctx.rank, "traceback": tb})
            store["error"] = tb
        seconds[key] = round(time.perf_counter() - t0, 2)
        ctx.log(f"   {key}: {seconds[key]:.1f} s")
        write_outputs(ctx)
    ctx.results["total_seconds"] = round(time.perf_counter() - t_start, 2)
    write_outputs(ctx)
    if ctx.rank == 0:
        failed = [c for c in ctx.checks if not c["passed"] and not c["info"]]
        print(f"multi_gpu: {len(ctx.checks)} checks, {len(failed)} failed; errors: {len(ctx.results['errors'])}; "
              f"{ctx.results['total_seconds']:.1f} s; wrote {args.out}/multi_gpu.json and multi_gpu.txt", flush=True)
        if failed or ctx.results["errors"]:
            print("verdict: NOT as torch's scalers under data parallelism: "
                  + "; ".join(f"{c['section']}: {c['name']}" for c in failed[:5])
                  + (f"; {len(ctx.results['errors'])} section(s) raised" if ctx.results["errors"] else ""), flush=True)
        else:
            print(f"verdict: on {ctx.world} ranks, adaptive_amp.GradScaler skipped the same steps on every rank and "
                  "matched torch's scalers (DDP: torch.amp.GradScaler with found_inf all-reduced; FSDP2: "
                  "ShardedGradScaler) in every check; the overhead table is in multi_gpu.txt", flush=True)
    return 1 if ctx.results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
