"""Precision policies and the selector that picks one for a model and a device.

A :class:`PrecisionPolicy` says which dtype parameters are kept in, which
dtype matmuls compute in, what precision single layers run in instead (one
per-layer map: float32 "islands", layers in fp8 or in bf16), whether
float32 matmuls may use TF32, and how to scale the loss. Its string form
follows jmp (``"params=float32,compute=float16"``) and reads back with
:meth:`PrecisionPolicy.from_string`. :class:`AdaptivePrecisionSelector` turns
:class:`~adaptive_amp.hardware.Capabilities` (and optionally a precision
analysis) into a policy, and says why in ``policy.reasons``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Tuple, Union

import torch

from .hardware import Capabilities, HardwareDetector
from .layers import canonical_name, compiled_layers, expand_names, is_compiled
from .names import CANDIDATES, format_name, recipe_names
from .recipes import Recipe, cast_refusal

# Canonical names are torch's (str(torch.float16) without "torch."); the other spellings are those of
# adaptive_amp.names, the one table of names.
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_CHOICES = "float32, float16, bfloat16 (or f32, f16, bf16)"

FP16_MAX = 65504.0
_FLOAT32_MAX = 3.4028234663852886e38
LOSS_SCALE_MODES = ("dynamic", "predictive")  # GradScaler's modes

# Characters the string form uses as separators: module names must not hold them.
_SEPARATORS = set(",;=: ")

#: What a layer of the per-layer map can run in (PrecisionPolicy.layers): "fp32" (an island: autocast off),
#: "bf16" (its autocast in bfloat16, inside an fp16 or fp32 policy, or where fp8 was), and the fp8 kinds of
#: adaptive_amp.fp8 (its matmuls through torchao's float8 training; adaptive_amp.fp8.KINDS).
LAYER_KINDS = ("fp32", "bf16", "fp8-tensorwise", "fp8-rowwise")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_dtype(value: Union[str, torch.dtype], what: str = "dtype") -> torch.dtype:
    """A torch dtype from a dtype or a name/alias ("bf16", "float16", "torch.float32")."""
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"{what}: unsupported dtype {value} (expected one of {_DTYPE_CHOICES})")
        return value
    try:
        return _DTYPES[format_name(value, tuple(_DTYPES), "dtype")]
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def _fmt_number(x: float) -> str:
    # Integers (every power-of-two scale) print without ".0"; others keep repr's exact digits.
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@dataclass(frozen=True)
class LossScale:
    """Settings for adaptive_amp.GradScaler (``GradScaler(**ls.grad_scaler_kwargs())``)."""

    mode: str = "dynamic"
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: Optional[float] = None
    max_scale: Optional[float] = None

    def __post_init__(self):
        # The same checks GradScaler makes, so a bad policy fails where it is written.
        if self.mode not in LOSS_SCALE_MODES:
            raise ValueError(f"loss_scale: mode must be one of {LOSS_SCALE_MODES}, got {self.mode!r}")
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"loss_scale: init_scale must be finite and > 0, got {self.init_scale}")
        if self.growth_interval < 1:
            raise ValueError(f"loss_scale: growth_interval must be >= 1, got {self.growth_interval}")
        if self.hysteresis < 1:
            raise ValueError(f"loss_scale: hysteresis must be >= 1, got {self.hysteresis}")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value != int(value):
                raise ValueError(f"loss_scale: {name} must be a whole number, got {value!r}")
        for name in ("min_scale", "max_scale"):  # finite float32 values, as GradScaler takes them
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
                raise ValueError(f"loss_scale: {name} must be a finite number (or left out for no bound), got "
                                 f"{value!r}")
        if self.min_scale is not None and self.min_scale < 0:
            raise ValueError(f"loss_scale: min_scale must be >= 0, got {self.min_scale}")
        if self.max_scale is not None and not self.max_scale > 0:
            raise ValueError(f"loss_scale: max_scale must be > 0, got {self.max_scale}")
        if self.min_scale is not None and self.max_scale is not None and self.max_scale < self.min_scale:
            raise ValueError(f"loss_scale: max_scale ({self.max_scale}) must be >= min_scale ({self.min_scale})")
        object.__setattr__(self, "init_scale", float(self.init_scale))
        object.__setattr__(self, "growth_interval", int(self.growth_interval))
        object.__setattr__(self, "hysteresis", int(self.hysteresis))

    def grad_scaler_kwargs(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        """``mode:init_scale`` then ``:key=value`` for each setting away from its default."""
        parts = [self.mode, _fmt_number(self.init_scale)]
        for f in dataclasses.fields(self)[2:]:
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={_fmt_number(value)}")
        return ":".join(parts)

    @classmethod
    def from_string(cls, s: str) -> "LossScale":
        parts = s.replace(" ", "").split(":")
        kwargs: dict = {"mode": parts[0].lower()}
        if len(parts) > 1:
            kwargs["init_scale"] = _number(parts[1], "init_scale")
        for part in parts[2:]:
            key, eq, value = part.partition("=")
            key = key.lower()
            if not eq or key not in ("growth_interval", "hysteresis", "min_scale", "max_scale"):
                raise ValueError(f"loss_scale: bad setting {part!r} (expected growth_interval=, "
                                 "hysteresis=, min_scale= or max_scale=)")
            if key in kwargs:
                raise ValueError(f"loss_scale: {key} given twice")
            kwargs[key] = _number(value, key, whole=key in ("growth_interval", "hysteresis"))
        return cls(**kwargs)


def _number(text: str, what: str, whole: bool = False):
    try:
        return int(text) if whole else float(text)
    except ValueError:
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"loss_scale: {what} must be {kind}, got {text!r}") from None


class _DefaultLossScale:
    """The loss_scale a policy gets when none is written: dynamic scaling if it computes in float16, else none.

    A sentinel rather than None, so that an explicit ``loss_scale=none`` (None) stays off."""

    def __repr__(self):
        return "<default loss_scale>"


DEFAULT_LOSS_SCALE = _DefaultLossScale()


def _as_loss_scale(value) -> Optional[LossScale]:
    if value is None or isinstance(value, (LossScale, _DefaultLossScale)):
        return value
    if isinstance(value, Mapping):
        return LossScale(**value)
    if isinstance(value, str):
        return None if value.strip().lower() in ("none", "") else LossScale.from_string(value)
    raise TypeError(f"loss_scale must be None, a LossScale, a dict or a string, got {type(value).__name__}")


@dataclass(frozen=True)
class PrecisionPolicy:
    """Where each dtype is used in training. Strings and aliases are accepted for the dtypes.

    ``param_dtype``
        the dtype parameters (and optimizer master copies) are kept in.
    ``param_scope``
        which parameters a bf16 param_dtype covers: "all" (every parameter and floating buffer,
        and no autocast: "bf16-pure") or "matmul" (the weights of the layers that multiply matrices, Linear,
        transformers' Conv1D, convolutions and embeddings; norms, loose parameters and buffers stay float32,
        embeddings return float32 and autocast computes as torch's does: "bf16-weights", see
        adaptive_amp.recipes.cast_matmul_weights). float32 parameters have scope "all".
    ``compute_dtype``
        the dtype autocast runs matmuls and convolutions in.
    ``tf32``
        let float32 matmuls (islands, fp32 compute) use TF32 tensor cores.
    ``islands``
        modules kept in float32: names as in model.named_modules() (a
        compiled model's ``_orig_mod.`` is dropped, so a name means the same
        layer compiled or not), or glob patterns over layer names
        (``transformer.h.*.mlp.c_proj``, see adaptive_amp.layers).
    ``layers``
        the per-layer precision map: (name or pattern, kind) entries, kind one of LAYER_KINDS
        (``(("*.mlp.*", "fp8-tensorwise"), ("lm_head", "bf16"))``; a dict or the string form
        ``"*.mlp.*:fp8-tensorwise;lm_head:bf16"`` too). Its "fp32" entries are the islands: they are moved
        into `islands`, which stays their view, and `layers` keeps the other kinds. A later entry wins over
        an earlier one on the layers both name (a pattern, then one layer out of it). An fp32 island wins
        over any other kind on the same layer: promoting an fp8 layer to fp32 is adding the island, and
        taking the island away gives the layer back to its entry here (:meth:`with_layer` moves a layer
        outright). The string form writes ``islands=a;b`` while every entry is fp32, and
        ``layers=name:kind;...`` (islands included) once one is not.
    ``loss_scale``
        GradScaler settings, or None for no loss scaling. Left out, a
        policy that computes in float16 gets dynamic loss scaling with torch's
        defaults (fp16 gradients underflow without it; the reasons say so) and
        any other policy none; ``loss_scale=none`` (None) turns it off.
    ``reasons``
        why each choice was made; not part of equality, so a policy read
        back from its string equals the one it was written from.
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    tf32: bool = False
    islands: Tuple[str, ...] = ()
    loss_scale: Optional[LossScale] = DEFAULT_LOSS_SCALE  # type: ignore[assignment]
    param_scope: str = "all"  # (after loss_scale: the fields before it keep their positions)
    layers: Tuple[Tuple[str, str], ...] = ()
    reasons: Tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen
        set_("param_dtype", parse_dtype(self.param_dtype, "param_dtype"))
        set_("compute_dtype", parse_dtype(self.compute_dtype, "compute_dtype"))
        set_("tf32", bool(self.tf32))
        if self.param_scope not in PARAM_SCOPES:
            raise ValueError(f"param_scope is {self.param_scope!r}; expected one of {', '.join(PARAM_SCOPES)}")
        if self.param_scope == "matmul" and not (self.param_dtype == self.compute_dtype == torch.bfloat16):
            raise ValueError(f"param_scope='matmul' (bf16 weights of the matmul layers under autocast) needs "
                             f"param_dtype and compute_dtype bfloat16, got {dtype_name(self.param_dtype)} and "
                             f"{dtype_name(self.compute_dtype)}")
        islands = (self.islands,) if isinstance(self.islands, str) else tuple(self.islands)
        for name in islands:
            if not name or _SEPARATORS & set(name):
                raise ValueError(f"islands: bad module name {name!r} (must be non-empty, without , ; = : or spaces)")
        entries = _layer_entries(self.layers)
        islands += tuple(name for name, kind in entries if kind == "fp32")
        set_("islands", tuple(dict.fromkeys(canonical_name(n) for n in islands)))  # drop repeats, keep order
        others: dict = {}
        for name, kind in entries:
            if kind != "fp32":
                others.pop(name, None)  # the later entry wins, and takes the later place
                others[name] = kind
        set_("layers", tuple(others.items()))
        loss_scale = _as_loss_scale(self.loss_scale)
        reasons = tuple(self.reasons)
        if isinstance(loss_scale, _DefaultLossScale):
            loss_scale = None
            if self.compute_dtype == torch.float16:
                loss_scale = LossScale()
                reasons += (f"loss_scale={loss_scale}: compute=float16 and no loss_scale given; fp16 gradients "
                            "underflow without scaling, so dynamic loss scaling is on by default (write "
                            "loss_scale=none to turn it off)",)
        set_("loss_scale", loss_scale)
        set_("reasons", reasons)

    @property
    def uses_loss_scaling(self) -> bool:
        """Whether the loss is scaled (``loss_scale`` is set)."""
        return self.loss_scale is not None

    @property
    def pure(self) -> bool:
        """Whether everything is in the compute dtype and nothing is autocast ("bf16-pure")."""
        return self.param_dtype == self.compute_dtype != torch.float32 and self.param_scope == "all"

    def replace(self, **changes) -> "PrecisionPolicy":
        """A copy with the given fields changed (the policy itself is immutable)."""
        return dataclasses.replace(self, **changes)

    @property
    def layer_map(self) -> dict:
        """The per-layer map as {name or pattern: kind}, the islands as "fp32" (winning over another kind
        written for the same name)."""
        return {**dict(self.layers), **{name: "fp32" for name in self.islands}}

    def with_layer(self, name: str, kind: Optional[str]) -> "PrecisionPolicy":
        """This policy with layer (or pattern) `name` moved to `kind` (one of LAYER_KINDS; None: no entry of its
        own): its island and its entry of another kind are dropped first. A pattern entry that matches `name`
        (a measured fp8 map writes a repeated block's layers as ``model.layers.*.mlp.up_proj``) still applies to
        it after ``kind=None``; give the layer a kind to move it out of the pattern."""
        name = canonical_name(name)
        if kind is not None and kind not in LAYER_KINDS:
            raise ValueError(f"kind is {kind!r}; expected one of {', '.join(LAYER_KINDS)} or None")
        islands = tuple(i for i in self.islands if i != name)
        layers = tuple((n, k) for n, k in self.layers if n != name)
        if kind == "fp32":
            islands += (name,)
        elif kind is not None:
            layers += ((name, kind),)
        return dataclasses.replace(self, islands=islands, layers=layers)

    # ------------------------------------------------------------------ string form
    def __str__(self) -> str:
        parts = [f"params={dtype_name(self.param_dtype)}", f"compute={dtype_name(self.compute_dtype)}"]
        if self.param_scope != "all":
            parts.append(f"scope={self.param_scope}")
        if self.layers:
            parts.append("layers=" + ";".join(f"{name}:{kind}" for name, kind in
                                              self.layers + tuple((i, "fp32") for i in self.islands)))
        elif self.islands:
            parts.append("islands=" + ";".join(self.islands))
        if self.tf32:
            parts.append("tf32=1")
        if self.loss_scale is not None:
            parts.append(f"loss_scale={self.loss_scale}")
        elif self.compute_dtype == torch.float16:
            parts.append("loss_scale=none")  # left out, float16 compute would read back with scaling on
        return ",".join(parts)

    @classmethod
    def from_string(cls, s: str) -> "PrecisionPolicy":
        """Read ``params=...,compute=...[,scope=matmul][,islands=a;b][,layers=a:kind;b:kind][,tf32=1]
        [,loss_scale=dynamic:65536]``.

        A lone dtype ("bf16") means params and compute both in it, as in jmp.
        Spaces are ignored. A missing compute is the params dtype.
        """
        fields = parse_policy_fields(s)
        if "param_dtype" not in fields:
            raise ValueError(f"policy {s!r}: field 'params' is missing")
        fields.setdefault("compute_dtype", fields["param_dtype"])
        return cls(**fields)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {"param_dtype": dtype_name(self.param_dtype), "compute_dtype": dtype_name(self.compute_dtype),
                "param_scope": self.param_scope, "tf32": self.tf32, "islands": list(self.islands),
                "layers": [list(entry) for entry in self.layers],
                "loss_scale": None if self.loss_scale is None else dataclasses.asdict(self.loss_scale),
                "reasons": list(self.reasons)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PrecisionPolicy":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown PrecisionPolicy field(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "PrecisionPolicy":
        return cls.from_dict(json.loads(text))


# String keys (jmp's, with its one-letter forms) to PrecisionPolicy fields.
_KEYS = {"params": "param_dtype", "p": "param_dtype", "param_dtype": "param_dtype",
         "compute": "compute_dtype", "c": "compute_dtype", "compute_dtype": "compute_dtype",
         "scope": "param_scope", "param_scope": "param_scope",
         "islands": "islands", "layers": "layers", "tf32": "tf32", "loss_scale": "loss_scale"}
_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


#: Which parameters a bf16 param_dtype covers (PrecisionPolicy.param_scope).
PARAM_SCOPES = ("all", "matmul")

#: Named policies. "bf16-pure": weights, gradients and compute all in bf16, no fp32 master copy (half the
#: parameter memory); it needs an optimizer that rounds its updates stochastically (adaptive_amp.optim),
#: since round-to-nearest drops every update below half a bf16 ulp. "bf16-weights": the same for the matmul
#: layers' weights only, the rest in fp32 and the compute autocast's (param_scope="matmul").
PRESETS = {"fp32": {"param_dtype": torch.float32, "compute_dtype": torch.float32},
           "bf16-pure": {"param_dtype": torch.bfloat16, "compute_dtype": torch.bfloat16},
           "pure-bf16": {"param_dtype": torch.bfloat16, "compute_dtype": torch.bfloat16},
           "bf16-weights": {"param_dtype": torch.bfloat16, "compute_dtype": torch.bfloat16, "param_scope": "matmul"}}


def parse_policy_fields(s: str) -> dict:
    """The PrecisionPolicy fields a (possibly partial) policy string sets, by field name."""
    text = s.replace(" ", "").replace("\t", "")
    if not text:
        raise ValueError("policy string is empty")
    if text.lower() in PRESETS:
        return dict(PRESETS[text.lower()])
    if "=" not in text:  # jmp's shorthand: one dtype for everything, float32 alone (see adaptive_amp.names)
        dtype = parse_dtype(text, f"policy {s!r}: field 'params'")
        if dtype != torch.float32:
            name = dtype_name(dtype)
            short = {"bfloat16": "bf16", "float16": "fp16"}[name]
            pure = ("'bf16-pure' (or 'params=bfloat16,compute=bfloat16')" if dtype == torch.bfloat16 else
                    "'params=float16,compute=float16'")
            raise ValueError(f"policy {s!r} is ambiguous: the recipe {short!r} is {short} autocast with float32 "
                             f"weights, write 'params=float32,compute={name}'; for the weights in {short} too, "
                             f"write {pure}")
        return {"param_dtype": dtype, "compute_dtype": dtype}
    fields: dict = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"policy {s!r}: {item!r} is not key=value")
        name = _KEYS.get(key.lower())
        if name is None:
            raise ValueError(f"policy {s!r}: unknown field {key!r} (expected params, compute, scope, islands, "
                             "layers, tf32 or loss_scale)")
        if name in fields:
            raise ValueError(f"policy {s!r}: field {key!r} given twice")
        try:
            if name in ("param_dtype", "compute_dtype"):
                fields[name] = parse_dtype(value, f"field {key!r}")
            elif name == "islands":
                fields[name] = tuple(v for v in value.split(";") if v)
            elif name == "layers":
                fields[name] = _layer_entries(value)
            elif name == "param_scope":
                if value.lower() not in PARAM_SCOPES:
                    raise ValueError(f"field {key!r}: expected one of {', '.join(PARAM_SCOPES)}, got {value!r}")
                fields[name] = value.lower()
            elif name == "tf32":
                if value.lower() not in _BOOLS:
                    raise ValueError(f"field 'tf32': expected 1/0 or true/false, got {value!r}")
                fields[name] = _BOOLS[value.lower()]
            else:
                fields[name] = _as_loss_scale(value)
        except ValueError as exc:
            msg = str(exc)
            if not msg.startswith(("field", "loss_scale")):
                msg = f"field {key!r}: {msg}"
            raise ValueError(f"policy {s!r}: {msg}") from None
    return fields


def _layer_entries(value) -> Tuple[Tuple[str, str], ...]:
    """Entries of the per-layer map from pairs, a dict or the string form ``"name:kind;name:kind"``."""
    if isinstance(value, str):
        items = []
        for item in value.replace(" ", "").split(";"):
            if not item:
                continue
            name, colon, kind = item.rpartition(":")
            if not colon:
                raise ValueError(f"layers: {item!r} is not name:kind (kind one of {', '.join(LAYER_KINDS)})")
            items.append((name, kind))
    elif isinstance(value, Mapping):
        items = list(value.items())
    else:
        try:
            items = list(value)
        except TypeError:
            raise TypeError(f"layers must be (name, kind) pairs, a dict or a 'name:kind;...' string, got "
                            f"{type(value).__name__}") from None
    entries = []
    for item in items:
        if isinstance(item, str) or not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"layers: entry {item!r} is not a (name, kind) pair")
        name, kind = item
        if not isinstance(name, str) or not name or _SEPARATORS & set(name):
            raise ValueError(f"layers: bad module name {name!r} (must be non-empty, without , ; = : or spaces)")
        kind = str(kind).strip().lower()
        if kind not in LAYER_KINDS:
            raise ValueError(f"layers: kind {kind!r} of {name!r} is unknown; expected one of {', '.join(LAYER_KINDS)}")
        entries.append((canonical_name(name), kind))
    return tuple(entries)


def initial_loss_scale(grad_amax: float, margin_bits: int = 4, fmt_max: float = FP16_MAX) -> float:
    """The largest power of two s with grad_amax * s * 2**margin_bits <= fmt_max, in [1, 2**24].

    The margin leaves room for gradients to grow before the first overflow
    (the dynamic scaler then takes over); 2**24 caps scales for tiny gradients.
    """
    if not (math.isfinite(grad_amax) and grad_amax > 0):
        raise ValueError(f"grad_amax must be finite and > 0, got {grad_amax}")
    exponent = math.floor(math.log2(fmt_max / (grad_amax * 2**margin_bits)))
    # log2 can round across an integer: step down until the bound really holds.
    while exponent > 0 and grad_amax * 2.0**exponent * 2**margin_bits > fmt_max:
        exponent -= 1
    return 2.0 ** min(max(exponent, 0), 24)


class AdaptivePrecisionSelector:
    """Picks a PrecisionPolicy from the device's native formats, an analysis and overrides.

    The decision table (the first row that matches wins)::

      bf16 native             -> params fp32, compute bf16, no loss scaling
      fp16 native (GPU only)  -> params fp32, compute fp16, dynamic loss scaling
      otherwise               -> fp32 throughout

    TF32 is on wherever it is native (fp32 islands and fp32 ops benefit). fp8 is
    only recommended in the reasons: which layers gain from it is measured
    (policies "bf16+fp8", "bf16-weights+fp8", "bf16-pure+fp8" of AdaptiveMixedPrecision, the "+fp8"
    candidates of :meth:`tune`) or written in ``layers``. On the CPU, fp16 is never chosen: torch's CPU autocast
    speaks bf16, and fp16 without loss scaling underflows.
    """

    def __init__(self, fp32_islands_for_fp32: bool = False):
        # Islands mean nothing when compute is already fp32; kept as an option for reports.
        self.fp32_islands_for_fp32 = fp32_islands_for_fp32

    def select(self, model: Optional[torch.nn.Module], capabilities: Capabilities, analysis=None,
               overrides: Union[None, str, Mapping[str, Any], PrecisionPolicy] = None) -> PrecisionPolicy:
        """The policy for `capabilities`: bf16 compute where bf16 is native, fp16 with dynamic loss scaling on GPUs
        with fp16 tensor cores only, else fp32; fp32 weights; TF32 where native; the layers `analysis` flags
        as risky in the compute dtype as fp32 islands. `overrides` (a policy string, a dict of fields or a
        PrecisionPolicy) win over the selection. Every choice is explained in the policy's ``reasons``."""
        reasons = []
        caps = capabilities
        where = caps.name + (" (sm_%d%d)" % caps.compute_capability if caps.compute_capability else "")
        forced = _override_fields(overrides)

        # 1. Compute dtype from the native formats.
        if caps.bf16:
            compute = torch.bfloat16
            reasons.append(f"compute=bfloat16: {where} has native bf16; bf16 has fp32's range, "
                           "so no loss scaling is needed")
        elif caps.fp16 and caps.device_type != "cpu":
            compute = torch.float16
            reasons.append(f"compute=float16: {where} has fp16 tensor cores but no native bf16 "
                           "(bf16 would be emulated and slow)")
        else:
            compute = torch.float32
            why = "no native 16-bit matrix support"
            if caps.fp16 and caps.device_type == "cpu":
                why = "the CPU has fp16 but not bf16 instructions, and CPU autocast uses bf16"
            reasons.append(f"compute=float32: {where} has {why}")
        param = torch.float32
        reasons.append("params=float32: master weights stay fp32 so small updates are not rounded away")

        if "compute_dtype" in forced:
            compute = forced["compute_dtype"]
            reasons.append(f"compute={dtype_name(compute)}: set by override")
        if "param_dtype" in forced:
            param = forced["param_dtype"]
            reasons.append(f"params={dtype_name(param)}: set by override")
        scope = forced.get("param_scope", "all")
        if "param_scope" in forced:
            reasons.append(f"scope={scope}: set by override")

        # 2. TF32 for what stays fp32.
        if "tf32" in forced:
            tf32 = forced["tf32"]
            reasons.append(f"tf32={int(tf32)}: set by override")
        else:
            tf32 = caps.tf32
            if tf32:
                reasons.append("tf32=1: native TF32 speeds up fp32 matmuls (islands and ops autocast keeps in fp32)")

        # 3. fp32 islands from the analysis.
        if "islands" in forced:
            islands = tuple(forced["islands"])
            reasons.append(f"islands={';'.join(islands) or 'none'}: set by override")
        else:
            islands = self._islands(analysis, compute, reasons)
        _check_islands_exist(model, islands, reasons)
        layers = _layer_entries(forced.get("layers", ()))
        for name, kind in layers:
            reasons.append(f"layer {name}: {kind}, set by override")

        # 4. Loss scaling, which only fp16's narrow range needs.
        if "loss_scale" in forced:
            loss_scale = forced["loss_scale"]
            reasons.append(f"loss_scale={loss_scale or 'none'}: set by override")
        elif compute == torch.float16:
            loss_scale = LossScale(init_scale=self._init_scale(analysis, reasons))
        else:
            loss_scale = None

        # 5. fp8: advice only.
        if caps.fp8:
            reasons.append(f"fp8: {where} has native fp8; policy 'bf16+fp8' (AdaptiveMixedPrecision; also "
                           "'bf16-weights+fp8', 'bf16-pure+fp8', and tune's '+fp8' candidates) measures which "
                           "layers gain and tolerate it, or name them in the policy's layers "
                           "(layers=*.mlp.*:fp8-tensorwise); not selected here without a measurement")

        return PrecisionPolicy(param_dtype=param, compute_dtype=compute, param_scope=scope, tf32=tf32,
                               islands=islands, loss_scale=loss_scale, layers=layers, reasons=tuple(reasons))

    def candidates(self, capabilities: Capabilities, analysis=None, names=None, fp8=None) -> tuple:
        """(recipes, skipped): the candidate recipes of :meth:`tune` for `names` (default all of CANDIDATES),
        and (name, why) for those that cannot run here (`fp8`: see :func:`candidate_recipes`)."""
        return candidate_recipes(capabilities, analysis, names, fp8)

    def tune(self, model: torch.nn.Module, optimizer, batches, loss_fn, candidates=None, steps: int = 8,
             memory_budget=None, *, capabilities: Optional[Capabilities] = None, analysis=None, fp8=None,
             **options):
        """Measured selection: train each candidate recipe briefly on `batches` from one snapshot and pick the
        fastest that agrees with the reference's loss and fits `memory_budget` (see adaptive_amp.tune).

        loss_fn is ``loss_fn(model, batch) -> loss`` (it runs under each candidate's autocast); step k trains on
        ``batches[k % len(batches)]``. candidates: names from CANDIDATES (default: all that run here); fp32
        islands variants come from `analysis` (a PrecisionAnalysis). memory_budget: bytes or "20GiB".
        The "+fp8" candidates share one per-layer fp8 map, measured once before any trial
        (adaptive_amp.fp8.tuning_fp8_map: select_fp8_layers on `batches`, each layer's inputs from `loss_fn`,
        its gains timed from bf16 weights when every "+fp8" candidate trains bf16 weights; its time is
        ``phase_seconds["fp8 selection"]``), and each is listed as skipped, with why, where fp8
        cannot run or no layer gains; `fp8`: a dict of select_fp8_layers' options (min_gain, max_error, kinds,
        gain_fn, compiled, ...). An fp8 choice's reasons end with each layer's decision.
        options: rounds, timed_steps, loss_tolerance, min_cosine, noise_fraction, tie, contenders, state_margin,
        checkpoint_when_needed, offload_snapshot, progress, process_group (see adaptive_amp.tune.Tuner).

        Returns a TuneResult: ``.policy`` is the choice, every trial in its reasons; ``.recipe`` adds what a
        policy does not say (optimizer moments, checkpointing; ``.apply(model, optimizer)``); ``.table()``,
        ``.plot(path)``, ``.to_dict()`` are the A/B report. The model, the optimizer and the RNG states are
        left as they were, bitwise."""
        from ._process_group import rank_zeros
        from .compile_cache import GraphCount
        from .tune import Tuner, check_unsharded, trained_parameters

        compiles = GraphCount()  # (before the fp8 map, which compiles its layers' timings)

        device = torch.device("cpu")
        if isinstance(model, torch.nn.Module):  # (else Tuner says why)
            check_unsharded(model)  # (before the fp8 candidates' map is measured)
            opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else []
            device = next((p.device for p in trained_parameters(model, opts)), device)
            if capabilities is None:
                capabilities = HardwareDetector().detect(device)
        from .fp8.training import check_tuning_options, tuning_fp8_map

        fp8_options = check_tuning_options(fp8)
        # What the fp8 layers save a step, timed as the timed steps compute: compiled where the model runs compiled
        # (the finalists the tuning compiles, or the trials of a model compiled otherwise), else eagerly.
        compiled = isinstance(model, torch.nn.Module) and is_compiled(model)
        fp8_options.setdefault("compiled", compiled_layers(model) if compiled else False)
        asked = list(CANDIDATES) if candidates is None else candidate_names(candidates)
        if all(n.startswith(("bf16-weights", "bf16-pure")) for n in asked if "+fp8" in n):
            # Every fp8 candidate trains bf16 weights: time the layers as those runs compute them.
            fp8_options.setdefault("weight_dtype", torch.bfloat16)
        try:
            batches = list(batches)
        except TypeError:
            pass  # (Tuner says why)
        measured, seconds = [], []

        def fp8_map():
            if not measured:  # once a tuning, for every "+fp8" candidate
                t0 = time.perf_counter()
                # (Under torch.distributed, rank 0's map: the "+fp8" candidates are the same on every rank.)
                measured.append(rank_zeros(options.get("process_group"), device)(
                    tuning_fp8_map(model, batches, loss_fn, **fp8_options)))
                seconds.append(time.perf_counter() - t0)
            return measured[0]

        recipes, skipped = candidate_recipes(capabilities, analysis, candidates, fp8=fp8_map)
        if isinstance(model, torch.nn.Module):
            # A recipe whose cast the model refuses (bf16 weights on a model DDP wraps in float32) is not tried.
            refused = [(r.name, cast_refusal(model, r.policy)) for r in recipes]
            recipes = [r for r, (_, why) in zip(recipes, refused) if why is None]
            skipped = [*skipped, *((name, why) for name, why in refused if why is not None)]
        # (None where the user's fp8 options timed them otherwise)
        saved = measured[0].saved_ms if measured and bool(fp8_options["compiled"]) == compiled else None
        result = Tuner(model, optimizer, batches, loss_fn, capabilities, recipes, skipped, steps=steps,
                       memory_budget=memory_budget, analysis=analysis, fp8_saved_ms=saved, **options).run()
        result.inductor_graphs = compiles.graphs()
        if measured:
            result.phase_seconds["fp8 selection"] = seconds[0]
            result.seconds += seconds[0]
            if result.policy.layers:
                result.policy = result.policy.replace(reasons=tuple(result.policy.reasons) + measured[0].reasons)
        return result

    def _islands(self, analysis, compute: torch.dtype, reasons: list) -> Tuple[str, ...]:
        if analysis is None:
            return ()
        if compute == torch.float32 and not self.fp32_islands_for_fp32:
            reasons.append("islands: none needed, compute is already float32")
            return ()
        islands = []
        for item in analysis.risky_layers(compute) or ():
            name, why = (item, None) if isinstance(item, str) else (item[0], item[1])
            islands.append(name)
            reasons.append(f"island {name}: runs in float32" + (f" ({why})" if why else
                                                                f", the analysis flags it as risky in {dtype_name(compute)}"))
        if not islands:
            reasons.append(f"islands: the analysis flags no layer as risky in {dtype_name(compute)}")
        return tuple(islands)

    @staticmethod
    def _init_scale(analysis, reasons: list) -> float:
        default = LossScale().init_scale
        grad_amax = getattr(analysis, "grad_amax", None)
        if grad_amax is None:
            reasons.append(f"loss_scale=dynamic:{_fmt_number(default)}: fp16 gradients underflow without "
                           "scaling; torch's default initial scale (no gradient statistics given)")
            return default
        try:
            scale = initial_loss_scale(float(grad_amax))
        except ValueError:
            reasons.append(f"loss_scale=dynamic:{_fmt_number(default)}: grad_amax={grad_amax!r} is unusable, "
                           "default initial scale")
            return default
        note = ""
        if float(grad_amax) * 2**4 > FP16_MAX:
            note = " (gradients are so large that even scale 1 leaves less than 16x headroom)"
        reasons.append(f"loss_scale=dynamic:{_fmt_number(scale)}: largest power of two keeping "
                       f"grad_amax={float(grad_amax):.3g} * scale 16x below fp16's max{note}")
        return scale


# CANDIDATES (adaptive_amp.names): the recipes AdaptivePrecisionSelector.tune knows, safest first.


def candidate_names(names) -> list:
    """The canonical names of the candidates asked (a list of names or a comma-separated string; aliases as in
    adaptive_amp.names). An empty list, an unknown name or one given twice is refused, naming `candidates`."""
    if names is not None and not isinstance(names, str):
        try:
            names = list(names)
        except TypeError:
            raise TypeError(f"candidates is a {type(names).__name__}; pass a list of names from "
                            f"{', '.join(CANDIDATES)}") from None
    out = recipe_names(names, "candidates")
    if not out:
        raise ValueError(f"candidates is empty; name at least one of {', '.join(CANDIDATES)} (or leave it out: "
                         "all that run here)")
    return out


def recipe_policy(base: str, tf32: bool = False, islands: Tuple[str, ...] = ()) -> PrecisionPolicy:
    """The policy of a recipe's base (``fp32``, ``bf16``, ``fp16``, ``bf16-weights``, ``bf16-pure``; see
    adaptive_amp.names), with `islands` in float32: what its candidate and its policy preset train with."""
    if base == "fp32":
        return PrecisionPolicy(tf32=tf32)
    if base in ("bf16", "fp16"):
        return PrecisionPolicy(compute_dtype=torch.bfloat16 if base == "bf16" else torch.float16, islands=islands,
                               loss_scale=LossScale() if base == "fp16" else None, tf32=tf32)
    if base in ("bf16-weights", "bf16-pure"):
        return PrecisionPolicy(torch.bfloat16, torch.bfloat16, param_scope="matmul" if base == "bf16-weights"
                               else "all", islands=islands, tf32=tf32)
    raise ValueError(f"base is {base!r}; expected one of fp32, bf16, fp16, bf16-weights, bf16-pure")


def candidate_recipes(capabilities, analysis=None, names=None, fp8=None) -> tuple:
    """(recipes, skipped) for the names asked (default: all of CANDIDATES): each a Recipe, or (name, why) when
    it cannot run here. Islands variants exist only where the analysis flags layers for that dtype. `fp8`:
    ``fp8() -> adaptive_amp.fp8.Fp8Map``, the measured map the "+fp8" candidates put in their policy's
    per-layer map (called at the first of them that can otherwise run; AdaptivePrecisionSelector.tune measures
    it once); without it, or where the map is empty (no fp8 here, no layer gains), they are skipped with why."""
    names = list(CANDIDATES) if names is None else candidate_names(names)
    tf32 = bool(getattr(capabilities, "tf32", False))
    gpu = getattr(capabilities, "device_type", "cpu") == "cuda"
    recipes, skipped = [], []

    def islands_for(name, base, dtype):
        """The analysis' islands in `dtype` for a "+islands" candidate, () for the others; None (the candidate
        skipped) when the analysis flags none: it would equal its base."""
        if not base.endswith("+islands"):
            return ()
        flagged = () if analysis is None else tuple(
            item if isinstance(item, str) else item[0] for item in analysis.risky_layers(dtype) or ())
        if not flagged:
            why = ("no sensitivity analysis was given" if analysis is None else
                   f"the analysis flags no layer as risky in {dtype_name(dtype)}")
            skipped.append((name, f"{why}, so it equals {base.split('+')[0]}"))
            return None
        return flagged

    for name in names:
        base, ckpt = name.replace("+ckpt", ""), name.endswith("+ckpt")
        safety = CANDIDATES.index(base) * 2 + int(ckpt)
        kw = dict(name=name, checkpoint=ckpt, safety=safety)
        with_fp8 = base.endswith("+fp8")
        base = base[:-len("+fp8")] if with_fp8 else base
        first = base.split("+")[0]
        if first == "fp32":
            recipe = Recipe(policy=recipe_policy("fp32", tf32), **kw)
        elif first in ("bf16", "fp16"):
            dtype = torch.bfloat16 if first == "bf16" else torch.float16
            if gpu and not getattr(capabilities, first, False):
                skipped.append((name, f"{dtype_name(dtype)} is not native on {capabilities.name}"))
                continue
            islands = islands_for(name, base, dtype)
            if islands is None:
                continue
            recipe = Recipe(policy=recipe_policy(first, tf32, islands), **kw)
        else:  # bf16-weights, bf16-pure
            if gpu and not getattr(capabilities, "bf16", False):
                skipped.append((name, f"bf16 is not native on {capabilities.name}"))
                continue
            islands = islands_for(name, base, torch.bfloat16)  # bf16-weights only: its islands keep fp32 weights
            if islands is None:
                continue
            moments = torch.bfloat16 if base.endswith("bf16-moments") else torch.float32
            recipe = Recipe(policy=recipe_policy(first, tf32, islands), moment_dtype=moments, **kw)
        if with_fp8:
            measured = fp8() if fp8 is not None else None
            if measured is None:
                skipped.append((name, "its fp8 layers are measured on the model: AdaptivePrecisionSelector.tune "
                                      "measures them"))
                continue
            if not measured.layers:
                skipped.append((name, f"no layer in fp8: {measured.why_none}"))
                continue
            recipe = recipe.replace(policy=recipe.policy.replace(layers=measured.layers))
        recipes.append(recipe)
    return recipes, skipped


def _override_fields(overrides) -> dict:
    """Overrides as PrecisionPolicy fields: a policy, a (partial) policy string or a dict."""
    if overrides is None:
        return {}
    if isinstance(overrides, PrecisionPolicy):
        d = {f.name: getattr(overrides, f.name) for f in dataclasses.fields(overrides) if f.name != "reasons"}
        return d
    if isinstance(overrides, str):
        return parse_policy_fields(overrides)
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be None, a policy string, a dict or a PrecisionPolicy, "
                        f"got {type(overrides).__name__}")
    fields = {}
    for key, value in overrides.items():
        name = _KEYS.get(key, key)
        if name not in ("param_dtype", "compute_dtype", "param_scope", "tf32", "islands", "layers", "loss_scale"):
            raise ValueError(f"overrides: unknown field {key!r} (expected param_dtype, compute_dtype, param_scope, "
                             "tf32, islands, layers or loss_scale)")
        if name in ("param_dtype", "compute_dtype"):
            value = parse_dtype(value, f"overrides: field {key!r}")
        elif name == "islands":
            value = (value,) if isinstance(value, str) else tuple(value)
        elif name == "layers":
            value = _layer_entries(value)
        elif name == "loss_scale":
            value = _as_loss_scale(value)
        elif name == "tf32":
            value = bool(value)
        fields[name] = value
    return fields


def _check_islands_exist(model, islands: Iterable[str], reasons: list) -> None:
    """Note islands the model has no module for: a typo there silently keeps a layer in 16 bits."""
    if model is None or not islands or not hasattr(model, "named_modules"):
        return
    _, missing = expand_names(islands, model)
    if missing:
        reasons.append(f"warning: island(s) {', '.join(missing)} match no module of the model")
