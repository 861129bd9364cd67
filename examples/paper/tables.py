"""Print the paper-shaped tables of docs/results.md from `specstack bench` output directories.

    python examples/paper/tables.py results/table1 results/table2 results/ablations

Acceptance is given two ways per level: accepted / drafted tokens, and α = accepted / examined
tokens (a drafted token after the first rejection of its round is never examined), the per-token
acceptance probability of Leviathan et al. that the TriForce paper reports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(directory: str) -> list[dict]:
    """The records of a `specstack bench` output directory (its results.jsonl), or of a .jsonl file."""
    path = Path(directory)
    lines = (path if path.is_file() else path / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def verifying(record: dict) -> list[dict]:
    """Levels that verified a draft, lowest first."""
    return [level for level in record["levels"] if level["rounds"]]


def acceptance(level: dict) -> str:
    return f"{level['acceptance_rate']:.3f} / {level['token_acceptance_rate']:.3f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def table1(records: list[dict]) -> str:
    rows = []
    for policy in ("topk-oracle", "streaming", "h2o", "retrieval"):
        cells = [policy]
        for task in ("prose", "needle"):
            found = [r for r in records if r["status"] == "ok" and r["options"].get("policy") == policy and r["task"] == task]
            cells += [acceptance(verifying(r)[-1]) for r in found] or ["–"]
        rows.append(cells)
    budget = next(r["options"]["budget"] for r in records if "budget" in r["options"])
    context = records[0]["context_length"]
    header = [f"policy (budget {budget} of {context})", "prose: acc. / α", "needle: acc. / α"]
    return table(header, rows)


def stack_rows(records: list[dict], key, label) -> list[list[str]]:
    rows = []
    for record in sorted((r for r in records if r["status"] == "ok" and r["stack"] != "autoregressive"), key=key):
        levels = verifying(record)
        rows.append([label(record), f"{record['speedup']:.2f}×", f"{record['tokens_per_second']:.2f}",
                     " → ".join(acceptance(level) for level in levels), str(record["identical_to_baseline"])])
    return rows


def table2(records: list[dict]) -> str:
    header = ["stack, T", "speedup", "tokens/s", "acceptance per level, lowest first (acc. / α)", "identical"]
    return table(header, stack_rows(records, key=lambda r: (r["stack"], r["temperature"]), label=lambda r: f"{r['stack']}, {r['temperature']}"))


def ablations(records: list[dict]) -> str:
    header = ["stack and options", "speedup", "tokens/s", "acceptance per level, lowest first (acc. / α)", "identical"]
    return table(header, stack_rows(records, key=lambda r: r["label"], label=lambda r: r["label"]))


def baselines(records: list[dict]) -> str:
    found = [r for r in records if r["stack"] == "autoregressive" and r["status"] == "ok"]
    def one(r: dict) -> str:
        accuracy = "" if r.get("accuracy") is None else f", needle found: {bool(r['accuracy'])}"
        return f"{r['task']} T={r['temperature']}: {1000 / r['tokens_per_second']:.1f} ms/token, prefill {r['prefill_seconds']:.1f} s{accuracy}"

    return "; ".join(one(r) for r in found)


def main(argv: list[str]) -> int:
    for directory, render in zip(argv, (table1, table2, ablations)):
        records = load(directory)
        print(f"### {directory}\n\n{render(records)}\n\nautoregressive baseline: {baselines(records)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
