"""How many graphs inductor compiled, and how many of them it loaded from its on-disk cache, for a report of
what compiling cost.

The first compile of a graph on a machine traces it, lowers it and builds its kernels; a later one (in any
process, with the same torch, graph and options) loads the result from inductor's cache (``TORCHINDUCTOR_CACHE_DIR``,
by default under the system's temporary directory) and only traces. So the same tuning costs a different time
on a machine that compiled its graphs before: measured on an H200 (Llama-3-8B shape, compiled blocks,
``policy="tune"`` at 3 x 2048 tokens), its fp8 selection took 28.4 s and its compiles 28.2 s where the cache
held none of its graphs, and 11.1 s and 7.6 s in the next process on the same machine.
"""

from __future__ import annotations

from typing import Dict, Optional

_KEYS = ("hit", "miss", "bypass")


def inductor_counts() -> Dict[str, int]:
    """Inductor's graph-cache counters in this process so far: graphs loaded from the cache (``hit``),
    compiled and stored (``miss``), compiled without it (``bypass``)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001 - a torch without dynamo compiles nothing
        return dict.fromkeys(_KEYS, 0)
    inductor = counters.get("inductor", {})  # (get: reading must not add the key)
    return {k: int(inductor.get(f"fxgraph_cache_{k}", 0)) for k in _KEYS}


def graphs_since(before: Dict[str, int]) -> Optional[Dict[str, int]]:
    """What inductor compiled since :func:`inductor_counts` returned `before`: ``{"graphs": n, "from_cache":
    k}`` (a forward and its backward count as two); None where it compiled nothing, or where the counters were
    cleared since (``torch._dynamo.utils.counters.clear()``)."""
    now = inductor_counts()
    change = {k: now[k] - before.get(k, 0) for k in _KEYS}
    if any(v < 0 for v in change.values()):  # the counters were cleared meanwhile: nothing can be said
        return None
    graphs = sum(change.values())
    return {"graphs": graphs, "from_cache": change["hit"]} if graphs > 0 else None


def describe_graphs(graphs: Optional[Dict[str, int]]) -> str:
    """`graphs` (:func:`graphs_since`'s) in words, for a report: "" for None."""
    if not graphs:
        return ""
    n, cached = graphs["graphs"], graphs["from_cache"]
    its = f"its {n} graphs" if n != 1 else "its graph"
    if cached == 0:
        return f"inductor compiled {its}, none of them in its on-disk cache" if n != 1 else \
            "inductor compiled its graph, not in its on-disk cache"
    if cached == n:
        return f"inductor loaded {its} from its on-disk cache"
    return f"inductor compiled {n - cached} of {its} and loaded {cached} from its on-disk cache"
