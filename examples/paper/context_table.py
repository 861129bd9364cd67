"""Print the context-sweep table of docs/results.md from a `specstack bench` output directory.

    python examples/paper/context_table.py results/context_sweep [--ceilings] [--plot speedup.png]

Per run: speedup against autoregressive decoding (decode time per token, same process, same
prompt), acceptance per verifying level (accepted / drafted, lowest first), tokens per target
forward, the cost of one retrieval-level forward as a fraction of one full-cache forward (the
levels' mean forward times in that run), and the KV cache each level holds (MiB, preallocated).

``--ceilings`` prints, per speculative run, what bounds it: the mean full-cache forward (a verify) and
the mean retrieval-level forward against the autoregressive step of the same prompt and temperature
(V/F, R/F), the retrieval-level forwards per verify, and the speedup the run would reach were drafting
free (tokens per target forward × F / V). ``--plot`` draws speedup against context length, one panel
per text and temperature.
"""

from __future__ import annotations

import argparse

from tables import load, table, verifying


def task_label(record: dict) -> str:
    book = record["task_options"].get("book", "prideprejudice")
    return {"prideprejudice": "Austen", "kjv": "KJV"}.get(book, book)


def mean_forward_ms(level: dict) -> float:
    return 1000 * level["forward_seconds"] / max(level["forward_calls"], 1)


def retrieval_fraction(record: dict) -> str:
    """Mean retrieval-level forward over mean full-cache forward (the top level), where both exist."""
    names = [level["name"] for level in record["levels"]]
    middle = [level for level in record["levels"][:-1] if "retrieval" in level["name"] and level["forward_calls"]]
    if not middle or len(names) < 2:
        return "–"
    return f"{mean_forward_ms(middle[-1]) / mean_forward_ms(record['levels'][-1]):.2f}"


def row(record: dict) -> list[str]:
    target = record["levels"][-1]
    return [str(record["context_length"]), task_label(record), f"{record['temperature']:g}", record["stack"],
            f"{record['speedup']:.2f}×" if record["speedup"] else "–",
            " → ".join("–" if level["acceptance_rate"] is None else f"{level['acceptance_rate']:.2f}" for level in verifying(record)) or "–",
            f"{record['new_tokens'] / max(target['forward_calls'], 1):.2f}",
            retrieval_fraction(record),
            " / ".join(f"{level.get('cache_bytes', 0) / 2**20:.0f}" for level in record["levels"]),
            {True: "yes", False: "NO", None: "–"}[record["identical_to_baseline"]]]


def step_seconds(records: list[dict]) -> dict:
    """The autoregressive seconds per token of each (context, text, temperature)."""
    return {(r["context_length"], task_label(r), r["temperature"]): r["decode_seconds"] / r["new_tokens"]
            for r in records if r["stack"] == "autoregressive"}


def ceiling_row(record: dict, step: float) -> list[str]:
    top = record["levels"][-1]
    verify = top["forward_seconds"] / max(top["forward_calls"], 1)
    tokens = record["new_tokens"] / max(top["forward_calls"], 1)
    middle = [level for level in record["levels"][:-1] if level["forward_calls"]]
    cells = ["–", "–"]
    if middle:
        cells = [f"{middle[-1]['forward_seconds'] / middle[-1]['forward_calls'] / step:.2f}", f"{middle[-1]['forward_calls'] / max(top['forward_calls'], 1):.2f}"]
    return [str(record["context_length"]), task_label(record), f"{record['temperature']:g}", record["label"], f"{record['speedup']:.2f}×",
            f"{tokens:.2f}", f"{verify / step:.2f}", *cells, f"{tokens * step / verify:.2f}×"]


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(task_label(r), r["temperature"]) for r in records})
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), sharey=True, squeeze=False)
    for axis, (text, temperature) in zip(axes[0], panels):
        for stack in sorted({r["label"] for r in records if r["stack"] != "autoregressive"}):
            points = sorted((r["context_length"], r["speedup"]) for r in records
                            if r["label"] == stack and task_label(r) == text and r["temperature"] == temperature)
            axis.plot(*zip(*points), marker="o", label=stack)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set(title=f"{text}, T = {temperature:g}", xlabel="context (tokens)", xscale="log", xticks=sorted({r["context_length"] for r in records}))
        axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0][0].set_ylabel("speedup over autoregressive")
    axes[0][-1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(directory: str, ceilings: bool = False, plot_to: str | None = None) -> None:
    records = [r for r in load(directory) if r["status"] == "ok"]
    if plot_to:
        plot(records, plot_to)
    if ceilings:
        steps = step_seconds(records)
        header = ["context", "text", "T", "stack", "speedup", "tokens / target forward", "V / F", "R / F", "retrieval forwards / verify",
                  "drafting-free ceiling"]
        print(table(header, [ceiling_row(r, steps[(r["context_length"], task_label(r), r["temperature"])])
                             for r in sorted(records, key=lambda r: (task_label(r), r["temperature"], r["context_length"], r["label"]))
                             if r["stack"] != "autoregressive"]))
        return
    records.sort(key=lambda r: (task_label(r), r["temperature"], r["context_length"], r["stack"] != "autoregressive", r["stack"]))
    header = ["context", "text", "T", "stack", "speedup", "acceptance per level", "tokens / target forward",
              "retrieval / full forward", "KV MiB per level", "identical"]
    print(table(header, [row(r) for r in records]))
    failed = [r for r in load(directory) if r["status"] != "ok"]
    for record in failed:
        print(f"\n{record['stack']} at {record['context_length']}: {record['error']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--ceilings", action="store_true", help="what bounds each run instead of the table")
    parser.add_argument("--plot", metavar="FILE", help="also draw speedup against context length into FILE")
    args = parser.parse_args()
    main(args.directory, args.ceilings, args.plot)
