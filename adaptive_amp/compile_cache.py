"""How many graphs inductor compiled, and how many it loaded from its on-disk cache, for a report of what
compiling cost.

The first compile of a graph on a machine traces it, lowers it and builds its kernels; a later one (in any
process, with the same torch, graph and options) loads the result from inductor's cache (``TORCHINDUCTOR_CACHE_DIR``,
by default under the system's temporary directory) and only traces. So the same tuning costs less on a machine
that compiled its graphs before (bench/RESULTS.md, "`policy="tune"` at this size", has the measurements).

The count comes from inductor's FX graph cache counters: where that cache is off (``fx_graph_cache=False``,
``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``) inductor counts nothing, and neither does this.
"""

from __future__ import annotations

from typing import Dict, Optional

_KEYS = ("hit", "miss", "bypass")


def _counts() -> Dict[str, int]:
    """Inductor's graph-cache counts in this process so far: graphs loaded from the cache (``hit``), compiled and
    stored (``miss``), compiled without it (``bypass``). Read by value: inductor replaces its Counter with a
    copy when it first compiles in a process (its pattern matcher's set-up)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001 - a torch without dynamo compiles nothing
        return dict.fromkeys(_KEYS, 0)
    inductor = counters.get("inductor", {})  # (get: reading must not add the key)
    return {k: int(inductor.get(f"fxgraph_cache_{k}", 0)) for k in _KEYS}


class GraphCount:
    """The graphs inductor compiles from now on, and how many of them it loads from its on-disk cache."""

    def __init__(self):
        self._start = _counts()

    def graphs(self) -> Optional[Dict[str, int]]:
        """``{"graphs": n, "from_cache": k}`` since this count began (a forward and its backward count as two);
        None where nothing was counted: nothing compiled, inductor's FX graph cache off, or torch's counters
        cleared meanwhile below where they started (a clear followed by more compiles than before goes
        unseen: the count is then short)."""
        change = {k: v - self._start[k] for k, v in _counts().items()}
        if any(v < 0 for v in change.values()):
            return None
        graphs = sum(change.values())
        return {"graphs": graphs, "from_cache": change["hit"]} if graphs > 0 else None


def describe_graphs(graphs: Optional[Dict[str, int]]) -> str:
    """`graphs` (:meth:`GraphCount.graphs`'s) in words, for a report: "" for None."""
    if not graphs:
        return ""
    n, cached = graphs["graphs"], graphs["from_cache"]
    what = f"{n} graph{'s' if n != 1 else ''}"
    if cached == 0:
        return f"{what} compiled by inductor, none found in its on-disk cache"
    if cached == n:
        return f"{what} loaded from inductor's on-disk cache"
    return f"{what}: {n - cached} compiled by inductor, {cached} loaded from its on-disk cache"
