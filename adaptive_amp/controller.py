"""AdaptiveMixedPrecision: drives the training loop and keeps training alive.

It picks a precision policy (from the hardware, an optional sensitivity
analysis and user overrides), applies it with a DynamicPrecisionAdjuster,
scales the loss with adaptive_amp.GradScaler where the policy needs it, and
watches the run with a StabilityMonitor. When fp16 turns out wrong for this
model it adapts between steps, logging every decision as an event:

1. an overflow is diagnosed when it appears: the steps after one (found_inf
   of the loss scaler) collect per-layer activation statistics (three of
   them); at the first of them that overflows too, every layer whose fp16
   output overflowed out of finite inputs becomes an fp32 island in one
   decision, the loss scale goes back to where it was before the overflows,
   and the new policy's first steps are watched the same way (a chain of
   overflowing layers is promoted link by link, a step each). A layer whose
   output overflows at a statistics step that skipped nothing (an op
   downstream masked the infs: a clamp, tanh, a softmax, a mask) is promoted
   too, the step after (its statistics are read then, without waiting);
2. if that is not enough (overflows that no layer explains in two watched
   steps, an overflow storm over a read window, or more than
   ``max_promotions`` rounds), compute switches to bf16 where bf16 is native
   and loss scaling retires; elsewhere compute falls back to fp32;
3. optionally (``demote_after``), an island promoted here is given back to
   the compute dtype after that many stable steps; a layer that overflows
   again is promoted again and waits twice as long the next time.

Seeing an overflow costs no host synchronization in healthy steps: whether a
step overflowed is the host bool the scaler's step already computed (torch's
GradScaler synchronizes there too), or, for optimizers that skip on the
device (``fused=True``, adaptive_amp.optim), the scaler's found_inf, copied to
pinned memory in stream order and read during the next step, when the device
has finished the step it belongs to and has the next one queued: such an
overflow is diagnosed one step later, and the device never waits for the
host. Statistics of the watched step are read at once, but only when that
step overflowed. fp16 compute always runs with a loss scaler; with
``loss_scale=none`` it is one whose scale is fixed at 1, so an overflowing
step is still skipped rather than writing infs into the weights.

No decision rebuilds the optimizer or touches parameters, and no step is
lost beyond those the scaler had already skipped.

Layers a policy's per-layer map puts in fp8 (``layers=*.mlp.*:fp8-tensorwise``,
or measured: policy ``"bf16+fp8"``, ``"bf16-weights+fp8"``, ``"bf16-pure+fp8"``)
are guarded: at statistics steps each one's input gives
adaptive_amp.fp8.Fp8Guard a row (cast statistics, output error against a
float32 recompute), and between steps a layer that stops tolerating fp8
moves to bf16 in the map (event ``fp8_demote``) and back after a stable
period (``fp8_restore``), waiting twice as long after each relapse.

A policy that keeps parameters in its compute dtype ("bf16-pure") runs
without autocast, as the plain loop does: autocast would compute its fp32
ops (layer norms, pow in GELU, softmax, ...) in fp32 and keep fp32 copies
for the backward pass; floating-point inputs are cast to bf16 instead.
"bf16-weights" (``param_scope="matmul"``) keeps only the matmul layers'
weights in bf16 and runs under autocast, its embeddings returning fp32 (the
residual stream and the norms then compute as under torch's autocast).
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import warnings
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from .adjust import DynamicPrecisionAdjuster
from .analysis import PrecisionAnalyzer
from .collect import STATS_DTYPES as _STATS_DTYPES, ActivationCollector
from .layers import Selector, compiled_layers, find_layers, is_sharded, unwrap_model
from .hardware import Capabilities, HardwareDetector
from .detectors import finite_inputs, overflowing_rows
from .monitor import Event, StabilityMonitor, SumsOfSquares, builtin_values
from .optim import _Fused
from .names import fp8_preset
from .policy import AdaptivePrecisionSelector, PrecisionPolicy, dtype_name, recipe_policy
from .layer_precision import OwnedHandles
from .recipes import cast_for_policy, cast_refusal, policy_hooks
from .regional import RegionalStatistics
from .scaler import GradScaler, OptState, _takes_grad_scaler
from .step_result import HostSlots, StepResult

_COMPUTE_FORMATS = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Steps watched (activation statistics collected) after an overflow or a policy change: the next overflow in
# them is diagnosed, even when a fused optimizer's skip is read a step late or the overflows come and go.
_WATCH_STEPS = 3


@contextlib.contextmanager
def _tracking_grad_norm(optimizers):
    """The fused optimizers measure the gradient norm in their steps inside the block; as they were after."""
    before = [opt.track_grad_norm for opt in optimizers]
    for opt in optimizers:
        opt.track_grad_norm = True
    try:
        yield
    finally:
        for opt, was in zip(optimizers, before):
            opt.track_grad_norm = was


def _norm_of_norms(norms: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The L2 norm of several parts' norms (0-dim tensors of one device); None for none."""
    if not norms:
        return None
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def _check_clip_args(max_norm, norm_type, name: str = "max_grad_norm") -> None:
    """A clip to a negative or NaN norm would flip or poison every gradient: refused by name."""
    number = isinstance(max_norm, numbers.Real) and not isinstance(max_norm, bool)
    if not (isinstance(max_norm, torch.Tensor) or (number and max_norm >= 0)):
        raise ValueError(f"{name} must be a number >= 0 (inf: measure the norm without clipping), got {max_norm!r}")
    order = float(norm_type) if isinstance(norm_type, numbers.Real) else math.nan
    if norm_type == "inf":  # (torch's clip takes the string too)
        order = math.inf
    if isinstance(norm_type, bool) or math.isnan(order):
        raise ValueError(f"norm_type must be a number (2.0, or inf for the largest magnitude), got {norm_type!r}")


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


class AdaptiveMixedPrecision:
    """Mixed precision that chooses its policy and adapts it while training runs.

    Usage::

        amp = AdaptiveMixedPrecision(model, optimizer, policy="auto", sample_inputs=batch)
        for batch in data:
            with amp.autocast():
                loss = loss_fn(model(batch))
            amp.backward(loss)
            amp.step(max_grad_norm=1.0)
            amp.zero_grad()
        print(amp.report())

    Args:
        model: the model (its parameters stay as they are: fp32 master weights),
            eager or compiled (``torch.compile``, before or after this
            wraps it; create the controller before the compiled model's
            first call, so that its graph has the statistics hooks). Layers
            are named as in the eager model (no ``_orig_mod.``).
        optimizer_or_optimizers: one optimizer or a list; all step together.
        policy: ``"auto"`` (detect the hardware, analyze the model when
            `sample_inputs` are given, select), ``"tune"`` (measure candidate
            recipes on the model, see `tune`), a PrecisionPolicy, or its
            string form (``"params=float32,compute=float16,loss_scale=dynamic:65536"``).
        sample_inputs: a batch for the sensitivity analysis of ``"auto"`` (and of
            ``"tune"``'s islands candidates): a tensor, a tuple of positional
            arguments, a dict of keyword arguments, or ``(args, kwargs)``
            (adaptive_amp.analysis.split_inputs).
        loss_fn: ``loss_fn(output) -> loss`` for the analysis' gradient statistics.
        capabilities: the Capabilities to select with (default: detected).
        overrides: policy fields that win over the selection (as
            AdaptivePrecisionSelector.select takes them).
        adapt: let the controller change the policy while training runs.
        read_every: steps between reads of the monitor (one transfer each).
        stats_every: steps between per-layer statistics steps (default: every
            fourth read window, 200 steps with the default ``read_every``).
            Where the host bounds the step, a statistics step costs about half
            an ordinary step more (16-27 ms on the 35 ms step of a compiled
            Llama 1.1B at 4x256 tokens, H200). An overflow is diagnosed at once
            whatever this is: the steps after it collect statistics.
        storm_rate, scale_floor: what counts as an overflow storm over a read
            window (overflows the per-step diagnosis could not cure).
        max_promotions: promotion rounds before switching compute instead.
        switch_compute: after promotions fail, switch fp16 to bf16 (native)
            or fp32; False only logs.
        demote_after: stable steps before an island promoted here is given
            back (None: never, the default).
        include, exclude: which modules are layers (analyzed, watched, and
            promoted to islands): by default every module that owns weights;
            name patterns and/or module types (see adaptive_amp.layers).
        layer_stats: collect per-layer statistics every ``stats_every`` steps
            (False: only at the step after an overflow or a policy change,
            to diagnose it). In an eager model each layer is measured as it
            runs (one launch per layer), so a statistics step keeps no
            activation alive; a compiled graph measures them the same way
            inside it. With fp8 layers a statistics step also copies 1024
            rows of each fp8 layer's input for the guard, turned into its
            statistics as the forward ends (none is held through the
            backward, where a step peaks). Both come from the step's first
            forward with gradients: an evaluation in ``amp.autocast()`` under
            ``torch.no_grad()`` is not measured.
        track_grad_norm: without loss scaling or clipping, measure the
            gradient norm every step anyway (no sync), for the monitor's
            gradient-norm detector. adaptive_amp.optim's optimizers measure
            it in their step's own pass over the gradients; others take a
            second pass (torch._foreach_norm).
        scaler_kwargs: extra GradScaler arguments (mode, hysteresis, ...).
        monitor: a StabilityMonitor to use instead of the default one.
        tune: with policy="tune", ``dict(batches=..., loss_fn=fn(model, batch))`` and any option of
            AdaptivePrecisionSelector.tune; a chosen recipe with bf16 weights or moments converts the
            optimizer in place to its stochastic-rounding twin (adaptive_amp.recipes.convert_optimizer_in_place:
            its ``state_dict()`` holds the state that trains).
            ``amp.tuning`` holds the trials.
        memory_guard: an adaptive_amp.pressure.MemoryGuard: lighter recipes under memory pressure,
            and after an out-of-memory error in :meth:`train_step`.
        progress: show progress bars for the set-up's long work (the sensitivity
            analysis of ``"auto"``, the trials of ``"tune"``); tqdm's when it is
            installed (the ``progress`` extra). False: silent.
        fp8: fp8 layers' settings (adaptive_amp.fp8). A policy names its fp8 layers in its per-layer map
            (``"params=float32,compute=bfloat16,layers=*.mlp.*:fp8-tensorwise"``); where fp8 cannot run
            (torchao missing, no GPU with fp8 matmuls, a layer whose sizes fp8 cannot take) construction
            fails naming the reason and the layers, the model unchanged. policy="bf16+fp8" measures
            instead (adaptive_amp.fp8.select_fp8_layers on `sample_inputs`, or on ``fp8["batches"]``):
            bf16 autocast, each layer that gains and tolerates fp8 in it, every layer's decision in
            ``policy.reasons``; "bf16-weights+fp8" and "bf16-pure+fp8" measure the same over those presets
            (bf16 weights, an optimizer with stochastic rounding as they need). With policy="tune", the
            selection's options apply to the "+fp8" candidates (unless ``tune`` has its own ``fp8``).
            Keys: ``guard`` (an adaptive_amp.fp8.Fp8Guard; False: none), ``batches``, and
            select_fp8_layers' options (kinds, min_gain, max_error, gain_fn, run, ...; ``compiled`` defaults
            to where the model runs compiled, adaptive_amp.layers.compiled_layers: every layer of a model
            compiled whole (a torch.compile wrapper, in place, or a LightningModule Lightning compiled), the
            layers inside modules compiled in place, and none of an eager model). With `adapt`, the
            guard reads every fp8 layer at statistics steps and, between steps, moves a layer that stops
            tolerating fp8 to bf16 (event "fp8_demote") and back after a stable period ("fp8_restore").
    """

    #: The process group this controller's decisions are collective over (adaptive_amp.distributed); None: this
    #: process decides alone.
    process_group = None

    def __init__(self, model: nn.Module, optimizer_or_optimizers, policy: Union[str, PrecisionPolicy] = "auto",
                 sample_inputs=None, *, loss_fn=None, capabilities: Optional[Capabilities] = None, overrides=None,
                 adapt: bool = True, read_every: int = 50, stats_every: Optional[int] = None,
                 storm_rate: float = 0.25, scale_floor: float = 1.0,
                 max_promotions: int = 2, switch_compute: bool = True, demote_after: Optional[int] = None,
                 include: Selector = None, exclude: Selector = None, layer_stats: bool = True,
                 track_grad_norm: bool = True,
                 scaler_kwargs: Optional[dict] = None,
                 monitor: Optional[StabilityMonitor] = None, progress: bool = True,
                 tune: Optional[dict] = None, memory_guard=None, fp8: Optional[dict] = None):
        if isinstance(optimizer_or_optimizers, torch.optim.Optimizer):
            optimizers = [optimizer_or_optimizers]
        else:
            optimizers = list(optimizer_or_optimizers)
            if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
                raise TypeError("optimizer_or_optimizers must be a torch.optim.Optimizer or a non-empty list of them")
        if not 0 < storm_rate <= 1:
            raise ValueError(f"storm_rate must be in (0, 1], got {storm_rate}")
        if demote_after is not None and demote_after < 1:
            raise ValueError(f"demote_after must be >= 1 steps (or None to never demote), got {demote_after}")
        self.model = model
        self._module = unwrap_model(model)  # a compiled model's layers, with the eager model's names
        self.optimizers = optimizers
        # What the controller put on the model (statistics hooks, the policy's hooks, checkpointing), taken off by
        # remove() or when the controller is garbage collected; the islands are the adjuster's, which does the same.
        self._owned = OwnedHandles(self)
        self._policy_hooks = None
        self.device = _model_device(model)
        self.capabilities = capabilities or HardwareDetector().detect(self.device)
        self.analysis = None
        self.adapt = adapt
        self.storm_rate = float(storm_rate)
        self.scale_floor = float(scale_floor)
        self.max_promotions = int(max_promotions)
        self.switch_compute = switch_compute
        self.demote_after = demote_after
        self.include, self.exclude = include, exclude
        self.layers = find_layers(self._module, include, exclude)
        self.layer_stats = bool(layer_stats)
        self.track_grad_norm = bool(track_grad_norm)
        self._scaler_kwargs = dict(scaler_kwargs or {})
        if monitor is not None and stats_every is not None:
            raise ValueError("stats_every: the monitor given has its own; pass stats_every to its StabilityMonitor "
                             "instead")
        if stats_every is not None and (isinstance(stats_every, bool) or not isinstance(stats_every, int)
                                        or stats_every < 1):
            raise ValueError(f"stats_every must be an int >= 1 (steps between statistics steps) or None (every "
                             f"fourth read window), got {stats_every!r}")
        self.monitor = monitor or StabilityMonitor(read_every=read_every, stats_every=stats_every or 4 * read_every,
                                                   overflow_rate=storm_rate, scale_floor=scale_floor)

        # Registered now, before any compiled call of the model (policy="tune" makes some), so that its graphs
        # trace them.
        self._collector = self._owned.add(ActivationCollector(self.layers, root=self._module))
        self._regional = RegionalStatistics(self.model)
        self.tuning = None  # policy="tune": the TuneResult (trials, A/B table)
        self._tune_options = tune
        self._fp8_options = _fp8_options(fp8)
        self._fp8_watch = None  # the guard's eye on the fp8 layers (adaptive_amp.fp8.training.Fp8Watch)
        # A MemoryGuard (adaptive_amp.pressure): lighter recipes under memory pressure or out of memory.
        self.memory_guard = memory_guard
        self.adjuster = None
        self._tuned_undo = None  # policy="tune": its recipe's optimizer conversion and cast, if construction fails
        try:
            self.policy = self._resolve_policy(policy, sample_inputs, loss_fn, overrides, progress)
            # Everything that can refuse the arguments runs before the model is changed (the bf16 cast of
            # the parameters cannot be undone bitwise); the hooks and islands come off again on any error.
            self._check_param_dtype(self.policy)
            self.scaler = self._make_scaler(self.policy)
            self.adjuster = DynamicPrecisionAdjuster(model, self.policy)
            self._cast_params(self.policy)
        except BaseException:
            self._undo_setup()  # a refused construction leaves the model as it was
            if self._tuned_undo is not None:
                self._tuned_undo()  # (and the optimizer)
            raise
        self._tuned_undo = None  # (constructed: the tuned recipe stays)
        self._tf32_before = self._apply_tf32(self.policy.tf32)
        self._warned_no_records = False
        self._removed = False  # remove() ran: a statistics step it ends early has nothing to warn about

        self.events: List[Event] = []
        self.policy_history: List[tuple] = [(0, str(self.policy))]
        self._step = 0
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self._clip_total: Optional[torch.Tensor] = None  # the norm clip_grad_norm_ returned this step
        self._clip_max: Optional[float] = None  # the norm it clipped to: the monitor judges clipped spikes apart
        self._loss_known = True
        self._collected_activations = False
        # Adaptation state (all of it in state_dict).
        self._last_change = 0  # step from which the current policy has been judged
        self._promotions = 0  # promotion rounds since the last compute switch
        self._promoted: List[str] = []  # islands this controller added, oldest first
        self._demotions: Dict[str, int] = {}  # layer -> times it was demoted (its wait doubles each time)
        self._watch_left = 0  # steps that collect activation statistics next (after an overflow or a change)
        self._watched: Optional[int] = None  # the step whose activation statistics this step collected
        self._first_overflow: Optional[int] = None  # first step of the current run of overflowing steps
        self._unexplained = 0  # watched overflowing steps in a row whose loss was not finite and no layer to blame
        # Watched steps that stepped, whose layer outputs are judged once read (the read a statistics step
        # starts is taken during the next step where the values are on a device): an overflow that something
        # downstream masked (a clamp, tanh, softmax, a mask) skips no step and is found only there.
        self._masked_due: List[int] = []
        self._scale_before_storm = self.scaler.get_scale() if self.scaler.is_enabled() else None
        # (step, StepResult, watched) of the last step, when the device decided whether it stepped: judged
        # during the next step (see step()).
        self._pending: Optional[tuple] = None
        self._host_slots = HostSlots()
        # (the loss sum it is of, StepResult of its finiteness): queued by backward() where a step decides on
        # the host whether to skip for a non-finite loss.
        self._loss_check: Optional[tuple] = None
        self._loss_slots = HostSlots()
        self._applied: Optional[list] = None  # gradients a failed step() applied already (see step())
        self._watch_fp8()

    # ------------------------------------------------------------ set-up
    def _resolve_policy(self, policy, sample_inputs, loss_fn, overrides, progress) -> PrecisionPolicy:
        if isinstance(policy, PrecisionPolicy):
            return policy
        if not isinstance(policy, str):
            raise TypeError(f"policy must be 'auto', a PrecisionPolicy or its string form, got {type(policy).__name__}")
        if policy.strip().lower() == "tune":
            return self._tune(sample_inputs, loss_fn, overrides, progress)
        base = fp8_preset(policy)
        if base is not None:
            return self._measure_fp8(policy.strip(), base, sample_inputs, overrides)
        if policy.strip().lower() != "auto":
            return PrecisionPolicy.from_string(policy)
        if sample_inputs is not None:
            self.analysis = PrecisionAnalyzer(include=self.include, exclude=self.exclude, progress=progress).analyze(
                self.model, sample_inputs, loss_fn)
        return AdaptivePrecisionSelector().select(self.model, self.capabilities, self.analysis, overrides)

    def _tune(self, sample_inputs, loss_fn, overrides, progress) -> PrecisionPolicy:
        """policy="tune": analyze (with sample_inputs, for the islands variants), measure the candidates, and
        apply the chosen recipe's optimizer, parameter dtype and checkpointing (the policy, its fp8 layers
        included, is applied below as any other)."""
        from .recipes import AppliedRecipe

        options = dict(self._tune_options or {})
        if "batches" not in options or "loss_fn" not in options:
            raise ValueError("policy='tune' needs tune=dict(batches=[...], loss_fn=fn) where fn(model, batch) "
                             "returns the loss (and optionally candidates=, steps=, memory_budget=...: see "
                             "AdaptivePrecisionSelector.tune)")
        if overrides is not None:
            raise ValueError("policy='tune' measures candidates instead of taking overrides; restrict them with "
                             "tune=dict(candidates=[...])")
        if len(self.optimizers) != 1:
            raise ValueError(f"policy='tune' tunes one optimizer; got {len(self.optimizers)}")
        if self.process_group is not None:
            options.setdefault("process_group", self.process_group)  # (every rank takes the same branches)
        selection = {k: v for k, v in self._fp8_options.items() if k not in ("guard", "batches", "run")}
        if selection and "fp8" not in options:
            options["fp8"] = selection  # (the "+fp8" candidates' map is measured on the tuning's batches)
        if sample_inputs is not None and "analysis" not in options:
            options["analysis"] = self.analysis = PrecisionAnalyzer(
                include=self.include, exclude=self.exclude, progress=progress).analyze(self.model, sample_inputs,
                                                                                       loss_fn)
        self.tuning = self._agree_tuning(AdaptivePrecisionSelector().tune(
            self.model, self.optimizers[0], options.pop("batches"), options.pop("loss_fn"),
            capabilities=self.capabilities, **options))
        applied = AppliedRecipe(self.tuning.recipe, self.model, self.optimizers[0], precision=False, in_place=True)
        self._owned.add(applied.checkpoint_undo)  # (the optimizer and the parameters' dtype stay: see remove())
        self._tuned_undo = applied.undo
        self.optimizers = [applied.optimizer]
        return self.tuning.policy

    def _measure_fp8(self, name: str, base: str, sample_inputs, overrides) -> PrecisionPolicy:
        """policy="<base>+fp8" (adaptive_amp.names.fp8_preset): the base recipe's policy, and in fp8 each layer
        measured to gain and tolerate it."""
        from .analysis import split_inputs
        from .fp8.training import measured_policy

        options = {k: v for k, v in self._fp8_options.items() if k != "guard"}
        batches = options.pop("batches", None)
        if batches is None:
            if sample_inputs is None:
                raise ValueError(f"policy={name!r} measures each layer on sample batches: pass sample_inputs= "
                                 "(one batch) or fp8=dict(batches=[...])")
            batches = [sample_inputs]
        if overrides is not None:
            raise ValueError(f"policy={name!r} measures its fp8 layers instead of taking overrides; write the "
                             "policy string instead (e.g. 'params=float32,compute=bfloat16,layers=name:fp8-tensorwise')")
        options.setdefault("compiled", compiled_layers(self.model))  # gains timed as each layer will run
        if "run" not in options:
            def run(model, batch):
                args, kwargs = split_inputs(batch)
                return model(*args, **kwargs)
            options["run"] = run
        policy = recipe_policy(base, tf32=bool(self.capabilities.tf32))
        self._check_param_dtype(policy)  # (the optimizer refused before the measurement's time is spent)
        if policy.param_dtype != torch.float32:  # each gain timed as the run will compute: from bf16 weights
            options.setdefault("weight_dtype", policy.param_dtype)
        what = "compute=bfloat16: policy {}, bf16 autocast" if base == "bf16" else f"policy {{}}: {base}'s policy"
        policy = policy.replace(reasons=(what.format(name) + " and fp8 in each layer measured to gain and "
                                         "tolerate it",))
        return measured_policy(self.model, policy, batches, **options)

    def _watch_fp8(self) -> None:
        """Guard the policy's fp8 layers at statistics steps (adaptive_amp.fp8.training.Fp8Watch)."""
        guard = self._fp8_options.get("guard")
        if guard is False or not any(k.startswith("fp8-") for k in self.adjuster.layer_kinds.values()):
            return
        from .fp8.training import Fp8Watch

        self._fp8_watch = Fp8Watch(guard)
        self._fp8_watch.sync(self.adjuster)
        self._owned.add(self._fp8_watch)

    def _fp8_state_for(self, policy: PrecisionPolicy, saved: Optional[dict]):
        """(guard, kinds) a loaded state's fp8 watch runs with: a copy of this controller's guard with the saved
        demotions, back-off and amax history loaded, and the fp8 kind each watched layer runs in or returns
        to; checked in full before anything changes (a malformed `saved` raises). None when the guard is off
        (``fp8=dict(guard=False)``) or there is nothing to watch."""
        guard = self._fp8_options.get("guard")
        fp8_layers = any(kind.startswith("fp8-") for _, kind in policy.layers)
        if guard is False or (not fp8_layers and saved is None):
            return None
        from .fp8.guard import Fp8Guard

        if self._fp8_watch is not None:
            guard = self._fp8_watch.guard
        guard = copy.deepcopy(guard if guard is not None else Fp8Guard())
        kinds = {}
        if saved is not None:
            if not isinstance(saved, dict) or not isinstance(saved.get("kinds"), dict):
                raise TypeError("a dict with 'guard' and 'kinds' (Fp8Watch.state_dict()) is expected")
            guard.load_state_dict(saved["guard"])
            kinds = {str(k): str(v) for k, v in saved["kinds"].items()}
            bad = {k: v for k, v in kinds.items() if not v.startswith("fp8-")}
            if bad:
                raise ValueError(f"kinds {bad} are not fp8 kinds")
        return guard, kinds

    def _guard_fp8(self, step: int) -> None:
        """Between steps: the guard's verdict on the fp8 layers' rows of this step, each a policy change."""
        from .fp8.training import policy_after

        watch = self._fp8_watch
        rows = watch.read()
        if rows is None:  # (nothing outside statistics steps)
            return
        events = watch.decide(step, self._agree_fp8_rows(rows))
        for event in events:
            policy = policy_after(event, self.policy, watch.kinds[event.layer])
            self._decide(event.kind, event.message, policy, layer=event.layer, **event.data)
        if events:
            watch.sync(self.adjuster)

    def _agree_tuning(self, result):
        """The tuning whose choice is applied: this process's (under torch.distributed, rank 0's on every rank:
        adaptive_amp.distributed)."""
        return result

    def _agree_fp8_rows(self, rows: List[dict]) -> List[dict]:
        """The fp8 guard's rows its decisions are taken from: this process's (under torch.distributed, the
        same on every rank: adaptive_amp.distributed)."""
        return rows

    def _check_param_dtype(self, policy: PrecisionPolicy) -> None:
        """bf16 parameters ("bf16-pure", "bf16-weights"): insist on optimizers that round stochastically
        (nothing is changed)."""
        if policy.param_dtype == torch.float32:
            return
        if policy.param_dtype != torch.bfloat16:
            raise ValueError(f"policy params={dtype_name(policy.param_dtype)}: parameters are kept in float32 or, "
                             "with stochastic rounding (policies 'bf16-pure' and 'bf16-weights'), in bfloat16")
        if policy.islands and policy.param_scope != "matmul":
            raise ValueError("a policy with params=bfloat16 throughout (bf16-pure) cannot have fp32 islands: an "
                             "island computes in float32 and its weights would be bfloat16; use scope=matmul "
                             "(bf16-weights), whose islands keep fp32 weights, or params=float32")
        why = cast_refusal(self.model, policy)
        if why:
            raise ValueError(f"policy {policy}: {why}")
        from . import optim

        for opt in self.optimizers:
            if not isinstance(opt, (optim.AdamW, optim.SGD)) or not all(
                    g.get("stochastic_rounding", False) for g in opt.param_groups):
                raise TypeError(f"policy {policy} keeps weights in bfloat16, so its optimizer must round "
                                f"updates stochastically (round to nearest drops every update below half an ulp); "
                                f"got {type(opt).__module__}.{type(opt).__name__}. Use adaptive_amp.optim.AdamW "
                                "or adaptive_amp.optim.SGD (stochastic_rounding=True), created on the model's "
                                "parameters")

    def _cast_params(self, policy: PrecisionPolicy) -> None:
        """bf16 parameters (checked by _check_param_dtype): the model cast in place, with the hooks it needs."""
        # In place (the optimizers keep the same Parameter objects), as the tuning's trials and the memory
        # guard cast; a graph traced before (policy="tune"'s fp32 trials, the user's own calls) is forgotten
        # rather than run on the bf16 memory (adjust.forget_compiled_graphs). bf16-pure, without autocast, casts
        # fp32 inputs as a plain bf16 loop would; bf16-weights' embeddings return fp32 (recipes.policy_hooks).
        cast_for_policy(self.model, policy)
        self._policy_hooks = self._owned.add(policy_hooks(self.model, policy))

    def _make_scaler(self, policy: PrecisionPolicy) -> GradScaler:
        """The policy's GradScaler (scaler_kwargs win over the policy's settings); a disabled one when the
        policy needs no loss scaling, so that the step code is the same either way."""
        if policy.loss_scale is None and policy.compute_dtype == torch.float16:
            # loss_scale=none: no scaling, but an overflowing step is skipped (as a GradScaler skips it) rather
            # than writing infs into the weights, which no promotion could undo.
            return GradScaler(self.device.type, init_scale=1.0, min_scale=1.0, max_scale=1.0,
                              growth_interval=2**30)
        if policy.loss_scale is None:
            return GradScaler(self.device.type, enabled=False)
        kwargs = {**policy.loss_scale.grad_scaler_kwargs(), **self._scaler_kwargs}
        return GradScaler(self.device.type, **kwargs)

    def _apply_tf32(self, on: bool):
        if self.device.type != "cuda":
            return None
        before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = bool(on)
        torch.backends.cudnn.allow_tf32 = bool(on)
        return before

    def remove(self) -> None:
        """Take the policy off the model (islands, statistics and policy hooks, checkpointing off; TF32 settings
        restored). Also done when the controller is garbage collected. A model whose policy kept
        parameters in bf16 ("bf16-pure", "bf16-weights") keeps them: they are the only copy; so does an
        optimizer that a tuned recipe converted to stochastic rounding (it holds their state)."""
        self._removed = True
        self._undo_setup()
        if self._tf32_before is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._tf32_before

    def _undo_setup(self) -> None:
        """Islands, statistics hooks and the policy's hooks off the model (each idempotent)."""
        if self.adjuster is not None:
            self.adjuster.remove()
        self._owned.remove()
        self._policy_hooks = None

    # ------------------------------------------------------------ the step
    @property
    def compute_fmt(self) -> Optional[str]:
        """The compute dtype's format name for statistics (``"float16"``, ``"bfloat16"``), None for float32."""
        return _COMPUTE_FORMATS.get(self.policy.compute_dtype)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken through :meth:`step` (skipped ones included)."""
        return self._step

    def _stats_due(self) -> bool:
        """Whether this step collects per-layer statistics (activations, inputs and gradients)."""
        return self.layer_stats and self.monitor.stats_due(self._step)

    def _drop_partial_step(self) -> None:
        """Forget what a forward or backward that failed (out of memory, in train_step) recorded of this step:
        its loss, its layer statistics and the fp8 layers' captured inputs, so that the step run again records
        its own (its statistics too: the flag that a step's activations were collected would otherwise skip
        them, and the step would count as watched without them)."""
        self._loss_sum, self._loss_count, self._collected_activations = None, 0, False
        self._watched = None
        self.monitor.drop_layer_stats(self._step)
        if self._fp8_watch is not None:
            self._fp8_watch.drop()

    def _activations_due(self) -> bool:
        return self._watch_left > 0 or self._stats_due()

    @contextlib.contextmanager
    def autocast(self):
        """The policy's autocast context; on statistics steps it also records each layer's input and
        output statistics (the inputs tell a layer that overflows from one that was handed infs)."""
        # A statistics step's layer statistics and the fp8 guard's rows are a training forward's: not an
        # evaluation's (no gradients) run at that step, nor a later forward of the step (gradient accumulation),
        # whose first forward's serve.
        training = torch.is_grad_enabled()
        collect = training and self._activations_due() and not self._collected_activations
        collector = self._collector
        collector.take()  # nothing from forwards run outside this context
        watch = self._fp8_watch if self.adapt and training and self._stats_due() else None
        if watch is not None and watch.settled_at == self._step:
            watch = None
        if watch is not None:
            watch.armed = watch.due = True  # the fp8 layers keep a few rows of their inputs for the guard
        # A model compiled whole runs a statistics step with its blocks compiled instead (adaptive_amp.regional),
        # set up before the collector looks for the modules compiled on their own.
        with self._regional.step() if collect else contextlib.nullcontext():
            if collect:
                # Islands are not measured: they compute in fp32 and cannot be blamed for a compute-dtype overflow.
                collector.start(fmt=self.compute_fmt, skip=self.adjuster.islands)
            try:
                # bf16-pure has no autocast, only the compiled passes' AOT autograd settings (adjust.py says why).
                with self.adjuster.autocast():
                    yield
            finally:
                collector.stop()
                if watch is not None:
                    watch.armed = False
        if watch is not None and not self._removed:
            watch.settle(self._step)  # (as the forward ends: no copy is held through the backward, its peak)
        if not collect or self._removed:
            return  # (removed inside the block: its hooks and records went with it)
        outputs, inputs = collector.stats()  # rows in forward order; eager layers were measured as they ran
        if outputs is None:
            if collector.missed:
                # (every time: the hook guards are on from now on, so this happens at most once a process)
                warnings.warn(f"AdaptiveMixedPrecision: no layer statistics at step {self._step}: a compiled graph "
                              "traced without this controller's hooks ran (one traced from another instance of the "
                              "model's class run inside amp.autocast() at a statistics step, e.g. a teacher or EMA "
                              "copy), or the model did not run inside amp.autocast(). Dynamo's hook guards are now "
                              "on for this process, so graphs tell models with and without hooks apart; compiled "
                              "graphs were dropped and recompile at their next call. The next statistics steps "
                              "record.", stacklevel=3)
            elif self.layers and not self._warned_no_records:
                self._warned_no_records = True
                warnings.warn(f"AdaptiveMixedPrecision: no layer statistics at step {self._step}: the model did "
                              "not run inside amp.autocast()", stacklevel=3)
            return
        self.monitor.record_layer_stats(self._step, "activation", outputs)
        if inputs is not None:
            self.monitor.record_layer_stats(self._step, "input", inputs)
        self._collected_activations = True
        self._watched = self._step

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``scaler.scale(loss).backward()``; the loss is kept (on the device) for the monitor, and a step whose
        loss is not finite is skipped (see :meth:`step`)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward(loss): loss must be a tensor, got {type(loss).__name__}")
        watch = self._fp8_watch
        if watch is not None and watch.armed:
            # A backward inside amp.autocast() (Lightning's manual_backward runs in its step's context): the forward
            # has ended, so the fp8 guard's rows are made now, and its copies not held through the backward.
            watch.armed = False
            watch.settle(self._step)
        value = loss.detach().float()
        if value.numel() != 1:  # (with backward's gradient=): the monitor keeps one number a step
            value = value.sum()
        value = value.reshape(())
        total = value if self._loss_sum is None else self._loss_sum + value
        check = None
        if self._decides_skip_on_host():
            # Agreed over the ranks where there are several, and copied to the host, before backward is queued:
            # in stream order behind the forward only, so step() waits for the forward at most, never for the
            # backward. (Queued after backward, the read waited for the whole backward at every step, and the
            # device idled while the host launched the optimizer and the next forward: 0.90x torch's step rate
            # on a compiled GPT-2 small at 8 x 1024 tokens, H200.)
            check = StepResult(found_inf=self._agree_skip(self._nonfinite(total)), slots=self._loss_slots)
        self.scaler.scale(loss).backward(**kwargs)
        # Kept once backward succeeded: a backward that raised (and is run again) adds its loss once.
        self._loss_sum = total
        self._loss_count += 1
        if check is not None:
            self._loss_check = (total, check)

    @staticmethod
    def _nonfinite(loss: torch.Tensor) -> torch.Tensor:
        """1.0 where the loss is NaN or inf, else 0.0: a found_inf, on the loss's device (no sync)."""
        return torch.logical_not(torch.isfinite(loss)).to(torch.float32)

    @staticmethod
    def _skips_on_device(opt) -> bool:
        """Whether `opt` skips its own step on the device when handed a found_inf (fused=True, adaptive_amp.optim)."""
        return getattr(opt, "_step_supports_amp_scaling", False) and not _takes_grad_scaler(opt.step)

    def _decides_skip_on_host(self) -> bool:
        """Without loss scaling, an optimizer that cannot skip on the device is skipped from the host."""
        return not self.scaler.is_enabled() and not all(self._skips_on_device(o) for o in self.optimizers)

    def _active_optimizers(self) -> list:
        """The optimizers with at least one gradient this step; refuses a step where none has one."""
        active = [opt for opt in self.optimizers
                  if any(p.grad is not None for g in opt.param_groups for p in g["params"])]
        if not active:
            raise RuntimeError("step(): no parameter of any optimizer has a gradient; call amp.backward(loss) "
                               "(or loss.backward()) before step()")
        return active

    def _agree_skip(self, skip: torch.Tensor) -> torch.Tensor:
        """The non-finite-loss flag every process skips on; a subclass deciding over several processes
        reduces it (one process: as it is)."""
        return skip

    def _refuse_reapplied_gradients(self) -> None:
        """After a step() that raised once its optimizers had changed the weights: the same, untouched
        gradients are refused, so that running step() again cannot apply them twice."""
        applied = self._applied
        if applied is None:
            return
        if all(p.grad is g and (g is None or g._version == v) for p, g, v in applied):
            raise RuntimeError("step(): the last step() raised after its optimizers had updated the weights with "
                               "these same gradients; they are not applied twice. Run the next forward and "
                               "backward (after zero_grad()) before calling step() again")
        self._applied = None

    def _prepare_scaled(self, active, skip: Optional[torch.Tensor]) -> None:
        """Unscale (or check) every optimizer's gradients before any of them steps, so that an error there
        changes no weight; a non-finite loss is added to their found_inf, so the scaler skips that step."""
        scaler = self.scaler
        scaler._check_scale_growth_tracker("step")
        scaler._check_native_state()  # the update after the step writes through these tensors
        for opt in active:
            state = scaler._per_optimizer_states[id(opt)]
            if state["stage"] is OptState.STEPPED:
                raise RuntimeError(f"step(): optimizer {self.optimizers.index(opt)} has stepped since the scaler's "
                                   "last update() (was amp.scaler.step() called directly?); call "
                                   "amp.scaler.update() to finish that step first")
        for opt in active:
            state = scaler._per_optimizer_states[id(opt)]
            if getattr(opt, "_step_supports_amp_scaling", False):
                if _takes_grad_scaler(opt.step):
                    continue  # (checks the gradients itself, inside its step)
                if not state["found_inf_per_device"]:
                    scaler._check_inf_per_device(opt)
            elif state["stage"] is OptState.READY:
                scaler.unscale_(opt)
        if skip is not None:
            for opt in active:
                for found in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values():
                    # (a maximum, not a sum: torch's fused steps skip on a found_inf of exactly 1.0)
                    torch.maximum(found, skip.to(found.device, non_blocking=True), out=found)

    def _step_unscaled(self, active, skip: Optional[torch.Tensor], known: Optional[StepResult], done: list) -> tuple:
        """Each optimizer's step without loss scaling, skipped when the loss is not finite: on the device by
        optimizers that can (handed the flag as a found_inf), from the host otherwise (reading `known`, the flag
        backward queued, when there is one). Returns (a StepResult, or the flag when the device decided; the
        optimizers that stepped or were handed it)."""
        if skip is None:
            for opt in active:
                opt.step()
                done.append(opt)
            return StepResult(True), active
        on_host = [opt for opt in active if not self._skips_on_device(opt)]
        finite = True
        if on_host:
            finite = bool(known if known is not None else StepResult(found_inf=skip, slots=self._loss_slots))
        stepped = []
        for opt in active:
            if opt in on_host:
                if finite:
                    opt.step()
                    stepped.append(opt)
                done.append(opt)
                continue
            opt.found_inf = skip
            try:
                opt.step()
            finally:
                del opt.found_inf
            stepped.append(opt)
            done.append(opt)
        if not finite or len(on_host) == len(active):
            return StepResult(finite), stepped
        return skip, stepped  # (made a StepResult once the step has launched everything: see _finish_step)

    def step(self, max_grad_norm: Optional[float] = None, norm_type: float = 2.0) -> StepResult:
        """Unscale and check, clip, step every optimizer, update the scale, monitor, adapt.

        Returns a :class:`~adaptive_amp.StepResult` whatever the policy: ``bool()`` of it is whether the
        optimizers stepped (False: an overflow or a non-finite loss skipped the step; with several
        optimizers, True only if every one stepped). Without loss scaling, or with optimizers the scaler
        steps from the host, the host knows already and reading it is free. Optimizers that skip on the
        device (``fused=True``, adaptive_amp.optim) keep it on the device: the step never waits, and the
        controller reads it during the next step (after that step's work is queued, so the device never
        idles for it), which is when such a step's overflow is diagnosed.

        A step whose loss (as recorded by :meth:`backward`) is NaN or inf is skipped in every policy, as
        the scaler skips an overflowing one: with loss scaling its found_inf is set; without, optimizers
        that skip on the device are handed it, others are not stepped (reading the flag waits for the
        forward pass only). An optimizer none of whose parameters got a gradient (the idle one of a GAN
        step) is left alone. Everything that can refuse the step (no gradient at all, a bad argument,
        gradients the scaler cannot unscale) raises before any optimizer has changed anything.
        """
        if max_grad_norm is not None:
            _check_clip_args(max_grad_norm, norm_type)
        self._refuse_reapplied_gradients()
        active = self._active_optimizers()
        last = self.monitor._last_step()
        if last is not None and self._step <= last:
            raise RuntimeError(f"step(): the monitor has recorded step {last} already and this controller is at "
                               f"step {self._step}; give each controller its own StabilityMonitor (or load a "
                               "state_dict that matches)")
        if max_grad_norm is not None:
            self.clip_grad_norm_(max_grad_norm, norm_type)
        elif self._clip_total is None and self._stats_due():
            self._record_gradient_stats()
        grad_norm, clip_max = self._clip_total, self._clip_max
        scaling = self.scaler.is_enabled()
        loss = None
        if self._loss_sum is not None:
            loss = self._loss_sum if self._loss_count == 1 else self._loss_sum / self._loss_count
        check = self._loss_check if self._loss_check is not None and self._loss_check[0] is self._loss_sum else None
        # (The mean over accumulated backwards is finite where their sum is: the flag backward agreed on.)
        skip = None if loss is None else check[1].found_inf if check is not None else \
            self._agree_skip(self._nonfinite(loss))
        # Nothing else measures the norm: optimizers that read every gradient anyway measure it in that pass.
        folded = (not scaling and grad_norm is None and self.track_grad_norm
                  and all(isinstance(opt, _Fused) for opt in active))
        if scaling:
            self._prepare_scaled(active, skip)
        elif grad_norm is None and self.track_grad_norm and not folded:
            grad_norm = self._grad_norm(active)  # the step leaves the gradients as they are
        done: list = []  # the optimizers whose step has returned
        try:
            if scaling:
                for opt in active:
                    done.append(self.scaler.step(opt))
                result = done  # (read after the scale update, from its combined found_inf)
            else:
                with _tracking_grad_norm(active if folded else ()):
                    result, stepped = self._step_unscaled(active, skip, check[1] if check else None, done)
        except BaseException as exc:
            if done:  # (an optimizer that raises at once has changed nothing: ours and torch's check first)
                self._after_failed_step(active, scaling)
                exc.add_note(f"AdaptiveMixedPrecision.step(): {len(done)} of the {len(active)} optimizers with "
                             "gradients had stepped; these gradients will not be applied again")
            raise
        try:
            return self._finish_step(result, loss, grad_norm, clip_max, scaling, skip,
                                     stepped if folded else ())
        except BaseException:
            self._after_failed_step(active, scaling)
            raise

    def _after_failed_step(self, active, scaling: bool) -> None:
        """An error once an optimizer has stepped: its gradients are not taken again, and the scaler's
        iteration is closed, so that the next step starts afresh."""
        self._applied = [(p, p.grad, None if p.grad is None else p.grad._version)
                         for opt in active for g in opt.param_groups for p in g["params"]]
        self._loss_sum, self._loss_count, self._loss_check, self._clip_total, self._clip_max = None, 0, None, None, None
        if scaling:
            self.scaler._abandon_step()

    def _finish_step(self, result, loss, grad_norm, clip_max, scaling: bool, skip, stepped_fused) -> StepResult:
        self._clip_total, self._clip_max = None, None
        if scaling:
            self.scaler.update()
            if grad_norm is None:
                grad_norm = self.scaler.last_grad_norm
        elif grad_norm is None and self.track_grad_norm and stepped_fused:
            grad_norm = self._stepped_grad_norm(stepped_fused)
        step = self._step
        self.monitor.record_step(step, loss=loss, grad_norm=grad_norm,
                                 found_inf=self.scaler.found_inf if scaling else skip,
                                 scale=self.scaler._get_scale_async().clone() if scaling else None,
                                 max_grad_norm=clip_max)
        # Taken after everything the step launches (the scale update, the monitor's copy of the scale), so that
        # reading it waits for this step only.
        if scaling:
            result = self._result(result)
        elif isinstance(result, torch.Tensor):
            result = StepResult(found_inf=result, slots=self._host_slots)
        watched = self._watched == step
        self._loss_known = loss is not None  # losses scaled outside backward() are not recorded
        self._loss_sum, self._loss_count, self._collected_activations = None, 0, False
        self._loss_check = None
        self._watch_left, self._watched = max(0, self._watch_left - 1), None
        self._step += 1
        read_due = self.adapt and self._adapts() and self.monitor.read_due(step)
        if read_due:
            self._add_events(self.monitor.read())  # the adaptation below judges this window's history now
        else:
            self._add_events(self.monitor.poll(step))  # a read's copy is taken during the next step
        # The previous step's deferred result: its work finished while this step's was launched, so the read
        # waits for nothing this step queued. Judged before this step, in step order.
        self._judge_pending()
        if result.deferred and not read_due:
            self._pending = (step, result, watched)
        else:
            self._judge(step, result, watched)  # (a read window reads the device anyway)
        if read_due:
            self._adapt()
        if self._fp8_watch is not None and self.adapt:
            self._guard_fp8(step)
        if self.memory_guard is not None:
            self.memory_guard.after_step(self)
        return result

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients now, as ``step(max_grad_norm=...)`` would inside; returns the total norm of the
        unscaled gradients (a device tensor), which the next :meth:`step` records.

        For loops whose framework clips between backward and step (Accelerate's
        ``clip_grad_norm_``). With sharded gradients (FSDP2) the norm is the
        global one, all-reduced over the ranks, as the step's own clip records;
        :attr:`GradScaler.last_grad_norm` would be this rank's part only.
        """
        _check_clip_args(max_norm, norm_type, "max_norm")
        active = self._active_optimizers()
        if self._clip_total is None and self._stats_due():
            self._record_gradient_stats()  # before the clip unscales them (once a step)
        if len(active) == 1:
            total = self.scaler.clip_grad_norm_(active[0], max_norm, norm_type)
        else:
            for opt in active:
                if self.scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY:
                    self.scaler.unscale_(opt)
            params = [p for opt in active for g in opt.param_groups for p in g["params"]]
            total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        self._clip_total, self._clip_max = total, float(max_norm)
        return total

    def _result(self, results) -> StepResult:
        """The StepResult of scaler steps: known on the host when every optimizer stepped from the host;
        otherwise from the scaler's found_inf (combined over the optimizers), left on the device."""
        if all(isinstance(r, bool) for r in results):
            return StepResult(all(results))
        if any(r is False for r in results):
            return StepResult(False)
        return StepResult(found_inf=self.scaler.found_inf, slots=self._host_slots)

    def _judge(self, step: int, result: StepResult, watched: bool) -> None:
        """Diagnose `step` from its result, unless a later policy replaced the one it ran under (its overflow
        was acted on already) or the policy no longer adapts."""
        if self.adapt and self._adapts() and step >= self._last_change:
            self._after_step(step, overflowed=not result, watched=watched)

    def _judge_pending(self) -> None:
        """What earlier steps left to judge: a result decided on the device, layer outputs not read yet."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._judge(*pending)
        if self._masked_due:
            self._judge_masked()

    def _add_events(self, events: List[Event]) -> None:
        """Append, keeping self.events in step order (decisions and the monitor's events interleave)."""
        if not events:
            return
        in_order = not self.events or self.events[-1].step <= events[0].step
        self.events.extend(events)
        if not in_order:
            self.events.sort(key=lambda e: e.step)

    def train_step(self, closure, max_grad_norm: Optional[float] = None, norm_type: float = 2.0) -> torch.Tensor:
        """A whole step from ``closure() -> loss`` (run under the policy's autocast): backward, step, and the
        gradients cleared (set to None) for the next one. With a
        memory_guard, an out-of-memory error in forward/backward moves to a lighter recipe and reruns the same
        closure (see adaptive_amp.pressure.train_step). Returns the detached loss."""
        from .pressure import train_step

        return train_step(self, closure, max_grad_norm, norm_type)

    def _stepped_grad_norm(self, optimizers) -> Optional[SumsOfSquares]:
        """The norm of all gradients, as the per-tensor sums of squares the fused optimizers' steps measured:
        the monitor's read sums them, so the step launches nothing for it (summing them took two launches a
        step, about 0.1 ms of host time under cProfile on an H100 host)."""
        parts = [t for opt in optimizers for t in (opt._grad_sums or ())]
        return SumsOfSquares(parts) if parts else None

    def _grad_norm(self, optimizers) -> Optional[torch.Tensor]:
        """The L2 norm of all gradients, on the device (no sync): without loss scaling nothing else
        measures it. Before the step (which leaves the gradients as they are), so that nothing here can
        fail once an optimizer has changed the weights."""
        grads = [p.grad for opt in optimizers for g in opt.param_groups for p in g["params"]
                 if p.grad is not None and not p.grad.is_sparse]
        if not grads:
            return None
        # Grouped by device and dtype, as torch's clip_grad_norm_ groups them: _foreach_norm's fused kernel takes
        # one dtype, and given bf16 and fp32 gradients together ("bf16-weights") it fell back to a norm, a
        # copy and a memset per tensor: ~500 launches, 16% of a compiled Llama 1.1B step on an H200.
        groups: Dict[tuple, List[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        # In fp32 whatever the gradients' dtype (a bf16 norm is off by up to 0.4%: torch's get_total_norm);
        # float64 ones in float64 (_foreach_norm refuses to narrow), the result in fp32 as the monitor keeps it.
        return _norm_of_norms([torch.linalg.vector_norm(torch.stack(torch._foreach_norm(
            gs, 2, dtype=torch.float64 if dtype == torch.float64 else torch.float32))).to(self.device, torch.float32)
            for (_, dtype), gs in groups.items()])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every optimizer the controller steps (``amp.optimizers``)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def _record_gradient_stats(self) -> None:
        from .ops import tensor_stats

        # FSDP2 gradients are DTensors: each rank takes the statistics of its own shard.
        grads = [(n, p.grad.to_local() if is_sharded(p.grad) else p.grad)
                 for n, p in self._module.named_parameters() if p.grad is not None]
        named = [(n, g.contiguous()) for n, g in grads
                 if not g.is_sparse and g.numel() and g.dtype in _STATS_DTYPES]
        if named:
            # Before unscaling: with fp16 these are the scaled gradients, whose fp16 underflow is the risk.
            self.monitor.record_layer_stats(self._step, "gradient", tensor_stats(
                [g for _, g in named], fmt=self.compute_fmt, names=[n for n, _ in named]))

    # ------------------------------------------------------------ adaptation
    def _decide(self, kind: str, message: str, policy: PrecisionPolicy, layer: Optional[str] = None,
                **data) -> None:
        step = self._step  # the first step under the new policy
        policy = policy.replace(reasons=tuple(policy.reasons) + (f"step {step}: {message}",))
        self._add_events([Event(step, kind, message, layer=layer, data={"policy": str(policy), **data})])
        self.adjuster.set_policy(policy)
        self.policy = policy
        self.policy_history.append((step, str(policy)))
        self._last_change = step
        self._watch_left = _WATCH_STEPS  # re-diagnose at once if the new policy's first steps overflow too

    def _adapts(self) -> bool:
        return self.policy.compute_dtype == torch.float16 and self.scaler.is_enabled()

    def _after_step(self, step: int, overflowed: bool, watched: bool) -> None:
        """Diagnose an overflow the step it appears (see the module docstring)."""
        if not overflowed:
            self._first_overflow, self._unexplained = None, 0
            if watched:
                self._masked_due.append(step)
                self._judge_masked()
            return
        if self._first_overflow is None:
            self._first_overflow = step
        self._watch_left = _WATCH_STEPS
        if not watched:
            return  # no statistics of this step: the next step collects them
        self._add_events(self.monitor.read())  # one transfer, in an overflowing step only
        layers = self._overflowing_layers(step)
        lost = step - self._first_overflow + 1
        why = f"{lost} overflowing step{'s' if lost > 1 else ''} since step {self._first_overflow}"
        if layers:
            self._unexplained = 0
            if self._promotions < self.max_promotions:
                self._promote(layers, why)
            elif self.switch_compute:
                self._switch(f"{why}; {', '.join(layers)} still overflow after {self._promotions} promotions")
            return
        if self._loss_finite(step):
            return  # finite activations and loss: the gradients overflowed at this scale; the scaler backs off
        self._unexplained += 1
        if self._unexplained >= 2 and self.switch_compute:
            self._switch(f"{why}; the loss is not finite and no layer's output overflowed from finite "
                         "inputs, so the overflow is outside the layers islands can hold")

    def _judge_masked(self) -> None:
        """Layers that overflowed at a watched step that was not skipped: the loss and the gradients stayed
        finite because an op downstream saturated (a clamp, tanh, a softmax, a mask), and that is a wrong
        result no scaler sees. They are promoted as an overflowing step's are, the loss scale left alone."""
        due, self._masked_due = self._masked_due, []
        for step in due:
            if self.monitor.steps_since(step) == 0:
                self._masked_due.append(step)  # not read yet: the next step's poll takes the read
                continue
            if not (self.adapt and self._adapts()) or step < self._last_change:
                continue  # a later policy replaced the one it ran under
            layers = self._overflowing_layers(step)
            if not layers:
                continue
            why = f"layer outputs overflowed at step {step} with no step skipped (masked downstream)"
            if self._promotions < self.max_promotions:
                self._promote(layers, why, restore_scale=False)
            elif self.switch_compute:
                self._switch(f"{why}; {', '.join(layers)} still overflow after {self._promotions} promotions")

    def _loss_finite(self, step: int) -> bool:
        """Whether `step`'s loss was finite; what the diagnosis decides from when no layer is to blame.
        An unrecorded loss (scaled outside :meth:`backward`) is no evidence of a non-finite one. A subclass
        whose decisions must agree over several processes makes it collective."""
        return not self._loss_known or math.isfinite(self.monitor.value_at("loss", step))

    def _adapt(self) -> None:
        """At a read window: an overflow storm the per-step diagnosis did not cure."""
        mon = self.monitor
        judged = mon.steps_since(self._last_change)
        if judged < min(mon.read_every, mon.window):
            return
        rate = mon.overflow_rate(since_step=self._last_change)
        scale = mon.last_scale()
        storm = rate > self.storm_rate or scale < self.scale_floor
        if not storm:
            self._scale_before_storm = scale if math.isfinite(scale) else self._scale_before_storm
            self._maybe_demote(judged)
            return
        why = (f"{rate:.0%} of {judged} steps skipped" if rate > self.storm_rate
               else f"loss scale {scale:.3g} under the floor {self.scale_floor:g}")
        layers = self._overflowing_layers()
        if layers and self._promotions < self.max_promotions:
            self._promote(layers, f"overflow storm: {why}")
        elif self.switch_compute:
            self._switch(f"overflow storm: {why}")

    def _overflowing_layers(self, step: Optional[int] = None) -> List[str]:
        """Layers that made infs or NaNs (or values beyond the format) out of finite inputs, at `step` (None:
        since the last change). A layer handed infs by an earlier op is not one: promoting it would not help."""
        islands = set(self.adjuster.islands)  # patterns expanded to layer names
        chosen = [ls for ls in self.monitor.layer_stats
                  if (ls.step == step if step is not None else ls.step >= self._last_change)]
        inputs = finite_inputs(chosen)
        found: List[str] = []
        for ls in chosen:
            for row in overflowing_rows(ls, inputs):
                if row["name"] not in islands and row["name"] not in found:
                    found.append(row["name"])
        return found

    def _promote(self, layers: List[str], why: str, restore_scale: bool = True) -> None:
        policy = self.policy.replace(islands=tuple(self.policy.islands) + tuple(layers))
        self._promotions += 1
        self._promoted.extend(layers)
        restore = self._scale_before_storm if restore_scale else None
        if restore_scale and self._first_overflow is not None:
            before = self.monitor.value_at("scale", self._first_overflow - 1)
            restore = before if math.isfinite(before) else restore
        self._decide("promote", f"{why}; {', '.join(layers)} "
                     f"{'overflows' if len(layers) == 1 else 'overflow'} in float16 and now "
                     f"{'runs' if len(layers) == 1 else 'run'} in float32" + (f"; loss scale restored to {restore:g}" if restore else ""),
                     policy, layer=layers[0] if len(layers) == 1 else None, layers=list(layers))
        if restore:
            # The backoffs came from overflowing activations, not from the size of the gradients.
            self.scaler.update(new_scale=float(restore))

    def _switch(self, why: str) -> None:
        kept = tuple(i for i in self.policy.islands if i not in self._promoted)
        if self.capabilities.bf16:
            target, reason = torch.bfloat16, "bf16 is native here and has fp32's range"
        else:
            target, reason = torch.float32, "bf16 is not native here"
        policy = self.policy.replace(compute_dtype=target, loss_scale=None, islands=kept)
        self._decide("switch_compute", f"{why}; fp32 islands cannot cure it: compute switches "
                     f"from float16 to {dtype_name(target)} ({reason}) and loss scaling retires", policy,
                     compute=dtype_name(target))
        self.scaler = self._make_scaler(policy)
        self._promoted, self._promotions = [], 0
        self._first_overflow, self._unexplained, self._watch_left = None, 0, 0

    def _maybe_demote(self, stable_steps: int) -> None:
        if self.demote_after is None or not self._promoted:
            return
        layer = self._promoted[-1]
        wait = self.demote_after * 2 ** self._demotions.get(layer, 0)
        if stable_steps < wait:
            return
        self._promoted.pop()
        self._promotions = max(0, self._promotions - 1)  # a relapse is promoted again, not a reason to switch
        self._demotions[layer] = self._demotions.get(layer, 0) + 1
        policy = self.policy.replace(islands=tuple(i for i in self.policy.islands if i != layer))
        self._decide("demote", f"{stable_steps} stable steps; {layer} goes back to "
                     f"{dtype_name(self.policy.compute_dtype)} (it waits {2 * wait} steps if it is promoted "
                     "and demoted again)", policy, layer=layer)

    # ------------------------------------------------------------ reports
    def report(self, directory: Optional[str] = None, plots: bool = True):
        """A TrainingReport of the run so far (text via ``str()``, JSON, PNG plots with matplotlib).

        With `directory`, the report is also written there (report.txt,
        report.json, timeline.png, sensitivity.png).
        """
        from .report import TrainingReport

        self._add_events(self.monitor.read())  # the last, partial window
        report = TrainingReport(self.monitor.history(), [e.to_dict() for e in self.events],
                                list(self.policy_history),
                                analysis=self.analysis.to_dict() if self.analysis is not None else None,
                                summary={"device": str(self.device), "policy": str(self.policy),
                                         "steps": self._step, "loss_trend": self.monitor.loss_trend(),
                                         "loss_variance": self.monitor.loss_variance()},
                                tuning=self.tuning)
        if directory is not None:
            report.save(directory, plots=plots)
        return report

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Scaler, policy, monitor and adaptation state: a resumed run continues bitwise. Plain Python values
        and tensors only, so that ``torch.load(..., weights_only=True)`` (Lightning's, Accelerate's) takes it."""
        return builtin_values({"version": 1, "step": self._step, "policy": self.policy.to_dict(),
                "policy_history": [list(p) for p in self.policy_history],
                "scaler_enabled": self.scaler.is_enabled(), "scaler": self.scaler.state_dict(),
                "monitor": self.monitor.state_dict(), "events": [e.to_dict() for e in self.events],
                "adapt": {"last_change": self._last_change, "promotions": self._promotions,
                          "promoted": list(self._promoted), "demotions": dict(self._demotions),
                          "watch_left": self._watch_left, "first_overflow": self._first_overflow,
                          "unexplained": self._unexplained, "masked_due": list(self._masked_due),
                          "scale_before_storm": self._scale_before_storm,
                          # the last step's device-decided result, read now and judged during the next step
                          # as it would have been without the checkpoint
                          "pending": None if self._pending is None else
                          [self._pending[0], bool(self._pending[1]), self._pending[2]]},
                **({} if self._fp8_watch is None else {"fp8": self._fp8_watch.state_dict()})})

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. Everything is checked first: a refused state changes
        nothing."""
        where = "AdaptiveMixedPrecision.load_state_dict"
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError(f"{where}: not a state_dict of this class (version 1)")
        missing = [k for k in ("step", "policy", "policy_history", "scaler_enabled", "scaler", "monitor", "events",
                               "adapt") if k not in state]
        if missing:
            raise ValueError(f"{where}: missing entries {missing}")
        try:
            if not isinstance(state["policy"], dict):
                raise TypeError(f"a dict (PrecisionPolicy.to_dict()) is expected, got {type(state['policy']).__name__}")
            policy = PrecisionPolicy.from_dict(state["policy"])
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ValueError(f"{where}: state['policy'] is malformed ({exc})") from None
        if (policy.param_dtype, policy.param_scope) != (self.policy.param_dtype, self.policy.param_scope):
            raise ValueError(f"{where}: the saved policy keeps parameters in {dtype_name(policy.param_dtype)} "
                             f"(scope {policy.param_scope}), this one in {dtype_name(self.policy.param_dtype)} (scope "
                             f"{self.policy.param_scope}); create the controller with the saved policy")
        try:
            self.adjuster.check_policy(policy)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        scaler = self._make_scaler(policy)
        if not isinstance(state["scaler_enabled"], bool):
            raise ValueError(f"{where}: state['scaler_enabled'] must be a bool, got {state['scaler_enabled']!r}")
        if state["scaler_enabled"] != scaler.is_enabled():
            raise ValueError(f"{where}: the saved scaler's enabled state does not match the saved policy")
        if scaler.is_enabled():
            try:
                scaler.load_state_dict(state["scaler"])
            except (TypeError, ValueError, KeyError, RuntimeError) as exc:
                raise ValueError(f"{where}: state['scaler'] is refused: {exc}") from None
        # Into a copy of this monitor (its class and settings stay), so a refused state leaves ours alone;
        # a shallow copy is enough, since loading replaces every piece of the monitor's state.
        monitor = copy.copy(self.monitor)
        try:
            monitor.load_state_dict(state["monitor"])
        except ValueError as exc:
            raise ValueError(f"{where}: state['monitor'] is refused: {exc}") from None
        try:
            parsed = _parse_adaptation(state)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where}: missing or malformed adaptation state ({exc})") from None
        try:
            fp8_state = self._fp8_state_for(policy, state.get("fp8"))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where}: state['fp8'] is refused ({exc})") from None
        last = monitor._last_step()
        if last is not None and last >= parsed["step"]:
            raise ValueError(f"{where}: state['monitor'] has recorded step {last}, but state['step'] says the next "
                             f"step is {parsed['step']}: they are not of one checkpoint")
        self.adjuster.set_policy(policy)
        self._apply_tf32(policy.tf32)
        self.policy, self.scaler, self.monitor = policy, scaler, monitor
        if fp8_state is not None:
            if self._fp8_watch is None:
                from .fp8.training import Fp8Watch

                self._fp8_watch = Fp8Watch(fp8_state[0])
                self._owned.add(self._fp8_watch)
            self._fp8_watch.guard, self._fp8_watch.kinds = fp8_state[0], fp8_state[1]
        if self._fp8_watch is not None:
            self._fp8_watch.drop()  # (rows of a forward before the load were made under the old kinds)
            self._fp8_watch.sync(self.adjuster)
        self.events, self.policy_history = parsed["events"], parsed["policy_history"]
        self._step = parsed["step"]
        self._last_change = parsed["last_change"]
        self._promotions = parsed["promotions"]
        self._promoted = parsed["promoted"]
        self._demotions = parsed["demotions"]
        self._watch_left, self._watched = parsed["watch_left"], None
        self._first_overflow, self._unexplained = parsed["first_overflow"], parsed["unexplained"]
        self._masked_due = parsed["masked_due"]
        self._scale_before_storm = parsed["scale_before_storm"]
        self._pending = parsed["pending"]
        self._loss_sum, self._loss_count, self._collected_activations = None, 0, False
        self._clip_total, self._clip_max, self._loss_check, self._applied = None, None, None, None

    def __repr__(self):
        return (f"AdaptiveMixedPrecision(policy={str(self.policy)!r}, device={self.device}, step={self._step}, "
                f"events={len(self.events)})")


def _fp8_options(fp8) -> Dict[str, Any]:
    """The controller's `fp8` argument checked before anything changes: a dict of Fp8Guard (``guard``),
    ``batches`` and adaptive_amp.fp8.select_fp8_layers' keyword arguments."""
    if fp8 is None:
        return {}
    if not isinstance(fp8, dict):
        raise TypeError(f"fp8 must be a dict (guard=, batches= and select_fp8_layers' options), got "
                        f"{type(fp8).__name__}")
    import inspect

    from .fp8.select import select_fp8_layers

    known = {"guard", "batches"} | {name for name, p in inspect.signature(select_fp8_layers).parameters.items()
                                     if p.kind == p.KEYWORD_ONLY}
    unknown = sorted(set(fp8) - known)
    if unknown:
        raise ValueError(f"fp8: unknown key(s) {', '.join(map(repr, unknown))}; expected {', '.join(sorted(known))}")
    return dict(fp8)


def _field_int(name: str, value, lo: int = 0, hi: Optional[int] = None) -> int:
    """An int (not a bool, not a float) in [lo, hi], else ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in [{lo}, {'...' if hi is None else hi}], got {value}")
    return int(value)


def _field_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _parse_adaptation(state: Dict[str, Any]) -> Dict[str, Any]:
    """The controller's own entries of a state_dict, checked (ValueError naming the field)."""
    step = _field_int("state['step']", state["step"])
    adapt = state["adapt"]
    if not isinstance(adapt, dict):
        raise ValueError(f"state['adapt'] must be a dict, got {type(adapt).__name__}")
    first = adapt.get("first_overflow")
    scale = adapt["scale_before_storm"]
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not (math.isfinite(scale) and scale > 0)):
        raise ValueError(f"state['adapt']['scale_before_storm'] must be None or a finite number > 0, got {scale!r}")
    masked_due = adapt.get("masked_due", [])
    if not isinstance(masked_due, (list, tuple)):
        raise ValueError(f"state['adapt']['masked_due'] must be a list of steps, got {masked_due!r}")
    pending = adapt.get("pending")
    if pending is not None:
        if not isinstance(pending, (list, tuple)) or len(pending) != 3:
            raise ValueError(f"state['adapt']['pending'] must be None or [step, stepped, watched], got {pending!r}")
        pending = (_field_int("state['adapt']['pending'][0]", pending[0], step - 1, step - 1),
                   StepResult(_field_bool("state['adapt']['pending'][1]", pending[1])),
                   _field_bool("state['adapt']['pending'][2]", pending[2]))
    promoted = adapt["promoted"]
    demotions = adapt["demotions"]
    if not isinstance(promoted, list) or not all(isinstance(n, str) for n in promoted):
        raise ValueError(f"state['adapt']['promoted'] must be a list of layer names, got {promoted!r}")
    if not isinstance(demotions, dict) or not all(isinstance(k, str) for k in demotions):
        raise ValueError(f"state['adapt']['demotions'] must be a dict of layer name to count, got {demotions!r}")
    history = state["policy_history"]
    if not isinstance(history, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], str)
                                                for p in history):
        raise ValueError(f"state['policy_history'] must be a list of [step, policy string], got {history!r}")
    events = state["events"]
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError("state['events'] must be a list of dicts (Event.to_dict())")
    return dict(step=step, last_change=_field_int("state['adapt']['last_change']", adapt["last_change"], 0, step),
                promotions=_field_int("state['adapt']['promotions']", adapt["promotions"]),
                promoted=list(promoted),
                demotions={k: _field_int(f"state['adapt']['demotions'][{k!r}]", v) for k, v in demotions.items()},
                watch_left=_field_int("state['adapt']['watch_left']",
                                      adapt.get("watch_left", 1 if adapt.get("watch_next") else 0)),
                first_overflow=None if first is None else _field_int("state['adapt']['first_overflow']", first,
                                                                      0, step),
                unexplained=_field_int("state['adapt']['unexplained']", adapt.get("unexplained", 0)),
                masked_due=[_field_int(f"state['adapt']['masked_due'][{i}]", v, 0, step)
                            for i, v in enumerate(masked_due)],
                scale_before_storm=None if scale is None else float(scale),
                pending=pending,
                events=[Event.from_dict(e) for e in events],
                policy_history=[(_field_int(f"state['policy_history'][{i}][0]", a, 0, step), b)
                                for i, (a, b) in enumerate(history)])
