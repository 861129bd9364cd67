"""Print the context-sweep table of docs/results.md from a `specstack bench` output directory.

    python examples/paper/context_table.py results/context_sweep

Per run: speedup against autoregressive decoding (decode time per token, same process, same
prompt), acceptance per verifying level (accepted / drafted, lowest first), tokens per target
forward, the cost of one retrieval-level forward as a fraction of one full-cache forward (the
levels' mean forward times in that run), and the KV cache each level holds (MiB, preallocated).
"""

from __future__ import annotations

import sys

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
            " → ".join(f"{level['acceptance_rate']:.2f}" for level in verifying(record)) or "–",
            f"{record['new_tokens'] / max(target['forward_calls'], 1):.2f}",
            retrieval_fraction(record),
            " / ".join(f"{level.get('cache_bytes', 0) / 2**20:.0f}" for level in record["levels"]),
            {True: "yes", False: "NO", None: "–"}[record["identical_to_baseline"]]]


def main(directory: str) -> None:
    records = [r for r in load(directory) if r["status"] == "ok"]
    records.sort(key=lambda r: (task_label(r), r["temperature"], r["context_length"], r["stack"] != "autoregressive", r["stack"]))
    header = ["context", "text", "T", "stack", "speedup", "acceptance per level", "tokens / target forward",
              "retrieval / full forward", "KV MiB per level", "identical"]
    print(table(header, [row(r) for r in records]))
    failed = [r for r in load(directory) if r["status"] != "ok"]
    for record in failed:
        print(f"\n{record['stack']} at {record['context_length']}: {record['error']}")


if __name__ == "__main__":
    main(sys.argv[1])
