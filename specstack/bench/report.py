"""Outputs rebuilt from every record in ``results.jsonl``: ``results.csv``, ``report.md`` and plots.

Tables aggregate the runs of one configuration over seeds (means). A plot is drawn only when its
x axis has more than one value among the successful runs; the report says why one is missing.
matplotlib is imported lazily, through its object-oriented API (no pyplot, no global backend).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import attrs

from ..speedup import turns_range
from .grid import label

SCALARS = (
    "id", "status", "label", "stack", "task", "context_length", "temperature", "top_p", "top_k", "seed", "max_new_tokens",
    "dtype", "device", "draft_device", "cuda_graphs", "stop_at_eos", "model", "baseline", "new_tokens", "decode_seconds",
    "prefill_seconds", "total_seconds", "timing",
    "tokens_per_second", "decode_tokens_per_second", "speedup", "identical_to_baseline", "accuracy", "peak_rss_mb", "peak_cuda_mb", "error", "error_kind",
    "git_revision", "group",
)
LEGEND_ROWS = 24  # legend entries per column under a plot
FACET_COLUMNS = 4  # a plot's facets side by side before the next row of them
LEVEL_FIELDS = ("name", "rounds", "drafted", "accepted", "rejected", "acceptance_rate", "token_acceptance_rate", "mean_accepted_per_round",
                "forward_calls", "forward_seconds", "bookkeeping_seconds", "gathers", "gather_seconds")


# -- records ------------------------------------------------------------------------------------


def ok(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if r.get("status") == "ok"]


def task_label(record: dict) -> str:
    return label(record["task"], record.get("task_options") or {})


def config_key(record: dict) -> tuple:
    """What a table row aggregates over seeds."""
    return (record["label"], task_label(record), record["context_length"], record["temperature"], record["top_p"], record["top_k"],
            record["max_new_tokens"], record["dtype"], record["model"], placement(record), record.get("coupled", False))


def one_text(record: dict) -> bool:
    """Whether a run's text is its baseline's (greedy, or coupled sampling by a stack that couples, whose identity the
    runner asked): the report shows the identity."""
    return record["temperature"] == 0 or (record.get("coupled", False) and record.get("identical_to_baseline") is not None)


def placement(record: dict) -> str:
    """Where a run ran: ``cpu``, ``cuda``, ``cuda:0, draft on cpu``, ``cuda, no CUDA graphs``
    (records from before these keys ran on the CPU)."""
    device = record.get("device") or "cpu"
    draft = record.get("draft_device")
    parts = [device, *([f"draft on {draft}"] if draft not in (None, device) else [])]
    if record.get("cuda_graphs") is False and any(str(d).startswith("cuda") for d in (device, draft)):
        parts.append("no CUDA graphs")
    if record.get("widen_bf16"):
        parts.append("bf16 widened")
    return ", ".join(parts)


def verifying_levels(record: dict) -> list[dict]:
    """The levels that verified drafts (their counters are of the drafts offered to them by the level below)."""
    return [level for level in record.get("levels") or () if level["rounds"]]


def _mean(values: Iterable[Any]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.fmean(values) if values else None


# -- CSV ----------------------------------------------------------------------------------------


def flatten(record: dict) -> dict[str, Any]:
    row = {key: record.get(key) for key in SCALARS if key in record}
    row["task"] = task_label(record)
    row.update({f"option_{k}": v for k, v in sorted((record.get("options") or {}).items())})
    row.update({f"task_{k}": v for k, v in sorted((record.get("task_info") or {}).items())})
    row.update({k: v for k, v in (record.get("time_split") or {}).items()})
    for index, level in enumerate(record.get("levels") or ()):
        row.update({f"level{index}_{field}": level.get(field) for field in LEVEL_FIELDS})
    row.update({f"env_{k}": v for k, v in (record.get("environment") or {}).items() if k != "git_revision"})
    return row


def write_csv(records: Sequence[dict], path: Path) -> None:
    rows = [flatten(r) for r in records]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


# -- Markdown -----------------------------------------------------------------------------------

TIMING_NOTE = (
    "Speedup = the baseline's seconds per new token / this run's, both measured in the same process on the same "
    "prompt, seed and sampling. specstack stacks and `llama-cpp` are timed on decoding (prefill excluded) against `autoregressive`; "
    "the transformers baselines (`hf-*`) on the whole `generate()` call (prefill included) against `hf-generate`. "
    "Decode tokens/s leaves the prefill out of every kind of run (for `hf-*`, everything from the first committed round on): "
    "the one column that compares them all. "
    "Acceptance of a level = drafted tokens it accepted / drafted tokens it was offered by the level below."
)


def summary_rows(records: Sequence[dict]) -> list[dict]:
    """One row per configuration: means over its successful runs (seeds)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in ok(records):
        groups[config_key(record)].append(record)
    return [_summary(runs) for runs in groups.values()]


def _summary(runs: list[dict]) -> dict:
    first = runs[0]
    names = [level["name"] for level in verifying_levels(first)]
    per_level = {name: [lv for r in runs for lv in verifying_levels(r) if lv["name"] == name] for name in names}
    identical = [r["identical_to_baseline"] for r in runs if r.get("identical_to_baseline") is not None]
    return {
        "stack": first["label"], "task": task_label(first), "context": first["context_length"], "temperature": first["temperature"],
        "runs": len(runs), "baseline": first.get("baseline"), "timing": first.get("timing"), "device": placement(first),
        "acceptance": {n: _mean(lv["acceptance_rate"] for lv in levels) for n, levels in per_level.items()},
        "accepted_per_round": {n: _mean(lv["mean_accepted_per_round"] for lv in levels) for n, levels in per_level.items()},
        "tokens_per_second": _mean(r.get("tokens_per_second") for r in runs),
        "decode_tokens_per_second": _mean(r.get("decode_tokens_per_second") for r in runs),
        "total_seconds": _mean(r.get("total_seconds") for r in runs),
        "speedup": _mean(r.get("speedup") for r in runs),
        "speedup_range": turns_range(s for r in runs for s in r.get("speedups") or ()),
        "accuracy": _mean(r.get("accuracy") for r in runs),
        "peak_cuda_mb": _mean(r.get("peak_cuda_mb") for r in runs),
        "identical": (all(identical) if identical else None) if one_text(first) else None,
        "one_text": one_text(first), "coupled": first.get("coupled", False),
    }


def _speedup_cell(row: dict) -> str:
    """The speedup, and after it the range of its turns where it had several: ``1.21× (1.12-1.30)``."""
    spread = row["speedup_range"]
    return _fmt(row["speedup"], 2, "×") + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")


def _fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.{digits}f}{suffix}" if isinstance(value, float) else str(value)


def _levels(values: dict[str, float | None], digits: int) -> str:
    return "<br>".join(f"{name} {_fmt(v, digits)}" for name, v in values.items())


def summary_markdown(records: Sequence[dict]) -> str:
    """The results table; a ``device`` column when runs ran in more than one place, a ``peak CUDA MiB``
    column when some run ran on CUDA."""
    rows = summary_rows(records)
    devices = len({row["device"] for row in rows}) > 1
    cuda = any(row["peak_cuda_mb"] is not None for row in rows)
    header = ["stack", "task", "context", "T", *(["device"] * devices), "runs", "acceptance per level", "accepted/round", "tokens/s",
              "decode tokens/s", "total s", "speedup", "vs (timing)", "accuracy", "identical", *(["peak CUDA MiB"] * cuda)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [
            f"`{row['stack']}`", row["task"], str(row["context"]), _fmt(row["temperature"], 2) + (" coupled" if row["coupled"] else ""),
            *([row["device"]] * devices), str(row["runs"]),
            _levels(row["acceptance"], 3), _levels(row["accepted_per_round"], 2), _fmt(row["tokens_per_second"]),
            _fmt(row["decode_tokens_per_second"]), _fmt(row["total_seconds"]), _speedup_cell(row), f"{row['baseline']} ({row['timing']})",
            _fmt(row["accuracy"]), _fmt(row["identical"]) if row["one_text"] else "(sampled)",
            *([_fmt(row["peak_cuda_mb"], 0)] * cuda),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def errors_markdown(records: Sequence[dict]) -> str:
    failed = [r for r in records if r.get("status") != "ok"]
    if not failed:
        return "No run failed."
    lines = ["| stack | task | context | T | seed | error |", "|---|---|---|---|---|---|"]
    for r in failed:
        error = str(r.get("error", "")).replace("|", "\\|")
        lines.append(f"| `{r['label']}` | {task_label(r)} | {r['context_length']} | {r['temperature']} | {r['seed']} | {error} |")
    return "\n".join(lines)


DRIFT_NOTED = 0.1  # a baseline whose speed at its group's end differs from its first by more than this is listed


def drift_markdown(records: Sequence[dict]) -> str:
    """The groups whose baseline, measured again at the group's end (``baseline_again``), ran at another speed."""
    checked = [r for r in ok(records) if r.get("baseline_again")]
    moved = [r for r in checked if abs(r["baseline_again"]["drift"] - 1) > DRIFT_NOTED]
    if not moved:
        return f"{len(checked)} groups' baselines measured again at the group's end; none moved by more than {DRIFT_NOTED:.0%}."
    lines = [f"{len(checked)} groups' baselines measured again at the group's end; {len(moved)} moved by more than {DRIFT_NOTED:.0%}, "
             "so their speedups carry about that much of the host's noise:", "",
             "| baseline | task | context | T | seed | decode tokens/s first | at the end | drift |", "|---|---|---|---|---|---|---|---|"]
    for r in moved:
        again = r["baseline_again"]
        lines.append(f"| `{r['label']}` | {task_label(r)} | {r['context_length']} | {r['temperature']} | {r['seed']} | "
                     f"{_fmt(r['decode_tokens_per_second'])} | {_fmt(again['decode_tokens_per_second'])} | {again['drift']:.2f} |")
    return "\n".join(lines)


def environment_markdown(records: Sequence[dict]) -> str:
    seen = list(dict.fromkeys(json.dumps(r.get("environment") or {}, sort_keys=True) for r in records))
    lines = []
    for text in seen:
        env = json.loads(text)
        lines.append("- " + ", ".join(f"{k} {v}" for k, v in env.items()))
    return "\n".join(lines) or "- (no records)"


def write_report(records: Sequence[dict], path: Path, plots: Sequence[tuple[str, str | None, str]]) -> None:
    n_ok = len(ok(records))
    parts = [
        "# specstack bench report", "",
        f"{len(records)} runs in `results.jsonl`: {n_ok} ok, {len(records) - n_ok} failed.", "",
        TIMING_NOTE, "",
        "## Results (means over seeds)", "", summary_markdown(records), "",
        "## Failed runs", "", errors_markdown(records), "",
        "## Baseline drift", "", drift_markdown(records), "",
        "## Plots", "", *[_plot_line(*plot) for plot in plots], "",
        "## Environment", "", environment_markdown(records), "",
    ]
    path.write_text("\n".join(parts), encoding="utf-8")


def _plot_line(title: str, file: str | None, reason: str) -> str:
    return f"![{title}]({file})" if file else f"- {title}: not drawn; {reason}."


# -- plots --------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Panel:
    """One y metric: ``values(record)`` gives ``(series suffix, value)`` pairs."""

    title: str
    values: Callable[[dict], list[tuple[str, float]]]


def _acceptance(record: dict) -> list[tuple[str, float]]:
    """Each verifying level's acceptance; none for a level offered no drafts (a tuned γ of 0 below it: no rate)."""
    return [(level["name"], level["acceptance_rate"]) for level in verifying_levels(record) if level["acceptance_rate"] is not None]


def _speedup(record: dict) -> list[tuple[str, float]]:
    return [("", record["speedup"])] if isinstance(record.get("speedup"), (int, float)) else []


ACCEPTANCE = Panel(title="acceptance rate", values=_acceptance)
SPEEDUP = Panel(title="speedup", values=_speedup)


@attrs.frozen(kw_only=True)
class Plot:
    """Metrics against one varying quantity: a record field or a stack option."""

    file: str
    title: str
    x_label: str
    field: str | None = None
    option: str | None = None
    panels: tuple[Panel, ...]

    def x(self, record: dict) -> Any:
        if self.option is not None:
            return (record.get("options") or {}).get(self.option)
        return record.get(self.field)

    def series(self, record: dict) -> dict[str, Any]:
        """What identifies a line: everything the table rows key on except x (and the seed)."""
        options = {k: v for k, v in (record.get("options") or {}).items() if k != self.option}
        parts = {"stack": label(record["stack"], options), "task": task_label(record), "ctx": record["context_length"], "T": record["temperature"]}
        return {k: v for k, v in parts.items() if k != {"context_length": "ctx", "temperature": "T"}.get(self.field)}


PLOTS = (
    Plot(file="speedup_vs_context_length.png", title="speedup vs context length", x_label="context length (tokens)",
         field="context_length", panels=(SPEEDUP,)),
    Plot(file="acceptance_vs_context_length.png", title="acceptance vs context length", x_label="context length (tokens)",
         field="context_length", panels=(ACCEPTANCE,)),
    Plot(file="speedup_vs_temperature.png", title="speedup vs temperature", x_label="temperature", field="temperature", panels=(SPEEDUP,)),
    Plot(file="budget_ablation.png", title="budget ablation", x_label="retrieval budget (tokens)", option="budget", panels=(SPEEDUP, ACCEPTANCE)),
    Plot(file="chunk_size_ablation.png", title="chunk-size ablation", x_label="chunk size (tokens)", option="chunk_size", panels=(SPEEDUP, ACCEPTANCE)),
)


def draw_plots(records: Sequence[dict], out: Path) -> list[tuple[str, str | None, str]]:
    """Draw every plot whose axis varies; ``(title, file or None, why not)`` for the report."""
    done = []
    for plot in PLOTS:
        runs = [r for r in ok(records) if plot.x(r) is not None]
        xs = sorted({plot.x(r) for r in runs})
        if len(xs) < 2:
            done.append((plot.title, None, _why_not(plot, xs)))
            continue
        try:
            figure = _figure(plot, runs)
            if figure is None:
                done.append((plot.title, None, "matplotlib is not installed (pip install matplotlib)"))
                continue
            figure.savefig(out / plot.file, dpi=100)
        except Exception as error:  # a plot only shows the records: its fault must not cost the grid its report, which names it
            done.append((plot.title, None, f"drawing it failed ({type(error).__name__}: {error})"))
            continue
        done.append((plot.title, plot.file, ""))
    return done


def _why_not(plot: Plot, xs: list) -> str:
    what = plot.x_label.split(" (")[0]
    return f"only one {what} ({xs[0]})" if xs else f"no successful run has a {what}"


def _figure(plot: Plot, runs: list[dict]):
    """One axes per facet (:func:`_facets`) and metric, a line per stack in each, a stack's colour the same in every
    axes, one legend under them all."""
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
    except ImportError:
        return None
    facets = _facets(plot, runs)
    lines = [[_lines(plot, panel, group) for panel in plot.panels] for _, group in facets]  # [facet][panel]: name -> points
    names = sorted({name for facet in lines for panel_lines in facet for name in panel_lines})
    palette = colormaps["tab10" if len(names) <= 10 else "tab20"]
    colours = {name: palette(i % palette.N) for i, name in enumerate(names)}
    across = min(len(facets), FACET_COLUMNS)
    down = math.ceil(len(facets) / across) * len(plot.panels)
    legend_columns = max(1, math.ceil(len(names) / LEGEND_ROWS))
    figure = Figure(figsize=(max(6.4, 4.2 * across), 3.4 * down + 0.6 + 0.2 * math.ceil(len(names) / legend_columns)), layout="constrained")
    axes = figure.subplots(down, across, squeeze=False)  # [facet row * panels + panel][facet column]
    handles = {}
    for f, ((title, _), facet_lines) in enumerate(zip(facets, lines)):
        for p, (panel, panel_lines) in enumerate(zip(plot.panels, facet_lines)):
            ax = axes[(f // across) * len(plot.panels) + p][f % across]
            for name, points in panel_lines.items():
                handles[name], = ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name, color=colours[name])
            ax.set(xlabel=plot.x_label, ylabel=panel.title, title=title)
            ax.grid(alpha=0.3)
    for f in range(len(facets), math.ceil(len(facets) / across) * across):  # the last row's empty places
        for p in range(len(plot.panels)):
            axes[(f // across) * len(plot.panels) + p][f % across].set_axis_off()
    if handles:
        figure.legend([handles[name] for name in names], names, loc="outside lower center", ncols=legend_columns, fontsize="x-small", frameon=False)
    figure.suptitle(plot.title)
    return figure


def _facets(plot: Plot, runs: list[dict]) -> list[tuple[str, list[dict]]]:
    """The runs split by each part of their series but the stack that differs between them (task, temperature, context
    length: TriForce's Figure 1 draws a panel per text), each group titled by those parts, in their order."""
    series = [plot.series(r) for r in runs]
    varying = [k for k in _varying(series) if k != "stack"]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record, parts in zip(runs, series):
        groups[tuple(parts[k] for k in varying)].append(record)

    def title(key: tuple) -> str:
        return ", ".join(f"{value}" if k == "task" else f"{k}={value}" for k, value in zip(varying, key))

    return [(title(key), groups[key]) for key in sorted(groups)]


def _varying(series: list[dict[str, Any]]) -> list[str]:
    """The parts of the runs' series (:meth:`Plot.series`) that differ between them, in the series' order."""
    return [k for k in (series[0] if series else {}) if len({str(s[k]) for s in series}) > 1]


def _lines(plot: Plot, panel: Panel, runs: list[dict]) -> dict[str, list[tuple[Any, float]]]:
    """Series name -> [(x, mean y)], the name showing only the parts that differ between series."""
    series = [plot.series(r) for r in runs]
    varying = _varying(series) or ["stack"]
    values: dict[str, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record, parts in zip(runs, series):
        name = " ".join(f"{parts[k]}" if k == "stack" else f"{k}={parts[k]}" for k in varying)
        for suffix, y in panel.values(record):
            values[f"{name} {suffix}".strip()][plot.x(record)].append(y)
    return {name: sorted((x, statistics.fmean(ys)) for x, ys in by_x.items()) for name, by_x in values.items()}
