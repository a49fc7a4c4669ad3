"""Reports of a training run: readable text, JSON, and PNG plots.

A :class:`TrainingReport` is built from plain data, so that whatever ran the
training (``AdaptiveMixedPrecision``, the demo, a user's own loop) only has
to record lists and dicts:

* ``history``: equal-length lists by column, one entry per step: ``step``
  (int), ``loss`` (float, NaN allowed), ``grad_norm`` (NaN when unknown),
  ``scale`` (NaN without loss scaling), ``found_inf`` (0/1) and
  ``skipped_steps`` (cumulative). Missing columns are filled in (steps
  counted from 0, NaN, no overflow, skipped steps summed from ``found_inf``);
  extra columns are kept.
* ``events``: dicts ``{"step", "kind", "layer", "message", "data"}``, e.g.
  kind ``"loss_spike"``, ``"overflow_rate"``, ``"promote"``.
* ``policies``: ``(step, policy_string)`` pairs, the policy in force from
  that step on.
* ``analysis``: optional ``PrecisionAnalysis.to_dict()`` (per-layer
  sensitivity); ``summary``: optional extra scalars (``step_time_ms``...).

Plots need matplotlib (``pip install matplotlib``, or the ``plot`` extra), imported only
when a plot is drawn and used through its Agg canvas, so a report never
touches the caller's pyplot state or backend.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

HISTORY_COLUMNS = ("step", "loss", "grad_norm", "scale", "found_inf", "skipped_steps")
_FLOAT_COLUMNS = ("loss", "grad_norm", "scale")
#: Event kinds that change the policy: their messages are the reasons shown with a policy change.
POLICY_EVENT_KINDS = ("promote", "demote", "switch_compute", "memory_pressure", "memory_recovered", "fp8_demote",
                      "fp8_restore")
PLOT_HINT = "plots need matplotlib: pip install matplotlib (the plot extra)"
#: Events of one kind quoted in the text report; the rest are counted.
EVENT_MESSAGES_SHOWN = 3
SENSITIVE_LAYERS_SHOWN = 8


class TrainingReport:
    """What happened in a training run, as text (``text()``), JSON (``to_json()``) and plots.

    Args:
        history: per-step columns (see the module docstring).
        events: what the monitor or controller noticed and did.
        policies: ``(step, policy)`` pairs; a policy may be a string or a
            ``PrecisionPolicy`` (kept as its string form).
        analysis: a ``PrecisionAnalysis`` or its ``to_dict()``.
        summary: extra scalars shown as they are (``step_time_ms``, ``device``...).
        title: the first line of the text report and of the plots.
    """

    def __init__(self, history: Optional[Mapping[str, Sequence]] = None, events: Iterable[Mapping] = (),
                 policies: Iterable[Tuple[int, Any]] = (), analysis=None, summary: Optional[Mapping] = None,
                 title: str = "adaptive_amp training report", tuning=None):
        self.history = _check_history(history or {})
        self.events = [_check_event(e, i) for i, e in enumerate(events)]
        self.events.sort(key=lambda e: e["step"])  # stable: same-step events keep their order
        self.policies = _check_policies(policies)
        if analysis is not None and hasattr(analysis, "to_dict"):
            analysis = analysis.to_dict()
        if analysis is not None and not isinstance(analysis, Mapping):
            raise TypeError(f"analysis is a {type(analysis).__name__}; pass a PrecisionAnalysis or its to_dict()")
        self.analysis = dict(analysis) if analysis is not None else None
        if summary is not None and not isinstance(summary, Mapping):
            raise TypeError(f"summary is a {type(summary).__name__}; pass a dict of scalars")
        self.summary = dict(summary or {})
        self.title = str(title)
        # policy="tune": a TuneResult (adaptive_amp.tune) or its to_dict(), which carries its A/B table as text;
        # the plot needs the TuneResult itself.
        self._tune_result = tuning if hasattr(tuning, "plot") else None
        self.tuning = tuning.to_dict() if hasattr(tuning, "to_dict") else (dict(tuning) if tuning else None)

    # ------------------------------------------------------------------ numbers
    @property
    def num_steps(self) -> int:
        return len(self.history["step"])

    def stats(self) -> Dict[str, Any]:
        """The numbers the text report states, as a dict (None where there is nothing to measure)."""
        h, n = self.history, self.num_steps
        losses = h["loss"]
        tail = max(1, math.ceil(n / 10))  # the last 10% of the steps, at least one
        found = sum(1 for v in h["found_inf"] if v)
        skipped = int(h["skipped_steps"][-1]) if n else 0
        finite_scales = _finite(h["scale"])
        finite_norms = _finite(h["grad_norm"])
        finite_losses = _finite(losses)
        best = min(((v, s) for v, s in zip(losses, h["step"]) if math.isfinite(v)), default=None)
        return {
            "steps": n,
            "first_step": h["step"][0] if n else None,
            "last_step": h["step"][-1] if n else None,
            "final_loss": _mean(losses[-tail:]) if n else None,
            "initial_loss": _mean(losses[:tail]) if n else None,
            "final_loss_steps": tail if n else 0,
            "best_loss": best[0] if best else None,
            "best_loss_step": best[1] if best else None,
            "nan_losses": sum(1 for v in losses if not math.isfinite(v)),
            "finite_losses": len(finite_losses),
            "skipped_steps": skipped,
            "overflow_steps": found,
            "overflow_rate": found / n if n else None,
            "scale_min": min(finite_scales) if finite_scales else None,
            "scale_max": max(finite_scales) if finite_scales else None,
            "scale_final": finite_scales[-1] if finite_scales else None,
            "grad_norm_min": min(finite_norms) if finite_norms else None,
            "grad_norm_median": _median(finite_norms) if finite_norms else None,
            "grad_norm_max": max(finite_norms) if finite_norms else None,
            "policy_changes": max(0, len(self.policies) - 1),
            "events": len(self.events),
        }

    def policy_changes(self) -> List[dict]:
        """Each change of policy: step, old and new policy, what changed, and the reasons (the messages of
        the promote/demote/switch_compute events of that step)."""
        changes = []
        for (_, old), (step, new) in zip(self.policies, self.policies[1:]):
            reasons = [e["message"] or e["kind"] for e in self.events
                       if e["step"] == step and e["kind"] in POLICY_EVENT_KINDS]
            changes.append({"step": step, "old": old, "new": new, "diff": policy_diff(old, new), "reasons": reasons})
        return changes

    def events_by_kind(self) -> Dict[str, List[dict]]:
        """Events grouped by kind, kinds in order of first appearance."""
        groups: Dict[str, List[dict]] = {}
        for e in self.events:
            groups.setdefault(e["kind"], []).append(e)
        return groups

    def sensitive_layers(self, limit: Optional[int] = SENSITIVE_LAYERS_SHOWN) -> List[dict]:
        """Layers of the analysis, most sensitive first: ``{"name", "errors": {dtype: model_error},
        "worst", "risky": [dtypes]}``. A model error of None (not finite) counts as infinite."""
        if not self.analysis:
            return []
        layers: Dict[str, dict] = {}
        for r in self.analysis.get("results", []):
            err = r.get("model_error")
            err = math.inf if err is None else float(err)
            entry = layers.setdefault(r.get("name", ""), {"name": r.get("name", ""), "errors": {}, "risky": []})
            entry["errors"][r.get("dtype", "?")] = err
        for fmt, risky in (self.analysis.get("risky") or {}).items():
            for item in risky:
                name = item[0] if isinstance(item, (list, tuple)) else item
                if name in layers:
                    layers[name]["risky"].append(fmt)
        for entry in layers.values():
            errors = [e for e in entry["errors"].values() if not math.isnan(e)]
            entry["worst"] = max(errors) if errors else math.nan
        ranked = sorted(layers.values(), key=lambda e: (bool(e["risky"]), _sort_key(e["worst"])), reverse=True)
        return ranked if limit is None else ranked[:limit]

    # ------------------------------------------------------------------ text
    def text(self) -> str:
        s = self.stats()
        lines = [self.title, "=" * len(self.title)]
        if not s["steps"]:
            lines.append("steps:        none recorded")
        else:
            lines.append(f"steps:        {s['steps']} (step {s['first_step']} to {s['last_step']})")
            if s["final_loss"] is None:
                lines.append(f"final loss:   no finite loss in the last {s['final_loss_steps']} step(s)")
            else:
                lines.append(f"final loss:   {_fmt(s['final_loss'])} (mean of the last {s['final_loss_steps']} "
                             f"step(s)); best {_fmt(s['best_loss'])} at step {s['best_loss_step']}")
            lines.append(f"loss trend:   {self._trend(s)}")
            lines.append(f"skipped:      {s['skipped_steps']} of {s['steps']} step(s) "
                         f"({_pct(s['skipped_steps'] / s['steps'])}); overflow rate {_pct(s['overflow_rate'])} "
                         f"({s['overflow_steps']} step(s) with inf/NaN gradients)")
            if s["scale_min"] is None:
                lines.append("loss scale:   none (no loss scaling)")
            else:
                lines.append(f"loss scale:   {_fmt(s['scale_min'])} to {_fmt(s['scale_max'])} "
                             f"(final {_fmt(s['scale_final'])})")
            if s["grad_norm_min"] is None:
                lines.append("grad norm:    not recorded")
            else:
                lines.append(f"grad norm:    {_fmt(s['grad_norm_min'])} to {_fmt(s['grad_norm_max'])} "
                             f"(median {_fmt(s['grad_norm_median'])})")
        for key, value in self.summary.items():
            if _repeats(key, value, s, self.policies):
                continue
            label = _SUMMARY_LABELS.get(key, key)
            lines.append(f"{label + ':':<13} {_fmt(value)}")

        lines.append("")
        if not self.policies:
            lines.append("policy: not recorded")
        else:
            lines.append(f"policy: {self.policies[0][1]} (from step {self.policies[0][0]})")
            changes = self.policy_changes()
            if not changes:
                lines.append("  no changes")
            for c in changes:
                lines.append(f"  step {c['step']}: {c['diff']} (now {c['new']})")
                for why in c["reasons"] or ["(no promote/demote/switch_compute event at this step)"]:
                    lines.append(f"      because: {why}")

        lines.append("")
        groups = self.events_by_kind()
        lines.append(f"events: {len(self.events) or 'none'}")
        for kind, evs in groups.items():
            where = f"step {evs[0]['step']}" if len(evs) == 1 else f"steps {evs[0]['step']} to {evs[-1]['step']}"
            lines.append(f"  {kind} x{len(evs)} ({where})")
            for e in evs[:EVENT_MESSAGES_SHOWN]:
                layer = f" [{e['layer']}]" if e["layer"] else ""
                lines.append(f"    step {e['step']}{layer}: {e['message'] or '(no message)'}")
            if len(evs) > EVENT_MESSAGES_SHOWN:
                lines.append(f"    ... and {len(evs) - EVENT_MESSAGES_SHOWN} more")

        if self.analysis is not None:
            lines.append("")
            lines.extend(self._sensitivity_lines())
        if self.tuning and self.tuning.get("table"):
            lines.extend(["", self.tuning["table"]])
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return (f"TrainingReport({self.num_steps} steps, {len(self.events)} events, "
                f"{len(self.policies)} policies, analysis={'yes' if self.analysis else 'no'})")

    @staticmethod
    def _trend(s: dict) -> str:
        first, last = s["initial_loss"], s["final_loss"]
        nan = f"; {s['nan_losses']} non-finite loss(es)" if s["nan_losses"] else ""
        if s["steps"] < 2:
            return "one step only" + nan
        if first is None or last is None:
            return "unknown (no finite loss at the start or the end)" + nan
        change = (last - first) / abs(first) if first else math.inf if last > first else 0.0
        # A few percent either way is noise for a short run: call it flat.
        word = "flat" if abs(change) < 0.02 else "down" if change < 0 else "UP"
        return f"{word}, {_fmt(first)} -> {_fmt(last)} ({change:+.1%}, first vs last {s['final_loss_steps']} " \
               f"step(s)){nan}"

    def _sensitivity_lines(self) -> List[str]:
        layers = self.sensitive_layers()
        total = len(self.sensitive_layers(limit=None))
        threshold = _thresholds_text(self.analysis.get("error_threshold"))
        head = "most sensitive layers (relative model-output error"
        head += f"; risky above {threshold} or on overflow)" if threshold else ")"
        if not layers:
            return [head + ": the analysis has no results"]
        dtypes = list(self.analysis.get("candidates") or
                      dict.fromkeys(d for e in layers for d in e["errors"]))
        rows = [{"layer": e["name"] or "(model)", **{d: e["errors"].get(d) for d in dtypes},
                 "risky in": ", ".join(e["risky"]) or "-"} for e in layers]
        lines = [head + (f", {len(layers)} of {total}" if total > len(layers) else "") + ":"]
        lines.extend("  " + line for line in comparison_table(rows, ["layer", *dtypes, "risky in"]).splitlines())
        return lines

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        """Plain data (NaN and inf become None, as JSON has neither); ``stats`` is derived, for readers."""
        return _jsonable({
            "title": self.title,
            "history": self.history,
            "events": self.events,
            "policies": [[step, policy] for step, policy in self.policies],
            "analysis": self.analysis,
            "summary": self.summary,
            "stats": self.stats(),
            "tuning": self.tuning,
        })

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: Mapping) -> "TrainingReport":
        known = {"title", "history", "events", "policies", "analysis", "summary", "stats", "tuning"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown TrainingReport field(s): {', '.join(sorted(unknown))}")
        return cls(history=d.get("history"), events=d.get("events") or (), policies=d.get("policies") or (),
                   analysis=d.get("analysis"), summary=d.get("summary"),
                   title=d.get("title", "adaptive_amp training report"), tuning=d.get("tuning"))

    @classmethod
    def from_json(cls, text: str) -> "TrainingReport":
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ plots
    def plot_timeline(self, path: str) -> str:
        """One PNG over a shared step axis: an events strip (one row per kind, a mark per event), the loss,
        the loss scale (log) and skipped steps (cumulative) when the run scaled the loss or skipped a step,
        and the gradient norm (log); policy changes as dashed lines, labelled in the events strip."""
        Figure, FigureCanvasAgg = _matplotlib()
        h = self.history
        steps = h["step"]
        scaled = any(math.isfinite(v) and v > 0 for v in h["scale"])
        skipped = any(v > 0 for v in h["skipped_steps"])
        marker = "." if len(steps) < 50 else None  # a single step draws no line: show the points
        panels = [("loss", h["loss"], "linear", "loss", "no finite loss")]
        if scaled or skipped:
            panels.append(("scale", h["scale"], "log", "loss scale", "no loss scaling"))
            panels.append(("skipped_steps", [float(v) for v in h["skipped_steps"]], "linear", "skipped steps",
                           "no steps"))
        panels.append(("grad_norm", h["grad_norm"], "log", "grad norm", "grad norm not recorded"))
        groups = self.events_by_kind()
        changes = self.policy_changes()
        strip = bool(groups or changes)
        ratios = ([0.35 + 0.18 * max(1, len(groups))] if strip else []) + [1.0] * len(panels)
        fig = Figure(figsize=(11, 2.0 + 1.9 * len(panels) + (0.4 * len(groups) if strip else 0)),
                     constrained_layout=True)
        FigureCanvasAgg(fig)
        axes = list(fig.subplots(len(ratios), 1, sharex=True, gridspec_kw={"height_ratios": ratios}, squeeze=False)[:, 0])
        note = "" if scaled or skipped else " (no loss scaling: no scale or skipped-step panels)"
        fig.suptitle(self.title + note)
        event_ax, plot_axes = (axes[0], axes[1:]) if strip else (None, axes)
        for ax, (column, values, yscale, label, empty) in zip(plot_axes, panels):
            shown = [(st, v) for st, v in zip(steps, values) if math.isfinite(v) and (yscale == "linear" or v > 0)]
            ax.set_ylabel(label)
            if not shown:
                ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="gray")
                continue
            xs, ys = zip(*shown)
            if column in ("skipped_steps", "scale"):  # both change in jumps and hold between them
                ax.step(xs, ys, where="post", color="tab:red" if column == "skipped_steps" else "tab:blue",
                        marker=marker)
            else:
                ax.plot(xs, ys, color="tab:blue", linewidth=1, marker=marker)
            if yscale == "log":
                ax.set_yscale("log")
            if column == "loss":
                bad = [st for st, v in zip(steps, values) if not math.isfinite(v)]
                if bad:  # where the loss is missing from the line, say why
                    ax.plot(bad, [max(ys)] * len(bad), "x", color="black", label="non-finite loss")
                    ax.legend(loc="upper right", fontsize=7)
        axes[-1].set_xlabel("step")
        for c in changes:
            for ax in axes:
                ax.axvline(c["step"], color="black", linestyle="--", linewidth=1)
        if strip:
            # One row per kind: events at the same steps stay apart, whatever their number.
            colors = _kind_colors(groups)
            kinds = list(groups)
            for row, kind in enumerate(kinds):
                xs = sorted({e["step"] for e in groups[kind]})
                event_ax.plot(xs, [row] * len(xs), "|", color=colors[kind], markersize=10, markeredgewidth=2)
            event_ax.set_yticks(range(len(kinds)))
            event_ax.set_yticklabels([f"{k} ({len(groups[k])})" for k in kinds], fontsize=7)
            # Rows top-down; below them, when the policy changed, a row for the changes' labels.
            event_ax.set_ylim(len(kinds) - 0.4 + (1.0 if changes else 0), -0.6)
            event_ax.set_title("events (one row per kind) and policy changes (dashed)", fontsize=8, loc="left")
            # Labels of policy changes close together alternate between two heights instead of overlapping.
            span = (max(steps) - min(steps)) if steps else 1
            last_x, level = None, 0
            for c in changes:
                level = 1 - level if last_x is not None and c["step"] - last_x < 0.15 * max(span, 1) else 0
                event_ax.annotate(f"step {c['step']}: {c['diff']}", xy=(c["step"], len(kinds) + 0.4 * level),
                                  fontsize=7, va="center", xytext=(3, 0), textcoords="offset points")
                last_x = c["step"]
        if self.policies:
            axes[-1].annotate(f"policy at step {self.policies[0][0]}: {self.policies[0][1]}", xy=(0, -0.45),
                              xycoords="axes fraction", fontsize=7, va="top")
        _save(fig, path)
        return path

    def plot_sensitivity(self, path: str, max_layers: int = 40) -> str:
        """One PNG: per layer, bars of the relative model-output error in each candidate format (log scale),
        risky layers' names in red, the analysis threshold as a dashed line. Needs an analysis."""
        if not self.analysis or not self.analysis.get("results"):
            raise ValueError("this report has no precision analysis to plot; pass analysis= "
                             "(PrecisionAnalyzer().analyze(...) or its to_dict()) when making the report")
        Figure, FigureCanvasAgg = _matplotlib()
        layers = self.sensitive_layers(limit=max_layers)
        dtypes = list(self.analysis.get("candidates") or dict.fromkeys(d for e in layers for d in e["errors"]))
        finite = [v for e in layers for v in e["errors"].values() if math.isfinite(v) and v > 0]
        floor = min(finite) / 10 if finite else 1e-8
        ceiling = max(finite) * 10 if finite else 1.0  # where a non-finite error is drawn
        fig = Figure(figsize=(max(6, 0.6 * len(layers) * len(dtypes) ** 0.5 + 2) + 2.5, 5), constrained_layout=True)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        width = 0.8 / max(1, len(dtypes))
        colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown"]
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        legend = []
        for j, dtype in enumerate(dtypes):
            xs, heights, hatches, edges = [], [], [], []
            for i, e in enumerate(layers):
                err = e["errors"].get(dtype)
                if err is None or math.isnan(err):
                    continue
                xs.append(i + (j - (len(dtypes) - 1) / 2) * width)
                heights.append(ceiling if math.isinf(err) else max(err, floor))
                hatches.append("//" if math.isinf(err) else "")  # an overflowing layer: its error is not finite
                edges.append("red" if dtype in e["risky"] else "none")
            color = colors[j % len(colors)]
            bars = ax.bar(xs, heights, width=width, color=color, edgecolor=edges, linewidth=1.5)
            for bar, hatch in zip(bars, hatches):
                bar.set_hatch(hatch)
            legend.append(Patch(facecolor=color, label=dtype))
        threshold = self.analysis.get("error_threshold")
        by_value = {}
        for fmt, t in (threshold.items() if isinstance(threshold, dict) else [("", threshold)] if threshold else []):
            if not dtypes or not fmt or fmt in dtypes:
                by_value.setdefault(float(t), []).append(fmt)
        styles = ["--", ":", "-.", (0, (5, 1, 1, 1))]
        for k, (t, fmts) in enumerate(sorted(by_value.items())):
            # A threshold of one format takes that format's colour; each threshold its own dash pattern.
            own = [f for f in fmts if f in dtypes]
            color = colors[dtypes.index(own[0]) % len(colors)] if len(own) == 1 else "red"
            ax.axhline(t, color=color, linestyle=styles[k % len(styles)], linewidth=1.5)
            label = f"risky above {t:g}" + (f" ({', '.join(f for f in fmts if f)})" if any(fmts) else "")
            legend.append(Line2D([], [], color=color, linestyle=styles[k % len(styles)], linewidth=1.5, label=label))
        ax.set_yscale("log")
        ax.set_xticks(range(len(layers)))
        ax.set_xticklabels([e["name"] or "(model)" for e in layers], rotation=60, ha="right", fontsize=7)
        for tick, e in zip(ax.get_xticklabels(), layers):
            if e["risky"]:
                tick.set_color("red")
                tick.set_fontweight("bold")
        ax.set_ylabel("relative model-output error")
        total = len(self.sensitive_layers(limit=None))
        # A short title (a long one is cut on a narrow figure); the key is in the legend, beside the bars.
        ax.set_title("layer sensitivity by format" + (f" ({len(layers)} of {total} layers)" if total > len(layers)
                                                      else ""), fontsize=10)
        legend.append(Patch(facecolor="white", edgecolor="red", linewidth=1.5, label="risky (red edge and name)"))
        legend.append(Patch(facecolor="white", edgecolor="gray", hatch="//", label="not finite (overflow)"))
        ax.legend(handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        _save(fig, path)
        return path

    # ------------------------------------------------------------------ files
    def save(self, directory: str, plots: bool = True) -> Dict[str, str]:
        """Write report.txt, report.json and (with plots, when matplotlib is installed) timeline.png and,
        with an analysis, sensitivity.png, with a TuneResult, tune.png into `directory`. Returns {"text", "json",
        "timeline", "sensitivity", "tuning"} -> path for the files written."""
        os.makedirs(directory, exist_ok=True)
        written = {}
        written["text"] = os.path.join(directory, "report.txt")
        with open(written["text"], "w") as f:
            f.write(self.text() + "\n")
        written["json"] = os.path.join(directory, "report.json")
        with open(written["json"], "w") as f:
            f.write(self.to_json() + "\n")
        if plots:
            try:
                written["timeline"] = self.plot_timeline(os.path.join(directory, "timeline.png"))
                if self.analysis and self.analysis.get("results"):
                    written["sensitivity"] = self.plot_sensitivity(os.path.join(directory, "sensitivity.png"))
                if self._tune_result is not None:
                    written["tuning"] = self._tune_result.plot(os.path.join(directory, "tune.png"))
            except ImportError as exc:
                warnings.warn(f"report plots not written: {exc}", stacklevel=2)
        return written


# ---------------------------------------------------------------------- recipes side by side


def _positive(scales) -> bool:
    """Whether a run's per-step loss scales hold any finite positive value (it scaled its loss)."""
    return any(math.isfinite(float(v)) and float(v) > 0 for v in scales)


def plot_recipes(runs: Mapping[str, Mapping[str, Sequence]], path: str, title: str = "recipes side by side",
                 notes: Sequence[str] = ()) -> str:
    """One PNG comparing training runs (e.g. fp32, torch AMP, adaptive_amp on the same data), 2 x 2 panels:
    loss per step (a moving average over 2% of the steps drawn over the raw values), loss scale (log),
    skipped steps (cumulative), and step time (median with the interquartile range of its timing rounds).
    When no run scaled its loss or skipped a step (bf16 recipes), only the loss and step-time panels, side by
    side: the other two would be empty.

    Args:
        runs: label -> {"losses": per-step losses, "scales": per-step loss scale (empty without loss
            scaling), "skipped_at": steps whose update was skipped, "step_times": ms per step, one per
            timing round (may be empty)}. Keep labels short: they name the curves and the bars.
        path: the PNG to write.
        notes: lines printed under the panels (e.g. each recipe's full policy).
    """
    Figure, FigureCanvasAgg = _matplotlib()
    scaling = any(_positive(run.get("scales", ())) or run.get("skipped_at") for run in runs.values())
    fig = Figure(figsize=(12, (7.5 if scaling else 4.2) + 0.2 * len(notes)), constrained_layout=True)
    FigureCanvasAgg(fig)
    if scaling:
        (ax_loss, ax_scale), (ax_skip, ax_time) = fig.subplots(2, 2)
    else:
        (ax_loss, ax_time), ax_scale, ax_skip = fig.subplots(1, 2), None, None
        notes = [*notes, "no run scaled its loss or skipped a step (no loss-scale or skipped-step panels)"]
    fig.suptitle(title)
    colors = ["tab:gray", "tab:orange", "tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
    unscaled, lossless = [], []
    for k, (label, run) in enumerate(runs.items()):
        color = colors[k % len(colors)]
        losses = [float(v) for v in run.get("losses", [])]
        steps = list(range(len(losses)))
        finite = [(st, v) for st, v in zip(steps, losses) if math.isfinite(v)]
        if finite:
            xs, ys = zip(*finite)
            ax_loss.plot(xs, ys, color=color, alpha=0.25, linewidth=0.6)
            window = max(1, len(ys) // 50)
            smooth = [sum(ys[max(0, i - window + 1):i + 1]) / len(ys[max(0, i - window + 1):i + 1])
                      for i in range(len(ys))]
            ax_loss.plot(xs, smooth, color=color, linewidth=1.5, label=label)
        else:
            lossless.append(label)
        scales = [float(v) for v in run.get("scales", [])]
        shown = [(st, v) for st, v in enumerate(scales) if math.isfinite(v) and v > 0]
        if shown:  # (then `scaling`, so the panel is there)
            xs, ys = zip(*shown)
            ax_scale.step(xs, ys, where="post", color=color, label=label)
        else:
            unscaled.append(label)
        skipped = sorted(int(v) for v in run.get("skipped_at", []))
        total = max(len(losses), (skipped[-1] + 1) if skipped else 0)
        counts, i = [], 0
        for st in range(total):
            while i < len(skipped) and skipped[i] <= st:
                i += 1
            counts.append(i)
        if total and scaling:
            ax_skip.step(range(total), counts, where="post", color=color, label=f"{label} ({len(skipped)})")
        times = [float(v) for v in run.get("step_times", []) if math.isfinite(v)]
        if times:
            med = _median(times)
            if len(times) >= 4:
                ordered = sorted(times)
                lo, hi = ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]
            else:
                lo, hi = min(times), max(times)
            ax_time.bar(k, med, color=color, yerr=[[med - lo], [hi - med]], capsize=4)
            ax_time.annotate(f"{med:.2f}", xy=(k, hi), ha="center", va="bottom", fontsize=8,
                             xytext=(0, 3), textcoords="offset points")
    ax_loss.set_title("training loss (faint: per step; line: moving average)", fontsize=9)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    if ax_loss.lines:
        ax_loss.legend(fontsize=8)
    if lossless:
        ax_loss.text(0.02, 0.04, "no finite loss: " + ", ".join(lossless), transform=ax_loss.transAxes, fontsize=8,
                     color="gray")
    if scaling:
        ax_scale.set_title("loss scale", fontsize=9)
        ax_scale.set_xlabel("step")
        if ax_scale.lines:
            ax_scale.set_yscale("log")
            ax_scale.legend(fontsize=8)
        if unscaled:
            ax_scale.text(0.02, 0.04, "no loss scaling: " + ", ".join(unscaled), transform=ax_scale.transAxes,
                          fontsize=8, color="gray")
        ax_skip.set_title("skipped steps (cumulative; total in the legend)", fontsize=9)
        ax_skip.set_xlabel("step")
        most = max((len(run.get("skipped_at", [])) for run in runs.values()), default=0)
        ax_skip.set_ylim(0, max(1, most) * 1.05)  # a flat zero line sits on the axis, not mid-panel
        if not most:
            ax_skip.text(0.5, 0.5, "no run skipped a step", transform=ax_skip.transAxes, ha="center", color="gray")
        if ax_skip.lines:
            ax_skip.legend(fontsize=8)
    ax_time.set_title("step time: median and interquartile range of the timing rounds", fontsize=9)
    ax_time.set_xticks(range(len(runs)))
    ax_time.set_xticklabels(list(runs), fontsize=8)
    ax_time.set_ylabel("ms per step")
    if not ax_time.patches:
        ax_time.text(0.5, 0.5, "not timed", transform=ax_time.transAxes, ha="center", color="gray")
    if notes:
        fig.supxlabel("\n".join(notes), fontsize=8, ha="left", x=0.01)
    _save(fig, path)
    return path


# ---------------------------------------------------------------------- tables


#: Summary keys shown under a clearer name (the monitor's figures cover its recent window only).
_SUMMARY_LABELS = {"loss_trend": "recent loss slope per step", "loss_variance": "recent loss variance"}


def _repeats(key: str, value, stats: dict, policies) -> bool:
    """Whether a summary entry only repeats a line the report already prints (steps, the final policy)."""
    if key == "steps":
        return stats["steps"] and value == stats["last_step"] + 1 or value == stats["steps"]
    if key == "policy":
        return bool(policies) and str(value) == policies[-1][1]
    return False


def comparison_table(rows: Sequence[Mapping[str, Any]], columns: Optional[Sequence[str]] = None) -> str:
    """An aligned text table of `rows` (dicts), e.g. one per run: ``run``, ``final_loss``, ``step_time_ms``...

    columns: the columns in order (default: every key, in order of first appearance). Text is left-aligned,
    numbers right-aligned with 4 significant digits; a missing value is blank, None is "-".
    """
    rows = list(rows)
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"rows[{i}] is a {type(row).__name__}; pass one dict per row")
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    columns = [str(c) for c in columns]
    if not columns:
        return "(no rows)"
    missing = object()
    cells = [[_cell(row.get(c, missing), missing) for c in columns] for row in rows]
    numeric = [all(_is_number(row.get(c)) for row in rows if row.get(c) is not None) and
               any(row.get(c) is not None for row in rows) for c in columns]
    widths = [max([len(c)] + [len(r[j]) for r in cells]) for j, c in enumerate(columns)]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(columns), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def policy_diff(old: str, new: str) -> str:
    """What changed between two policy strings, field by field: ``compute: float16 -> bfloat16``,
    ``+islands=lm_head``, ``-tf32``."""
    a, b = _policy_fields(old), _policy_fields(new)
    parts = []
    for key in dict.fromkeys([*a, *b]):
        if key not in a:
            parts.append(f"+{key}={b[key]}")
        elif key not in b:
            parts.append(f"-{key}")
        elif a[key] != b[key]:
            parts.append(f"{key}: {a[key]} -> {b[key]}")
    return ", ".join(parts) or "no change"


def _policy_fields(policy: str) -> Dict[str, str]:
    fields = {}
    for item in str(policy).replace(" ", "").split(","):
        key, _, value = item.partition("=")
        if key:
            fields[key] = value
    return fields


# ---------------------------------------------------------------------- input checks


def _check_history(history: Mapping[str, Sequence]) -> Dict[str, list]:
    if not isinstance(history, Mapping):
        raise TypeError(f"history is a {type(history).__name__}; pass a dict of per-step lists "
                        f"({', '.join(HISTORY_COLUMNS)})")
    lengths = {k: len(v) for k, v in history.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError("history columns differ in length: "
                         + ", ".join(f"{k}={n}" for k, n in lengths.items()) + "; record one entry per step in each")
    n = next(iter(lengths.values()), 0)
    out = {}
    for key, values in history.items():
        values = list(values)
        if key in _FLOAT_COLUMNS:
            values = [_float(v, f"history[{key!r}]") for v in values]
        elif key in ("step", "found_inf", "skipped_steps"):
            values = [_int(v, f"history[{key!r}]") for v in values]
        out[key] = values
    out.setdefault("step", list(range(n)))
    for key in _FLOAT_COLUMNS:
        out.setdefault(key, [math.nan] * n)
    out.setdefault("found_inf", [0] * n)
    if "skipped_steps" not in out:  # every overflowing step is skipped
        total, cumulative = 0, []
        for v in out["found_inf"]:
            total += bool(v)
            cumulative.append(total)
        out["skipped_steps"] = cumulative
    return {k: out[k] for k in (*HISTORY_COLUMNS, *(k for k in out if k not in HISTORY_COLUMNS))}


def _check_event(event: Mapping, i: int) -> dict:
    if not isinstance(event, Mapping):
        raise TypeError(f"events[{i}] is a {type(event).__name__}; pass a dict with step, kind, layer, message, data")
    for key in ("step", "kind"):
        if key not in event:
            raise ValueError(f"events[{i}] has no {key!r}; every event needs a step and a kind")
    unknown = set(event) - {"step", "kind", "layer", "message", "data"}
    if unknown:
        raise ValueError(f"events[{i}] has unknown key(s) {', '.join(sorted(unknown))}; "
                         "put extra values in its 'data' dict")
    layer = event.get("layer")
    return {"step": _int(event["step"], f"events[{i}]['step']"), "kind": str(event["kind"]),
            "layer": None if layer is None else str(layer), "message": str(event.get("message") or ""),
            "data": dict(event.get("data") or {})}


def _check_policies(policies) -> List[Tuple[int, str]]:
    out = []
    for i, item in enumerate(policies):
        try:
            step, policy = item
        except (TypeError, ValueError):
            raise ValueError(f"policies[{i}] is {item!r}; pass (step, policy) pairs") from None
        out.append((_int(step, f"policies[{i}] step"), str(policy)))
    return sorted(out, key=lambda p: p[0])


def _float(v, what: str) -> float:
    if v is None:  # JSON's stand-in for NaN
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{what} holds {v!r}; expected numbers (NaN or None where unknown)") from None


def _int(v, what: str) -> int:
    if isinstance(v, float) and not v.is_integer():
        raise ValueError(f"{what} holds {v!r}; expected a whole number")
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        raise TypeError(f"{what} holds {v!r}; expected an int") from None


# ---------------------------------------------------------------------- small helpers


def _finite(values) -> List[float]:
    return [v for v in values if math.isfinite(v)]


def _mean(values) -> Optional[float]:
    finite = _finite(values)
    return sum(finite) / len(finite) if finite else None


def _median(values: List[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _sort_key(v: float) -> float:
    return -math.inf if math.isnan(v) else v


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)  # numpy's scalars register as Real


def _fmt(v) -> str:
    """A number with 4 significant digits (whole numbers, e.g. loss scales, and anything from 10,000 up, e.g.
    memory in MiB or tokens/s, as a whole number: more readable than 2.784e+04); anything else as str()."""
    if v is None:
        return "-"
    if not _is_number(v):
        return str(v)
    if isinstance(v, numbers.Integral):
        return str(int(v))
    v = float(v)
    if not math.isfinite(v):
        return str(v)
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    if 1e4 <= abs(v) < 1e15:
        return f"{v:.0f}"
    if 1e-3 <= abs(v):
        return f"{v:.4g}"  # (at 10,000 and over, .4g would switch to an exponent)
    return f"{v:.3e}"


def _cell(v, missing) -> str:
    if v is missing:
        return ""
    return _fmt(v)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _jsonable(value):
    """`value` with NaN/inf as None, tuples as lists, numpy scalars as numbers, other objects as str."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if _is_number(value):  # numpy scalars
        return _jsonable(value.item() if hasattr(value, "item") else float(value))
    if callable(getattr(value, "tolist", None)):  # numpy arrays, torch tensors
        try:
            return _jsonable(value.tolist())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


# ---------------------------------------------------------------------- matplotlib


def _matplotlib():
    """matplotlib's Figure and Agg canvas: drawing through them leaves pyplot and its backend alone."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(PLOT_HINT) from exc
    return Figure, FigureCanvasAgg


def _kind_colors(groups: Mapping[str, list]) -> Dict[str, str]:
    # Fixed colours for the kinds the monitor emits, so the same kind looks the same in every report.
    fixed = {"loss_spike": "tab:orange", "nan_loss": "black", "overflow_rate": "tab:red",
             "scale_collapse": "darkred", "grad_norm_anomaly": "tab:purple", "underflow_rising": "tab:brown",
             "promote": "tab:green", "switch_compute": "tab:cyan", "demote": "tab:olive"}
    spare = iter(["tab:pink", "tab:gray", "gold", "navy", "teal", "magenta", "lime", "salmon"] * 10)
    return {kind: fixed.get(kind) or next(spare) for kind in groups}


def _legend_line(label: str):
    from matplotlib.lines import Line2D

    return Line2D([], [], color="black", linestyle="--", linewidth=1, label=label)


def _thresholds_text(threshold) -> str:
    """An analysis' error threshold(s) as text: one number, or "0.02 (float16, bfloat16), 0.1 (...)"."""
    if threshold is None:
        return ""
    if not isinstance(threshold, dict):
        return _fmt(threshold)
    by_value = {}
    for fmt, t in threshold.items():
        by_value.setdefault(float(t), []).append(fmt)
    if len(by_value) == 1:
        return _fmt(next(iter(by_value)))
    return ", ".join(f"{_fmt(t)} ({', '.join(fmts)})" for t, fmts in sorted(by_value.items()))


def _save(fig, path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with warnings.catch_warnings():
        # matplotlib's tick finder warns on axes whose data are all NaN/inf (a run that never had a finite loss)
        warnings.simplefilter("ignore", RuntimeWarning)
        fig.savefig(path, dpi=100)
