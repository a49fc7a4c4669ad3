"""The names adaptive_amp accepts for number formats and training recipes: each means one thing everywhere.

**Formats** (``stochastic_round``'s dtype, ``tensor_stats``' fmt, ``PrecisionAnalyzer``'s candidates and
``python -m adaptive_amp analyze --candidates``, a policy string's ``params=``/``compute=``). The canonical
name is torch's; a torch dtype, ``"torch.<name>"`` and any capitalization are accepted too. Each place
takes the formats it can use (stochastic rounding has no float32 target, a policy no fp8 dtype).

================  ================================================
canonical         also accepted
================  ================================================
float32           fp32, f32, float
float16           fp16, f16, half
bfloat16          bf16
float8_e4m3fn     e4m3, e4m3fn, fp8_e4m3, fp8_e4m3fn, float8_e4m3
float8_e5m2       e5m2, fp8_e5m2
================  ================================================

``fp8``, ``float8`` and ``f8`` name no single format (e4m3 or e5m2?): they are refused with both
(as a recipe, ``float8`` means ``bf16+fp8``).

**Recipes** (``policy="tune"``'s candidates and ``python -m adaptive_amp tune --candidates``; the
trials' names; the policy presets; MemoryGuard's moves; the e2e benchmark's rows):

==========================  =====================================================================
recipe                      what it trains with
==========================  =====================================================================
fp32                        float32 throughout (TF32 matmuls where native)
bf16, fp16                  autocast in bf16 or fp16 (fp16 with dynamic loss scaling), fp32 weights
bf16-weights                the matmul layers' weights in bf16 (stochastic rounding), bf16 autocast
bf16-pure                   weights, gradients and compute in bf16, no autocast (stochastic rounding)
``+islands``                with the analysis' fp32 islands (bf16, fp16, bf16-weights)
``+bf16-moments``           the optimizer's moments in bf16 (bf16-weights, bf16-pure)
``+fp8``                    with the layers measured to gain and tolerate fp8 in it, through torchao's
                            float8 matmuls (bf16, bf16-weights, bf16-pure; their moments' variants)
``+ckpt``                   with activation checkpointing of the model's repeated blocks
==========================  =====================================================================

The suffixes' canonical order is the table's (``bf16-pure+bf16-moments+fp8+ckpt``); any other order is
accepted and means the same recipe. ``+fp8`` is measured per layer (adaptive_amp.fp8.select_fp8_layers):
a tuning measures the layers once and every ``+fp8`` candidate shares that map. A recipe's first part also
takes its format's spellings (``bfloat16+islands`` is ``bf16+islands``, ``float32`` is ``fp32``), and
``pure-bf16`` is ``bf16-pure``; ``float8`` means ``bf16+fp8`` (torchao's float8 training, in the layers
measured to gain from it); ``fp8`` alone is refused (fp8 stacks on a bf16 recipe). In a
policy string (``policy="..."``, ``PrecisionPolicy.from_string``) the names ``fp32``, ``bf16-pure`` and
``bf16-weights`` are presets; a lone 16-bit format (``"bf16"``, ``"fp16"``, ``"bfloat16"``, ...) is refused,
since jmp's shorthand (params and compute in it) and the recipe of the same name (autocast, fp32 weights)
differ: write ``bf16-pure`` (or ``params=bfloat16,compute=bfloat16``) for the one,
``params=float32,compute=bfloat16`` for the other. ``AdaptiveMixedPrecision``'s policy also takes
``bf16+fp8``, ``bf16-weights+fp8`` and ``bf16-pure+fp8`` (:func:`fp8_preset`): the base recipe's policy with
the layers measured for fp8 (the optimizer, and so the moments, are the caller's).
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

FORMATS = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
#: Other spellings of each format -> its canonical name.
FORMAT_ALIASES = {
    "fp32": "float32", "f32": "float32", "float": "float32",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "bf16": "bfloat16",
    "e4m3": "float8_e4m3fn", "e4m3fn": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
    "fp8_e4m3fn": "float8_e4m3fn",
    "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
}
#: Names that could mean more than one format -> the formats they could mean.
AMBIGUOUS_FORMATS = {"fp8": ("float8_e4m3fn", "float8_e5m2"), "float8": ("float8_e4m3fn", "float8_e5m2"),
                     "f8": ("float8_e4m3fn", "float8_e5m2")}
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def describe_formats(accepted: Sequence[str]) -> str:
    """``float16 (fp16), bfloat16 (bf16)``: the canonical names of `accepted` with a short spelling each."""
    return ", ".join(f"{f} ({_SHORT[f]})" if f in _SHORT else f for f in accepted)


def format_name(text: str, accepted: Sequence[str] = FORMATS, what: str = "format") -> str:
    """The canonical name of the format `text` spells (see the module docstring), if it is in `accepted`.

    Raises ValueError naming `what` and listing what is accepted; an ambiguous name ("fp8") lists the formats
    it could mean."""
    name = str(text).strip().lower()
    name = name[len("torch."):] if name.startswith("torch.") else name
    could = [f for f in AMBIGUOUS_FORMATS.get(name, ()) if f in accepted]
    if could:
        raise ValueError(f"{what} {text!r} is ambiguous: write {' or '.join(describe_formats([f]) for f in could)}")
    name = FORMAT_ALIASES.get(name, name)
    if name not in accepted:
        raise ValueError(f"{what} {text!r} is not one of {describe_formats(accepted)}")
    return name


#: The recipes fp8 layers stack on ("<base>+fp8"): bf16 autocast and the memory recipes that compute under it.
FP8_BASES = ("bf16", "bf16-weights", "bf16-pure")
#: Recipes of the measured selection, safest first (each may end in "+ckpt": activation checkpointing). fp8
#: comes last: each "+fp8" recipe is its base plus fp8 rounding in the layers measured to take it.
CANDIDATES = ("fp32", "bf16+islands", "bf16", "fp16+islands", "fp16", "bf16-weights+islands", "bf16-weights",
              "bf16-weights+bf16-moments", "bf16-pure", "bf16-pure+bf16-moments",
              "bf16+fp8", "bf16-weights+fp8", "bf16-weights+bf16-moments+fp8", "bf16-pure+fp8",
              "bf16-pure+bf16-moments+fp8")
_RECIPE_BASES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "bf16-weights": "bf16-weights",
                 "bf16-pure": "bf16-pure", "pure-bf16": "bf16-pure"}
#: The suffixes in their canonical order (a name written in another order means the same recipe).
_SUFFIXES = ("islands", "bf16-moments", "fp8", "ckpt")


def _fp8_refusal(what: str, text: str, base: str) -> str:
    return (f"{what} {text!r}: fp8 stacks on {', '.join(FP8_BASES)} (its layers compute beside bf16), not on "
            f"{base}; write " + " or ".join(f"'{b}+fp8'" for b in FP8_BASES))


def _recipe_parts(text: str, what: str) -> List[str]:
    """`text` split into its canonical base and suffixes (in the canonical order when all are known)."""
    if not isinstance(text, str):
        raise TypeError(f"{what} {text!r} is a {type(text).__name__}; pass a recipe name such as 'bf16'")
    parts = [p.strip().lower() for p in text.strip().split("+")]
    if parts[0] == "float8":  # torchao's name for its float8 training: fp8 over bf16 autocast
        parts[:1] = ["bf16", "fp8"]
    base = parts[0]
    if base in ("fp8", "f8"):
        raise ValueError(f"{what} {text!r}: fp8 names no recipe alone; it stacks on a bf16 recipe: "
                         + ", ".join(f"'{b}+fp8'" for b in FP8_BASES))
    if base not in _RECIPE_BASES:
        try:
            base = _SHORT.get(format_name(base, ("float32", "float16", "bfloat16")))
        except ValueError:
            base = None
    suffixes = parts[1:]
    if set(suffixes) <= set(_SUFFIXES) and len(set(suffixes)) == len(suffixes):
        suffixes = sorted(suffixes, key=_SUFFIXES.index)
    return [_RECIPE_BASES.get(base, base or parts[0])] + suffixes


def recipe_name(text: str, what: str = "candidate") -> str:
    """The canonical name of the recipe `text` spells ("bfloat16+islands+ckpt" -> "bf16+islands+ckpt",
    "bf16-pure+fp8+bf16-moments" -> "bf16-pure+bf16-moments+fp8")."""
    parts = _recipe_parts(text, what)
    if "fp8" in parts[1:] and parts[0] not in FP8_BASES:
        raise ValueError(_fp8_refusal(what, text, parts[0]))
    name = "+".join(parts)
    plain = name[:-len("+ckpt")] if name.endswith("+ckpt") else name
    if plain not in CANDIDATES:
        raise ValueError(f"{what} {text!r} is unknown; choose from {', '.join(CANDIDATES)} (each may end in +ckpt "
                         "for activation checkpointing)")
    return name


def fp8_preset(text: str, what: str = "policy") -> Optional[str]:
    """The base recipe of a policy name that measures its fp8 layers ("bf16-pure+fp8" -> "bf16-pure"; the base's
    spellings are accepted), None for any other name. "+fp8" on another base, or with other suffixes (moments
    and checkpointing are a recipe's, not a policy's), is refused naming `what`."""
    if not isinstance(text, str) or "+" not in text:
        return None
    parts = [p.strip().lower() for p in text.strip().split("+")]
    if "fp8" not in parts[1:]:
        return None
    base = _recipe_parts(parts[0], what)[0]
    if base not in FP8_BASES:
        raise ValueError(_fp8_refusal(what, text, base))
    if len(parts) != 2:
        raise ValueError(f"{what} {text!r}: a policy measuring its fp8 layers is one of "
                         + ", ".join(f"'{b}+fp8'" for b in FP8_BASES) + "; the optimizer's moments are the "
                         "optimizer's own (adaptive_amp.optim.AdamW(moment_dtype=...)), and checkpointing is "
                         "policy='tune''s or a MemoryGuard's")
    return base


def recipe_names(names: Iterable[str], what: str = "candidates") -> List[str]:
    """:func:`recipe_name` of each; a name given twice (in any spelling) is refused."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    out: List[str] = []
    for n in names:
        name = recipe_name(n, what)
        if name in out:
            raise ValueError(f"{what}: {n!r} is {name!r}, given twice")
        out.append(name)
    return out
