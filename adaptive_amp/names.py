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

``fp8``, ``float8`` and ``f8`` name no single format (e4m3 or e5m2?): they are refused with both.

**Recipes** (``policy="tune"``'s candidates and ``python -m adaptive_amp tune --candidates``; the
trials' names; the policy presets; MemoryGuard's moves; the e2e benchmark's rows):

==========================  =====================================================================
recipe                      what it trains with
==========================  =====================================================================
fp32                        float32 throughout (TF32 matmuls where native)
bf16, fp16                  autocast in bf16 or fp16 (fp16 with dynamic loss scaling), fp32 weights
bf16-weights                the matmul layers' weights in bf16 (stochastic rounding), bf16 autocast
bf16-pure                   weights, gradients and compute in bf16, no autocast (stochastic rounding)
float8                      torchao float8 training of the large linear layers, bf16 autocast
``+islands``                with the analysis' fp32 islands (bf16, fp16, bf16-weights)
``+bf16-moments``           the optimizer's moments in bf16 (bf16-weights, bf16-pure)
``+ckpt``                   with activation checkpointing of the model's repeated blocks
==========================  =====================================================================

A recipe's first part also takes its format's spellings (``bfloat16+islands`` is ``bf16+islands``,
``float32`` is ``fp32``), and ``pure-bf16`` is ``bf16-pure``; ``fp8`` is refused (the recipe is
``float8``). In a policy string (``policy="..."``, ``PrecisionPolicy.from_string``) the names
``fp32``, ``bf16-pure`` and ``bf16-weights`` are presets; a lone 16-bit format (``"bf16"``, ``"fp16"``,
``"bfloat16"``, ...) is refused, since jmp's shorthand (params and compute in it) and the recipe of the same
name (autocast, fp32 weights) differ: write ``bf16-pure`` (or ``params=bfloat16,compute=bfloat16``) for the
one, ``params=float32,compute=bfloat16`` for the other.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence

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


#: Recipes of the measured selection, safest first (each may end in "+ckpt": activation checkpointing).
CANDIDATES = ("fp32", "bf16+islands", "bf16", "fp16+islands", "fp16", "bf16-weights+islands", "bf16-weights",
              "bf16-weights+bf16-moments", "bf16-pure", "bf16-pure+bf16-moments", "float8")
_RECIPE_BASES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "bf16-weights": "bf16-weights",
                 "bf16-pure": "bf16-pure", "pure-bf16": "bf16-pure", "float8": "float8"}


def recipe_name(text: str, what: str = "candidate") -> str:
    """The canonical name of the recipe `text` spells ("bfloat16+islands+ckpt" -> "bf16+islands+ckpt")."""
    if not isinstance(text, str):
        raise TypeError(f"{what} {text!r} is a {type(text).__name__}; pass a recipe name such as 'bf16'")
    parts = [p.strip().lower() for p in text.strip().split("+")]
    base = parts[0]
    if base in ("fp8", "f8"):
        raise ValueError(f"{what} {text!r}: fp8 names no recipe; the float8 recipe is 'float8' (torchao float8 "
                         "training)")
    if base not in _RECIPE_BASES:
        try:
            base = _SHORT.get(format_name(base, ("float32", "float16", "bfloat16")))
        except ValueError:
            base = None
    name = "+".join([_RECIPE_BASES.get(base, base or parts[0])] + parts[1:])
    plain = name[:-len("+ckpt")] if name.endswith("+ckpt") else name
    if plain not in CANDIDATES:
        raise ValueError(f"{what} {text!r} is unknown; choose from {', '.join(CANDIDATES)} (each may end in +ckpt "
                         "for activation checkpointing)")
    return name


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
