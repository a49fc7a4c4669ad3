"""The controller and the integrations under data parallelism: same decisions on every rank, no hang.

    torchrun --standalone --nproc_per_node=2 -m adaptive_amp bench multi-gpu-integrations --out DIR
        [--backend nccl|gloo] [--device cuda|cpu] [--steps N]

A tiny transformers GPT-2 (random weights, nothing downloaded) trains in
fp16 under data parallelism. At steps 0 and 1 the output of ``lm_head``
overflows on rank 1 alone (a forward hook writes an inf into it), so:

* both ranks must skip those steps (found_inf all-reduced by the scaler),
* the overflow storm that follows must promote ``lm_head`` to an fp32 island
  on every rank at the same step, although only rank 1's layer statistics
  saw it (the collective controller takes the union over ranks),
* scales, clip norms and parameters must agree on every rank afterwards.

In the torch DDP sections, rank 1's gradient alone (after DDP's all-reduce)
also gets an inf at step 5: every rank must skip that step too.

Sections (every rank runs every one; rank 0 writes DIR/multi_gpu_integrations.json
and prints PASS/FAIL per check; exit status 1 if a section raised or a check failed):

  controller  torch DDP + CollectiveAdaptiveMixedPrecision, clipping at 1.0;
              the same run with the plain controller (each rank decides alone)
              up to its first decision, as a control: its ranks must decide
              differently (run further, their collectives would stop matching).
  resume      the collective run saved at step 4 (model, optimizer and the
              controller's state_dict on every rank) and resumed in a fresh
              model: parameters bitwise equal to the straight run's.
  fsdp2       fully_shard on each block and the root, the collective controller
              (its gradient statistics are of each rank's shard; the clip norm
              is the scaler's, all-reduced).
  lightning   Trainer(strategy="ddp", plugins=[AdaptivePrecision(...)]).
  lightning_fsdp2  Trainer(strategy=ModelParallelStrategy(...)) (FSDP2 through
              configure_model), the same plugin.
  accelerate  Accelerator() (DDP) + adaptive_amp.integrations.accelerate.attach, adaptive_amp's fused
              AdamW; saved with accelerator.save_state at step 4 and resumed with load_state
              into a fresh Accelerator, model and optimizer: parameters bitwise equal.
  accelerate_fsdp2  the same through Accelerate's FSDP strategy: Accelerator(fsdp_plugin=
              FullyShardedDataParallelPlugin(fsdp_version=2)), torch's AdamW. On GPUs Accelerate
              picks FSDP from the plugin itself (checked); on the CPU it never does (FSDP
              only on accelerators), so the CPU run sets the distributed type to FSDP
              and says so; everything after that is Accelerate's own FSDP2 code.

On two GPUs (NCCL) it takes well under a minute; on the CPU (gloo) about as long.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import adaptive_amp  # noqa: E402
from ..distributed import CollectiveAdaptiveMixedPrecision  # noqa: E402
from ._dist_exit import finish  # noqa: E402

POLICY = "params=float32,compute=float16,loss_scale=dynamic:1024:growth_interval=1000"
CONTROLLER = dict(read_every=2, stats_every=2, storm_rate=0.25, progress=False)
INJECT_STEPS = (0, 1)
INJECT_RANK = 1
GRAD_INF_STEP = 5  # torch DDP sections: an inf in rank 1's gradient alone
VOCAB, SEQ = 96, 16


def tiny_gpt2(device):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).to(device)


def batches(steps, rank, device):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (4, SEQ), generator=g).to(device) for _ in range(steps)]


class Injector:
    """Writes an inf into lm_head's float16 output on one rank at chosen steps (the caller sets .step).

    Only while lm_head computes in float16: the overflow an fp32 island cures. An inf written into the
    island's float32 output too would be an overflow no island cures, and the controller, which promotes
    the step it diagnoses, would rightly count it against the new policy (an overflow storm: a switch).
    .injected lists the steps it wrote at.
    """

    def __init__(self, model, rank):
        self.step = -1
        self.on = rank == INJECT_RANK
        self.injected = []
        lm_head = model.lm_head
        lm_head.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        if self.on and self.step in INJECT_STEPS and module.training and out.dtype == torch.float16:
            out = out.clone()
            out.view(-1)[0] = float("inf")
            if self.step not in self.injected:
                self.injected.append(self.step)
            return out
        return None


def injected(per_rank):
    """How many steps the injecting rank overflowed at (every rank must skip them all)."""
    return max(len(r["injected"]) for r in per_rank)


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class Report:
    def __init__(self, out):
        self.out = out
        self.checks = []
        self.errors = []
        self.facts = {}

    def check(self, section, name, passed, detail=""):
        self.checks.append({"section": section, "name": name, "passed": bool(passed), "detail": detail})
        if dist.get_rank() == 0:
            print(f"[{section}] {'PASS' if passed else 'FAIL'}: {name}" + (f" ({detail})" if detail else ""),
                  flush=True)

    def save(self):
        if dist.get_rank() == 0:
            os.makedirs(self.out, exist_ok=True)
            with open(os.path.join(self.out, "multi_gpu_integrations.json"), "w") as f:
                json.dump({"checks": self.checks, "errors": self.errors, "facts": self.facts}, f, indent=1,
                          default=str)


def agree(report, section, per_rank, key, name=None):
    values = [r[key] for r in per_rank]
    same = all(json.dumps(v) == json.dumps(values[0]) for v in values)
    report.check(section, name or f"{key} identical on all ranks", same, "" if same else f"{values}")
    return same


def promoted_lm_head(per_rank, section, report, expect_name="lm_head"):
    ok = all(any("islands=" in policy and expect_name in policy for _, policy in r["policy_history"][1:])
             for r in per_rank)
    report.check(section, f"{expect_name} promoted to an fp32 island on every rank", ok,
                 "" if ok else str([r["policy_history"] for r in per_rank]))


def summary(amp, model, extra=None):
    s = {"policy_history": [list(p) for p in amp.policy_history],
         "events": [(e.step, e.kind) for e in amp.events if e.kind in ("promote", "switch_compute", "demote",
                                                                      "diagnose")],
         "skipped": amp.scaler.skipped_steps, "scale": amp.scaler.get_scale() if amp.scaler.is_enabled() else None,
         "params_sum": float(sum(p.detach().double().sum() for p in model.parameters()))}
    s.update(extra or {})
    return s


# ----------------------------------------------------------------------------- sections

def train_raw(ctx, make, steps, start=0, state=None):
    """torch DDP around the GPT-2; `make` builds the controller. Returns (model, amp, {norms, injected}, saved)."""
    device = ctx["device"]
    model = tiny_gpt2(device)
    injector = Injector(model, dist.get_rank())
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                    else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    amp = make(model, opt, POLICY, **CONTROLLER)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        amp.load_state_dict(state["amp"])
    norms, saved = [], None
    data = batches(steps, dist.get_rank(), device)
    for i in range(start, steps):
        injector.step = i
        with amp.autocast():
            loss = ddp(input_ids=data[i], labels=data[i]).loss
        amp.backward(loss)
        if i == GRAD_INF_STEP and dist.get_rank() == INJECT_RANK:
            # After DDP's all-reduce: only this rank's gradients hold the inf, so only an all-reduced
            # found_inf makes the other rank skip too.
            model.transformer.h[0].mlp.c_fc.weight.grad.view(-1)[0] = float("inf")
        amp.step(max_grad_norm=1.0)
        # The norm of a step that was skipped is each rank's own (inf where the inf was): compare the rest.
        stepped = amp.scaler.is_enabled() and not amp.scaler.found_inf.item()
        norms.append(float(amp.scaler.last_grad_norm) if stepped else None)
        amp.zero_grad()
        if ctx.get("save_at") == i + 1:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "opt": copy.deepcopy(opt.state_dict()), "amp": amp.state_dict()}
    return model, amp, {"norms": norms, "injected": injector.injected}, saved


def section_controller(ctx, report):
    steps = ctx["steps"]
    ctx["save_at"] = 4
    model, amp, extra, saved = train_raw(ctx, CollectiveAdaptiveMixedPrecision, steps)
    ctx["saved"], ctx["straight"] = saved, [p.detach().clone() for p in model.parameters()]
    per_rank = gather(summary(amp, model, extra))
    report.facts["controller"] = per_rank
    agree(report, "controller", per_rank, "policy_history", "the same policies at the same steps on all ranks")
    agree(report, "controller", per_rank, "events", "the same decisions (promote/switch/diagnose) on all ranks")
    agree(report, "controller", per_rank, "skipped", "the same skipped-step count on all ranks")
    agree(report, "controller", per_rank, "scale")
    agree(report, "controller", per_rank, "norms", "clip norms identical on all ranks (steps taken)")
    agree(report, "controller", per_rank, "params_sum", "parameters identical on all ranks")
    need = injected(per_rank) + 1  # and the inf in a gradient at GRAD_INF_STEP
    report.check("controller", "the injected steps were skipped on every rank",
                 need > 1 and all(r["skipped"] >= need for r in per_rank),
                 str([r["skipped"] for r in per_rank]) + f", {need} injected")
    promoted_lm_head(per_rank, "controller", report)

    def plain(model, opt, policy, **kw):  # each rank decides alone; the scaler still agrees on found_inf
        return adaptive_amp.AdaptiveMixedPrecision(model, opt, policy, scaler_kwargs={"process_group":
                                                                                     dist.group.WORLD}, **kw)

    # Only to the first decision: after it the ranks' policies differ, and once one rank retires its
    # scaler (a compute switch) the ranks' collectives no longer match, which gloo aborts on and NCCL
    # hangs on. That is the failure the collective controller exists to prevent.
    ctx["save_at"] = None
    model, amp, _, _ = train_raw(ctx, plain, CONTROLLER["read_every"])
    control = gather(summary(amp, model))
    report.facts["control"] = control
    differ = json.dumps(control[0]["policy_history"]) != json.dumps(control[1]["policy_history"])
    report.check("controller", "control: without the collective the ranks' policies differ (the overflow was "
                 "rank-local)", differ, str([c["policy_history"] for c in control]))


def section_resume(ctx, report):
    steps = ctx["steps"]
    model, amp, _, _ = train_raw(ctx, CollectiveAdaptiveMixedPrecision, steps, start=4, state=ctx["saved"])
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ctx["straight"]))
    report.check("resume", "resumed parameters bitwise equal to the straight run (every rank)",
                 all(gather(same)))
    per_rank = gather(summary(amp, model))
    agree(report, "resume", per_rank, "policy_history", "the same policies at the same steps on all ranks")
    report.check("resume", "resumed step count on every rank", all(gather(amp.step_count == steps)))


def section_fsdp2(ctx, report):
    from torch.distributed.fsdp import fully_shard

    device = ctx["device"]
    model = tiny_gpt2(device)
    injector = Injector(model, dist.get_rank())
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    amp = CollectiveAdaptiveMixedPrecision(model, opt, POLICY, **CONTROLLER)
    data = batches(ctx["steps"], dist.get_rank(), device)
    for i in range(ctx["steps"]):
        injector.step = i
        with amp.autocast():
            loss = model(input_ids=data[i], labels=data[i]).loss
        amp.backward(loss)
        amp.step(max_grad_norm=1.0)
        amp.zero_grad()
    # The recorded gradient norms are the clip norms, all-reduced over the shards by the scaler.
    norms = amp.report(plots=False).history["grad_norm"]
    full_sum = float(sum(p.detach().full_tensor().double().sum() for p in model.parameters()))
    per_rank = gather(summary(amp, torch.nn.Module(), {"norms": norms, "params_sum": full_sum,
                                                       "injected": injector.injected}))
    report.facts["fsdp2"] = per_rank
    agree(report, "fsdp2", per_rank, "policy_history", "the same policies at the same steps on all ranks")
    agree(report, "fsdp2", per_rank, "skipped", "the same skipped-step count on all ranks")
    agree(report, "fsdp2", per_rank, "scale")
    agree(report, "fsdp2", per_rank, "norms", "clip norms identical on all ranks")
    need = injected(per_rank)
    report.check("fsdp2", "the injected steps were skipped", need > 0 and all(r["skipped"] >= need
                                                                              for r in per_rank))
    promoted_lm_head(per_rank, "fsdp2", report)


def fit_lightning(ctx, strategy, shard=False):
    """Lightning's Trainer.fit of the tiny GPT-2 (an overflow injected on this rank) under our plugin and
    `strategy`; shard: FSDP2 (``fully_shard`` per block, then the root) in configure_model. Returns
    (plugin, module)."""
    import pytorch_lightning as pl

    from adaptive_amp.integrations.lightning import AdaptivePrecision

    device = ctx["device"]
    rank = dist.get_rank()

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2("cpu")
            self.injector = Injector(self.model, rank)

        def configure_model(self):
            if not shard:
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            self.injector.step = self.global_step
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=shard)

    plugin = AdaptivePrecision(POLICY, **CONTROLLER)
    module = Lit()
    data = [b.cpu() for b in batches(ctx["steps"], rank, "cpu")]
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=dist.get_world_size(),
                         strategy=strategy, max_steps=ctx["steps"], plugins=[plugin], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         gradient_clip_val=1.0, use_distributed_sampler=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    return plugin, module


def section_lightning(ctx, report):
    plugin, module = fit_lightning(ctx, "ddp")
    per_rank = gather(summary(plugin.amp, module, {"injected": module.injector.injected}))
    report.facts["lightning"] = per_rank
    agree(report, "lightning", per_rank, "policy_history", "the same policies at the same steps on all ranks")
    agree(report, "lightning", per_rank, "skipped", "the same skipped-step count on all ranks")
    agree(report, "lightning", per_rank, "params_sum", "parameters identical on all ranks")
    report.check("lightning", "the collective controller was used",
                 isinstance(plugin.amp, CollectiveAdaptiveMixedPrecision))
    promoted_lm_head(per_rank, "lightning", report, "model.lm_head")


def section_lightning_fsdp2(ctx, report):
    from pytorch_lightning.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=dist.get_world_size(), tensor_parallel_size=1)
    plugin, module = fit_lightning(ctx, strategy, shard=True)
    norms = plugin.amp.report(plots=False).history["grad_norm"]
    full_sum = float(sum(p.detach().full_tensor().double().sum() for p in module.parameters()))
    per_rank = gather(summary(plugin.amp, torch.nn.Module(), {"norms": norms, "params_sum": full_sum,
                                                              "injected": module.injector.injected}))
    report.facts["lightning_fsdp2"] = per_rank
    agree(report, "lightning_fsdp2", per_rank, "policy_history", "the same policies at the same steps on all ranks")
    agree(report, "lightning_fsdp2", per_rank, "skipped", "the same skipped-step count on all ranks")
    agree(report, "lightning_fsdp2", per_rank, "norms", "clip norms identical on all ranks")
    need = injected(per_rank)
    report.check("lightning_fsdp2", "the injected steps were skipped",
                 need > 0 and all(r["skipped"] >= need for r in per_rank))
    promoted_lm_head(per_rank, "lightning_fsdp2", report, "model.lm_head")


def new_accelerator(ctx, fsdp):
    """An Accelerator with FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``) or Accelerate's default
    (DDP). Returns (accelerator, forced): `forced` when Accelerate would not pick FSDP itself (on the CPU)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    # Accelerate keeps one state per process: an Accelerator made after another one keeps the first one's
    # distributed type whatever plugin it is given (the 2-GPU run's FSDP section got MULTI_GPU that way).
    # Forget it (as Accelerate's own tests do between cases); the process group stays.
    AcceleratorState._reset_state(reset_partial_state=True)
    # An Accelerator given an fsdp_plugin sets ACCELERATE_USE_FSDP=true for the process, which would turn
    # every later plugin-less Accelerator into FSDP too.
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    plugin = None
    if fsdp:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["GPT2Block"])
    accelerator = Accelerator(cpu=ctx["device"].type == "cpu", mixed_precision="no", fsdp_plugin=plugin)
    forced = False
    if fsdp and accelerator.distributed_type == DistributedType.MULTI_CPU:
        # Accelerate turns a multi-process run into FSDP only on accelerators (AcceleratorState switches
        # MULTI_GPU/NPU/XPU/... to FSDP; MULTI_CPU is not in that list, and its own FSDP tests require a
        # non-CPU device). fully_shard itself runs on the CPU with gloo, so the CPU run sets the distributed
        # type where Accelerate's FSDP branch would have (PartialState's too: every AcceleratorState()
        # copies it) and then goes through Accelerate's own FSDP2 prepare, save_state and load_state.
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        forced = True
    return accelerator, forced


def train_accelerate(ctx, fsdp, steps, start=0, save_dir=None, save_at=None):
    """The plain Accelerate loop on the GPT-2 with adaptive_amp attached; resumes from `save_dir` when
    `start` > 0, saves there after step `save_at`. Returns (accelerator, forced, amp, params, record)."""
    from adaptive_amp.integrations.accelerate import attach

    rank = dist.get_rank()
    accelerator, forced = new_accelerator(ctx, fsdp)
    model = tiny_gpt2("cpu")
    injector = Injector(model, rank)
    if fsdp:  # adaptive_amp.optim takes plain tensors, not FSDP2's DTensor parameters
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    else:
        opt = adaptive_amp.optim.AdamW(model.parameters(), lr=1e-3)  # fused: skips on the device
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    amp = attach(accelerator, model, opt, POLICY, **CONTROLLER)
    if start:
        accelerator.load_state(save_dir)
    skipped = []
    data = batches(steps, rank, accelerator.device)
    for i in range(start, steps):
        injector.step = i
        loss = model(input_ids=data[i], labels=data[i]).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        skipped.append(bool(accelerator.optimizer_step_was_skipped))
        opt.zero_grad()
        if save_at == i + 1:
            accelerator.save_state(save_dir)
    params = list(accelerator.unwrap_model(model).parameters())
    record = {"skipped_flags": skipped, "injected": injector.injected, "sched_steps": sched.scheduler.last_epoch}
    return accelerator, forced, amp, params, record


def _local(p):
    return p.detach().to_local() if type(p).__name__ == "DTensor" else p.detach()


def section_accelerate(ctx, report, fsdp=False):
    name = "accelerate_fsdp2" if fsdp else "accelerate"
    steps, save_at = ctx["steps"], 4
    save_dir = os.path.join(ctx["out"], f"{name}_checkpoint")
    accelerator, forced, amp, params, record = train_accelerate(ctx, fsdp, steps, save_dir=save_dir,
                                                                save_at=save_at)
    straight = [_local(p).clone() for p in params]
    norms = amp.report(plots=False).history["grad_norm"]
    full_sum = float(sum((p.detach().full_tensor() if type(p).__name__ == "DTensor" else p.detach()).double().sum()
                         for p in params))
    per_rank = gather(summary(amp, torch.nn.Module(), {**record, "params_sum": full_sum, "norms": norms,
                                                       "distributed_type": accelerator.distributed_type.name}))
    report.facts[name] = per_rank
    report.facts[f"{name}_forced_fsdp"] = forced
    if fsdp:
        if rank0():
            print(f"[{name}] Accelerate's distributed type: {per_rank[0]['distributed_type']}"
                  + (" (set by this script: Accelerate picks FSDP on accelerators only)" if forced else ""),
                  flush=True)
        report.check(name, "Accelerate trains with its FSDP strategy (FSDP2) on every rank",
                     all(r["distributed_type"] == "FSDP" for r in per_rank) and accelerator.is_fsdp2)
        if ctx["device"].type == "cuda":
            report.check(name, "Accelerate chose FSDP itself (fsdp_plugin, no configuration file)", not forced)
        report.check(name, "Accelerate sharded the parameters (DTensors)",
                     all(type(p).__name__ == "DTensor" for p in params))
    agree(report, name, per_rank, "policy_history", "the same policies at the same steps on all ranks")
    agree(report, name, per_rank, "skipped_flags", "step_was_skipped (found_inf) identical on all ranks")
    agree(report, name, per_rank, "scale")
    agree(report, name, per_rank, "norms", "clip norms identical on all ranks")
    agree(report, name, per_rank, "params_sum", "parameters identical on all ranks")
    r0 = per_rank[0]
    # (Accelerate's scheduler wrapper steps once per process for each optimizer step)
    stepped = (steps - sum(r0["skipped_flags"])) * dist.get_world_size()
    report.check(name, "the injected steps were skipped on every rank and the scheduler stepped only on the others",
                 r0["sched_steps"] == stepped and sum(r0["skipped_flags"]) >= max(1, injected(per_rank)),
                 f"{r0['sched_steps']} scheduler steps, flags {r0['skipped_flags']}, {injected(per_rank)} injected")
    promoted_lm_head(per_rank, name, report)

    # Resume: a fresh Accelerator, model and optimizer, accelerator.load_state of the step-4 checkpoint.
    accelerator, _, amp2, params, record2 = train_accelerate(ctx, fsdp, steps, start=save_at, save_dir=save_dir)
    same = all(torch.equal(_local(p), q) for p, q in zip(params, straight))
    report.check(name, "resumed through save_state/load_state: parameters bitwise equal to the straight run "
                 "(every rank)", all(gather(same)))
    # The losses before the checkpoint are each rank's own (different batches): they show whose state it is.
    losses = amp.report(plots=False).history["loss"]
    losses2 = amp2.report(plots=False).history["loss"]
    resumed = gather({"policy_history": [list(p) for p in amp2.policy_history], "step": amp2.step_count,
                      "skipped": amp2.scaler.skipped_steps, "flags": record2["skipped_flags"],
                      "own": amp2.policy_history == amp.policy_history and amp2.step_count == amp.step_count
                      and amp2.scaler.skipped_steps == amp.scaler.skipped_steps
                      and record2["skipped_flags"] == record["skipped_flags"][save_at:]
                      and json.dumps(losses2) == json.dumps(losses)})
    report.facts[f"{name}_resumed"] = resumed
    report.check(name, "resumed controller: each rank continues its own state (step count, skips, policies, "
                 "its own loss history)", all(r["own"] for r in resumed), str(resumed))
    dist.barrier()
    if rank0():
        shutil.rmtree(save_dir, ignore_errors=True)


def rank0():
    return dist.get_rank() == 0


SECTIONS = {"controller": section_controller, "resume": section_resume, "fsdp2": section_fsdp2,
            "lightning": section_lightning, "lightning_fsdp2": section_lightning_fsdp2,
            "accelerate": section_accelerate,
            "accelerate_fsdp2": lambda ctx, report: section_accelerate(ctx, report, fsdp=True)}


def main(argv=None):
    """Parses `argv`; under torchrun, runs the sections and ends the process (see _dist_exit); else returns 2."""
    parser = argparse.ArgumentParser(
        prog="torchrun --standalone --nproc_per_node=2 -m adaptive_amp bench multi-gpu-integrations",
        description=__doc__.split("\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--timeout", type=int, default=300, help="seconds a collective may wait (a hang fails)")
    args = parser.parse_args(argv)
    if args.steps < 6:
        parser.error("--steps must be >= 6 (the resume section restarts at step 4)")
    unknown = [n for n in args.sections.split(",") if n not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    if "RANK" not in os.environ:
        print("multi-gpu-integrations: start it with torchrun, one process a GPU:\n  torchrun --standalone "
              "--nproc_per_node=2 -m adaptive_amp bench multi-gpu-integrations --out DIR\n"
              "(on the CPU: ... --backend gloo --device cpu)", file=sys.stderr)
        return 2
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    torch.use_deterministic_algorithms(True, warn_only=True)
    ctx = {"device": device, "steps": args.steps, "out": args.out}
    report = Report(args.out)
    for name in args.sections.split(","):
        try:
            SECTIONS[name](ctx, report)
        except Exception:  # a section that raised is reported; the rest still run
            report.errors.append({"section": name, "rank": dist.get_rank(), "error": traceback.format_exc()})
            print(f"[{name}] rank {dist.get_rank()} raised:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        report.save()
    failed = [c for c in report.checks if not c["passed"]]
    if dist.get_rank() == 0:
        print(f"{len(report.checks) - len(failed)}/{len(report.checks)} checks passed, "
              f"{len(report.errors)} section errors", flush=True)
        if failed or report.errors:
            print("verdict: the ranks did NOT always agree or a section failed: "
                  + "; ".join(str(c.get("name", c)) for c in failed[:5]), flush=True)
        else:
            print(f"verdict: on {dist.get_world_size()} ranks the controller and the integrations took the same "
                  "decisions at the same steps on every rank, resumed bitwise, and nothing hung", flush=True)
    ok = not failed and not report.errors
    finish(0 if ok else 1)  # not through the interpreter's shutdown: gloo's workers abort it (see _dist_exit)


if __name__ == "__main__":
    sys.exit(main())
