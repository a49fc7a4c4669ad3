"""adaptive_amp inside a real PyTorch Lightning Trainer (CPU): the plain scaler drop-in and AdaptivePrecision.

A tiny transformers GPT-2 (random weights) trains for a few steps under
deterministic algorithms; runs are compared bitwise with Lightning's own
MixedPrecision path where the arithmetic is the same.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

# Lightning trainers on a transformers GPT-2, bitwise against Lightning's own path: seconds each (`pytest -m slow`).
pytestmark = pytest.mark.slow

pl = pytest.importorskip("pytorch_lightning")
pytest.importorskip("transformers")

import adaptive_amp  # noqa: E402
from adaptive_amp.integrations.lightning import AdaptiveFabricPrecision, AdaptivePrecision  # noqa: E402
from adaptive_amp.layers import is_compiled  # noqa: E402
from pytorch_lightning.plugins.precision import MixedPrecision  # noqa: E402

from _integ_models import lit_gpt2_class, tiny_gpt2, token_batches  # noqa: E402
from conftest import counting_aot_eager, cuda_param, requires_cuda  # noqa: E402

FP16 = "params=float32,compute=float16,loss_scale=dynamic:1024:growth_interval=3"


LitGPT2 = lit_gpt2_class(pl.LightningModule)


@pytest.fixture(autouse=True)
def _restore_determinism():
    """Trainer(deterministic=True) turns torch's deterministic algorithms on for the process and leaves them on
    (then every torch.empty is filled: tests/test_e2e_ops_script.py, run after these, counted aten::fill_)."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _trainer(plugin, max_steps=5, device="cpu", ns=pl, **kw):
    return ns.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=max_steps,
                      plugins=[plugin], logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=kw.pop("enable_checkpointing", False), deterministic=True,
                      num_sanity_val_steps=0, **kw)


def _fit(plugin, steps=5, module=None, ckpt_path=None, trainer_kw=None, data=None, device="cpu", ns=pl,
         **module_kw):
    """`ns`: the Lightning package whose Trainer runs it (pytorch_lightning, or lightning.pytorch)."""
    ns.seed_everything(0, verbose=False)
    if module is None:
        module = (LitGPT2 if ns is pl else lit_gpt2_class(ns.LightningModule))(**module_kw)
    trainer = _trainer(plugin, max_steps=steps, device=device, ns=ns, **(trainer_kw or {}))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*The number of training batches.*")
        data = token_batches(16) if data is None else data
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None),
                    ckpt_path=ckpt_path)
    return trainer, module


def _same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs"


@pytest.mark.parametrize("device", ["cpu", cuda_param()])
def test_mixed_precision_takes_our_scaler_bitwise(device):
    """The plain path: Lightning's MixedPrecision with our GradScaler == with torch's, bitwise (an overflow
    injected so that the skip and backoff are compared too)."""
    theirs = torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=3)
    ours = adaptive_amp.GradScaler(device, init_scale=1024.0, growth_interval=3)
    _, m_theirs = _fit(MixedPrecision("16-mixed", device, scaler=theirs), inject_inf_at=[2], device=device)
    _, m_ours = _fit(MixedPrecision("16-mixed", device, scaler=ours), inject_inf_at=[2], device=device)
    _same_params(m_theirs, m_ours)
    assert m_theirs.losses == m_ours.losses
    assert theirs.get_scale() == ours.get_scale()
    assert ours.skipped_steps == 1


@pytest.mark.parametrize("device", ["cpu", cuda_param()])
@pytest.mark.parametrize("precision,policy", [("16-mixed", FP16), ("bf16-mixed", "params=float32,compute=bfloat16")])
def test_adaptive_precision_matches_lightning_amp_bitwise(precision, policy, device):
    """AdaptivePrecision with a fixed fp16 (or bf16) policy trains exactly as Lightning's own AMP path."""
    scaler = torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=3) if precision == "16-mixed" else None
    _, m_theirs = _fit(MixedPrecision(precision, device, scaler=scaler), inject_inf_at=[2] if scaler else (),
                       device=device)
    plugin = AdaptivePrecision(policy, read_every=2)
    trainer, m_ours = _fit(plugin, inject_inf_at=[2] if scaler else (), device=device)
    _same_params(m_theirs, m_ours)
    assert m_theirs.losses == m_ours.losses
    amp = plugin.amp
    assert amp.step_count == 5 and trainer.global_step == 5
    assert plugin.precision == precision
    if scaler is not None:
        assert amp.scaler.get_scale() == scaler.get_scale()
        assert amp.scaler.skipped_steps == 1
        report = amp.report(plots=False)
        assert report.history["found_inf"][:5] == [0, 0, 1, 0, 0]


def test_adaptive_precision_auto_one_argument():
    """`Trainer(plugins=[AdaptivePrecision("auto")])`: the controller selects for this CPU and trains."""
    plugin = AdaptivePrecision("auto")
    trainer, module = _fit(plugin, steps=3)
    expected = adaptive_amp.AdaptivePrecisionSelector().select(
        module, adaptive_amp.HardwareDetector().detect(torch.device("cpu")))
    assert str(plugin.amp.policy) == str(expected)
    assert plugin.amp.step_count == 3 and all(torch.isfinite(torch.tensor(module.losses)))


def test_bf16_pure_with_sr_optimizer():
    plugin = AdaptivePrecision("bf16-pure")
    _, module = _fit(plugin, steps=6, optimizer="sr", lr=1e-2, data=token_batches(1) * 6)
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert module.losses[-1] < module.losses[0]
    assert plugin.precision == "bf16-true"


def test_bf16_weights_with_sr_optimizer():
    # The matmul layers' weights are cast before the optimizer exists; the norms stay fp32, autocast computes.
    from adaptive_amp.recipes import matmul_layers

    plugin = AdaptivePrecision("bf16-weights")
    _, module = _fit(plugin, steps=6, optimizer="sr", lr=1e-2, data=token_batches(1) * 6)
    matmul = {id(p) for _, m in matmul_layers(module) for p in m.parameters(recurse=False)}
    assert matmul and {p.dtype for p in module.parameters() if id(p) in matmul} == {torch.bfloat16}
    assert {p.dtype for p in module.parameters() if id(p) not in matmul} == {torch.float32}
    assert module.losses[-1] < module.losses[0]
    assert plugin.precision == "bf16-mixed" and str(plugin.amp.policy).endswith("scope=matmul")


def test_bf16_pure_refuses_a_plain_optimizer():
    with pytest.raises(TypeError, match="stochastically"):
        _fit(AdaptivePrecision("bf16-pure"), steps=1)


def test_fp8_presets_measure_their_layers_through_the_plugin():
    """policy="bf16-pure+fp8": the module is cast to bf16 before the optimizer exists, as for "bf16-pure", and
    the controller measures each layer for fp8 when fit sets it up (on the CPU none can run in fp8: each layer
    stays as it was, with why)."""
    batch = token_batches(1)[0]
    plugin = AdaptivePrecision("bf16-pure+fp8", sample_inputs=batch,
                               fp8=dict(run=lambda module, b: module.model(input_ids=b)))
    assert plugin.precision == "bf16-true"
    _, module = _fit(plugin, steps=3, optimizer="sr", lr=1e-2)
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert str(plugin.amp.policy) == "params=bfloat16,compute=bfloat16"
    measured = [r for r in plugin.amp.policy.reasons if r.startswith("layer model.transformer.h.0.mlp.c_fc")]
    assert len(measured) == 1 and "not fp8" in measured[0], plugin.amp.policy.reasons
    assert AdaptivePrecision("bf16+fp8").precision == "bf16-mixed"


def test_a_bf16_fp8_preset_trains_its_measured_fp8_layers_in_the_trainer(fp8_here):
    """Where fp8 can run (here: allowed on the CPU, with a table of gains), the layers measured to gain and
    tolerate it go to fp8 when fit sets the module up, and the Trainer trains them so."""
    gains = lambda layer, shape, kind: 1.4 if 128 in layer.weight.shape else 0.9  # the MLPs (32 <-> 128) # noqa: E731
    plugin = AdaptivePrecision("bf16+fp8", sample_inputs=token_batches(1)[0],
                               fp8=dict(gain_fn=gains, run=lambda module, b: module.model(input_ids=b)))
    _, module = _fit(plugin, steps=4)
    assert plugin.amp.adjuster.layer_kinds == {f"model.transformer.h.{i}.mlp.{n}": "fp8-tensorwise"
                                               for i in (0, 1) for n in ("c_fc", "c_proj")}
    assert "layers=model.transformer.h.*.mlp.c_fc:fp8-tensorwise" in str(plugin.amp.policy)
    assert plugin.precision == "bf16-mixed"
    assert all(math.isfinite(x) for x in module.losses) and plugin.amp.step_count == 4


@pytest.mark.cuda
@requires_cuda
def test_a_compiled_module_takes_fp8_in_its_large_layers_on_the_gpu():
    """On a GPU with fp8 matmuls, ``fit(torch.compile(module))`` with "bf16+fp8": the gains are timed compiled, as
    the layers run, and the 4096-wide layers at 8,192 tokens (which gain about 1.25x on an H100 or H200) go to
    fp8, the small head stays bf16; the module trains."""
    from adaptive_amp import fp8

    why = fp8.fp8_unavailable("cuda")
    if why:
        pytest.skip(why)

    class Wide(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096))
            self.head = torch.nn.Linear(4096, 16)
            self.losses = []

        def forward(self, x):
            return self.head(self.body(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self(x).float(), y)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8192, 4096, generator=g), torch.randint(0, 16, (8192,), generator=g))] * 4
    plugin = AdaptivePrecision("bf16+fp8", sample_inputs=data[0][0].cuda())
    torch._dynamo.reset()
    _, module = _fit(plugin, steps=8, module=torch.compile(Wide()), data=data, device="cuda")
    assert plugin.amp.adjuster.layer_kinds == {"body.0": "fp8-tensorwise", "body.2": "fp8-tensorwise"}, \
        plugin.amp.policy.reasons
    losses = [float(x) for x in module.losses]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    torch._dynamo.reset()


@pytest.mark.parametrize("policy, match", [("fp16+fp8", "fp8 stacks on"), ("bf16+fp8+ckpt", "one of"),
                                           ("bf16-wieghts", "bf16-wieghts")])
def test_a_policy_the_plugin_cannot_run_is_refused_at_construction(policy, match):
    with pytest.raises(ValueError, match=match):
        AdaptivePrecision(policy)


def test_under_ddp_a_tuning_skips_the_casts_ddp_cannot_take_and_a_cast_preset_trains():
    """strategy="ddp": the plugin's controller gets the module DDP wraps. A tuning skips the recipes that would cast
    its float32 weights to bf16 after DDP wrapped them (its gradients would no longer be averaged); "bf16-pure"
    casts in convert_module, before the strategy wraps the module, and trains."""
    batches = token_batches(2)
    tune = dict(batches=batches, loss_fn=lambda m, b: m.model(input_ids=b, labels=b).loss,
                candidates=["fp32", "bf16-pure"], steps=2)
    try:
        plugin = AdaptivePrecision("tune", tune=tune)
        _fit(plugin, steps=2, trainer_kw={"strategy": "ddp"})
        assert torch.distributed.is_initialized()  # (the plugin ran under DDP)
        assert plugin.amp.tuning.recipe.name == "fp32"
        assert [(n, "DistributedDataParallel wraps" in why) for n, why in plugin.amp.tuning.skipped] == \
            [("bf16-pure", True)]
        plugin = AdaptivePrecision("bf16-pure")
        _, module = _fit(plugin, steps=2, optimizer="sr", trainer_kw={"strategy": "ddp"})
        assert all(p.dtype == torch.bfloat16 for p in module.parameters()) and plugin.amp.step_count == 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_fabric_tune_converts_the_optimizer_fabric_saves():
    """Fabric with policy="tune": a choice with bf16 weights converts the optimizer fabric.setup wrapped in place,
    so that what fabric.save saves (the wrapper's state_dict) holds the moments that train."""
    Fabric = pytest.importorskip("lightning_fabric").Fabric
    torch.manual_seed(0)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = token_batches(3)
    precision = AdaptiveFabricPrecision("tune", tune=dict(
        batches=batches[:2], loss_fn=lambda m, b: m(input_ids=b, labels=b).loss, candidates=["bf16-pure"], steps=2))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[precision])
    model, wrapped = fabric.setup(model, opt)
    amp = precision.connect(model, wrapped)
    assert amp.tuning.recipe.name == "bf16-pure" and amp.optimizers == [opt]
    assert isinstance(opt, adaptive_amp.optim.AdamW)
    for batch in batches:
        fabric.backward(model(input_ids=batch, labels=batch).loss)
        wrapped.step()
        wrapped.zero_grad()
    assert amp.step_count == 3 and all(p.dtype == torch.bfloat16 for p in model.parameters())
    state = wrapped.state_dict()["state"]
    assert len(state) == len(list(model.parameters())) and all(float(s["step"]) == 3 for s in state.values())


def test_tune_steps_and_checkpoints_the_optimizer_its_choice_converts(tmp_path):
    """policy="tune" choosing bf16-pure converts the optimizer in place when fit sets up the module: the Trainer
    steps and checkpoints it (its LR scheduler still drives it), and a resume, which tunes again from the
    restored weights, trains on with the saved moments. (Not bitwise: Lightning does not restore the RNG that
    stochastic rounding draws on.)"""
    from pytorch_lightning.callbacks import ModelCheckpoint

    data = token_batches(3)
    tune = dict(batches=data[:2], loss_fn=lambda m, b: m.model(input_ids=b, labels=b).loss,
                candidates=["bf16-pure"], steps=2)
    every3 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    straight = AdaptivePrecision("tune", tune=tune)
    trainer, m_straight = _fit(straight, steps=6, data=data,
                               trainer_kw={"enable_checkpointing": True, "callbacks": [every3]})
    assert straight.amp.tuning.recipe.name == "bf16-pure" and straight.precision == "bf16-true"
    converted = straight.amp.optimizers[0]
    assert isinstance(converted, adaptive_amp.optim.AdamW) and trainer.optimizers == [converted]
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is converted
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == [g["lr"] for g in converted.param_groups]
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert len(saved["optimizer_states"][0]["state"]) == len(list(m_straight.parameters()))

    resumed = AdaptivePrecision("tune", tune=tune)
    trainer, m_resumed = _fit(resumed, steps=3, ckpt_path=str(ckpt), data=data)  # restored, nothing to train
    assert trainer.optimizers == resumed.amp.optimizers and resumed.amp.step_count == 3
    loaded = resumed.amp.optimizers[0].state_dict()["state"]
    assert loaded.keys() == saved["optimizer_states"][0]["state"].keys()
    for index, state in saved["optimizer_states"][0]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[index][key], state[key]), (index, key)
    assert all(p.dtype == torch.bfloat16 for p in m_resumed.parameters())
    assert all(torch.equal(p, saved["state_dict"][n]) for n, p in m_resumed.named_parameters())


def test_clip_by_norm_goes_through_the_controller():
    """gradient_clip_val clips in the controller's step: same parameters as Lightning's unscale + clip."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    _, m_theirs = _fit(MixedPrecision("16-mixed", "cpu", scaler=scaler), trainer_kw={"gradient_clip_val": 0.05})
    _, m_ours = _fit(AdaptivePrecision(FP16), trainer_kw={"gradient_clip_val": 0.05})
    # The norm comes from the unscale pass (fp64 across chunks), so it may differ from torch's in the last bits.
    for p, q in zip(m_theirs.parameters(), m_ours.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_checkpoint_resume_continues_bitwise(tmp_path):
    """The controller's state rides in Lightning's checkpoints: resuming from step 3 ends where 6 straight
    steps end (an overflow at step 4, after the resume)."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    data = token_batches(3)
    every3 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    straight = AdaptivePrecision(FP16, read_every=2)
    _, m_straight = _fit(straight, steps=6, inject_inf_at=[4], data=data,
                         trainer_kw={"enable_checkpointing": True, "callbacks": [every3]})
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    saved = torch.load(ckpt, weights_only=True)  # plain types only: torch's safe loader takes it
    assert saved["AdaptivePrecision"]["adaptive_amp"]["step"] == 3

    resumed = AdaptivePrecision(FP16, read_every=2)
    _, m_resumed = _fit(resumed, steps=6, ckpt_path=str(ckpt), inject_inf_at=[4], data=data)
    _same_params(m_straight, m_resumed)
    assert m_resumed.losses == m_straight.losses[3:]
    assert resumed.amp.step_count == 6
    assert resumed.amp.scaler.state_dict() == straight.amp.scaler.state_dict()
    assert resumed.amp.scaler.skipped_steps == straight.amp.scaler.skipped_steps == 1
    # (as JSON: the skipped step's gradient norm is NaN, which == would call different from itself)
    assert json.dumps(resumed.amp.state_dict()["monitor"]) == json.dumps(straight.amp.state_dict()["monitor"])


def test_validate_without_fit_uses_the_policy_autocast():
    class Val(LitGPT2):
        def validation_step(self, batch, batch_idx):
            self.seen = self.model.transformer.h[0].attn.c_attn(
                self.model.transformer.wte(batch)).dtype

    module = Val()
    trainer = _trainer(AdaptivePrecision("params=float32,compute=bfloat16"))
    trainer.validate(module, torch.utils.data.DataLoader(token_batches(1), batch_size=None), verbose=False)
    assert module.seen == torch.bfloat16


@pytest.mark.parametrize("fabric_package", ["lightning_fabric", "lightning.fabric"])
def test_fabric_twin_trains_like_the_controller(fabric_package):
    """The twin in Fabric (lightning_fabric's, or the unified package's lightning.fabric): bitwise the
    controller's own loop (an overflow injected, Fabric's clip_gradients)."""
    Fabric = pytest.importorskip(fabric_package).Fabric

    def run(use_fabric):
        torch.manual_seed(0)
        model = tiny_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        if use_fabric:
            precision = AdaptiveFabricPrecision(FP16, read_every=2)
            fabric = Fabric(accelerator="cpu", devices=1, plugins=[precision])
            model, opt = fabric.setup(model, opt)
            amp = precision.connect(model, opt)
        else:
            amp = adaptive_amp.AdaptiveMixedPrecision(model, opt, FP16, read_every=2, progress=False)
        for i, batch in enumerate(token_batches(5)):
            if use_fabric:
                loss = model(input_ids=batch, labels=batch).loss
                fabric.backward(loss * (float("inf") if i == 2 else 1.0))
                if i != 2:  # Fabric refuses to clip a non-finite norm by default
                    fabric.clip_gradients(model, opt, max_norm=1.0)
                opt.step()
                opt.zero_grad()
            else:
                with amp.autocast():
                    loss = model(input_ids=batch, labels=batch).loss
                amp.backward(loss * (float("inf") if i == 2 else 1.0))
                if i != 2:
                    amp.scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                amp.step()
                amp.zero_grad()
        return model, amp

    m_ref, amp_ref = run(False)
    m_fab, amp_fab = run(True)
    for p, q in zip(m_ref.parameters(), m_fab.parameters()):
        assert torch.equal(p, q)
    assert amp_fab.scaler.skipped_steps == 1 and amp_fab.step_count == 5
    assert amp_fab.state_dict()["scaler"] == amp_ref.state_dict()["scaler"]


def test_fabric_twin_explains_a_missing_connect():
    with pytest.raises(RuntimeError, match=r"precision.connect\(model, optimizer\)"):
        AdaptiveFabricPrecision("auto").backward(torch.ones(()), None)


def test_gradient_accumulation_matches_lightning_amp_bitwise():
    """accumulate_grad_batches: the controller steps once per two backwards, as Lightning's AMP path does."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    kw = {"trainer_kw": {"accumulate_grad_batches": 2}, "inject_inf_at": [1]}
    _, m_theirs = _fit(MixedPrecision("16-mixed", "cpu", scaler=scaler), steps=3, **kw)
    # One injected overflow in a two-step read window is a 50% skip rate: above the default storm_rate
    # the controller would rightly switch to bf16, which Lightning's AMP has no counterpart for.
    plugin = AdaptivePrecision(FP16, read_every=2, storm_rate=0.5)
    trainer, m_ours = _fit(plugin, steps=3, **kw)
    assert len(plugin.amp.policy_history) == 1, plugin.amp.events
    _same_params(m_theirs, m_ours)
    assert len(m_ours.losses) == 6 and m_ours.losses == m_theirs.losses
    assert plugin.amp.step_count == 3 and plugin.amp.scaler.skipped_steps == 1
    assert plugin.amp.scaler.get_scale() == scaler.get_scale()


def test_fabric_twin_takes_one_optimizer():
    model = tiny_gpt2()
    a = torch.optim.SGD(model.parameters(), lr=0.1)
    b = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="pass one optimizer"):
        AdaptiveFabricPrecision(FP16).connect(model, a, b)


# ------------------------------------------------ the unified package: lightning.pytorch, lightning.fabric

def _unified():
    return pytest.importorskip("lightning.pytorch")


def test_one_plugin_class_for_both_lightning_packages():
    """pytorch_lightning and lightning.pytorch hold separate copies of Precision; each Trainer takes only
    its own package's, so the plugins derive from both (with both installed, as the test extra pins)."""
    L = _unified()
    import lightning.fabric
    import lightning_fabric

    assert isinstance(AdaptivePrecision(FP16), (pl.plugins.precision.Precision))
    assert isinstance(AdaptivePrecision(FP16), L.plugins.precision.Precision)
    assert isinstance(AdaptiveFabricPrecision(FP16), lightning_fabric.plugins.Precision)
    assert isinstance(AdaptiveFabricPrecision(FP16), lightning.fabric.plugins.Precision)


def test_unified_trainer_matches_its_own_amp_bitwise():
    """lightning.pytorch.Trainer: AdaptivePrecision (and the plain path, its MixedPrecision with our scaler)
    train exactly as its MixedPrecision with torch's scaler, an overflow included."""
    L = _unified()
    from lightning.pytorch.plugins.precision import MixedPrecision as UnifiedMixedPrecision

    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    ours = adaptive_amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    _, m_theirs = _fit(UnifiedMixedPrecision("16-mixed", "cpu", scaler=theirs), inject_inf_at=[2], ns=L)
    _, m_plain = _fit(UnifiedMixedPrecision("16-mixed", "cpu", scaler=ours), inject_inf_at=[2], ns=L)
    plugin = AdaptivePrecision(FP16, read_every=2)
    trainer, m_ours = _fit(plugin, inject_inf_at=[2], ns=L)
    assert isinstance(m_ours, L.LightningModule) and not isinstance(m_ours, pl.LightningModule)
    _same_params(m_theirs, m_plain)
    _same_params(m_theirs, m_ours)
    assert m_theirs.losses == m_plain.losses == m_ours.losses
    assert plugin.amp.step_count == 5 and trainer.global_step == 5
    assert ours.skipped_steps == plugin.amp.scaler.skipped_steps == 1
    assert theirs.get_scale() == ours.get_scale() == plugin.amp.scaler.get_scale()


def test_unified_trainer_checkpoint_resume_continues_bitwise(tmp_path):
    """The controller's state in lightning.pytorch's checkpoints: resuming at step 3 ends where 6 straight
    steps end (an overflow at step 4, after the resume)."""
    L = _unified()
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = token_batches(3)
    every3 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    straight = AdaptivePrecision(FP16, read_every=2)
    _, m_straight = _fit(straight, steps=6, inject_inf_at=[4], data=data, ns=L,
                         trainer_kw={"enable_checkpointing": True, "callbacks": [every3]})
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    assert torch.load(ckpt, weights_only=True)["AdaptivePrecision"]["adaptive_amp"]["step"] == 3
    resumed = AdaptivePrecision(FP16, read_every=2)
    _, m_resumed = _fit(resumed, steps=6, ckpt_path=str(ckpt), inject_inf_at=[4], data=data, ns=L)
    _same_params(m_straight, m_resumed)
    assert m_resumed.losses == m_straight.losses[3:]
    assert resumed.amp.step_count == 6 and resumed.amp.scaler.skipped_steps == 1
    assert json.dumps(resumed.amp.state_dict()["monitor"]) == json.dumps(straight.amp.state_dict()["monitor"])


def test_a_compiled_lightning_module_compiles_one_block_for_its_statistics_steps():
    """``trainer.fit(torch.compile(module))``: Lightning replaces the module's forward and training_step with
    compiled ones. The controller's statistics steps then run the repeated blocks through one block graph, as for
    a model compiled by hand, instead of compiling the whole step a second time with its hooks."""
    class Compilable(LitGPT2):  # no .item() and no global_step in the step: the same graphs every step
        def __init__(self):
            super().__init__()
            # (with a key-value cache the statistics steps run eagerly: test_regional.py has that case)
            self.model.config.use_cache = False

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

    def fit(plugin):
        graphs = []
        torch._dynamo.reset()
        pl.seed_everything(0, verbose=False)
        _fit(plugin, module=torch.compile(Compilable(), backend=counting_aot_eager(graphs)))
        return graphs

    theirs = fit(MixedPrecision("bf16-mixed", "cpu"))
    plugin = AdaptivePrecision("params=float32,compute=bfloat16", read_every=2, stats_every=2)
    ours = fit(plugin)
    # Lightning's own graphs of the whole step (the model's, and the loss's after transformers' graph break), and
    # one more before them: a block's, at the first step (a statistics step), smaller than the model's. (Without
    # it: the whole step compiled again with the hooks, [187, 12, 155, 12].)
    assert ours[1:] == theirs and ours[0] < theirs[0], (ours, theirs)
    assert sorted({ls.step for ls in plugin.amp.monitor.layer_stats}) == [0, 2, 4]
    # What the fp8 map and the tuner read to time its layers compiled, as the step runs.
    assert is_compiled(plugin.amp.model)
