"""The Medusa table of docs/results.md from `specstack bench` output directories.

    python examples/paper/medusa_table.py results/medusa_float32 results/medusa_bfloat16

Per run: the speedup against autoregressive decoding in the same process, whether the output was
identical to it, the tokens emitted per forward pass of the target (full cache), the acceptance
(accepted / drafted) at each verifying level, lowest first, and the milliseconds per forward pass of
the level verifying level 0's draft.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _row(record: dict) -> str:
    levels = record["levels"]
    top, verifying = levels[-1], levels[min(1, len(levels) - 1)]
    per_forward = record["new_tokens"] / max(top["forward_calls"], 1)
    ms = 1000 * verifying["forward_seconds"] / max(verifying["forward_calls"], 1)
    acceptance = " / ".join(f"{level['accepted'] / level['drafted']:.2f}" if level["drafted"] else "–" for level in levels[1:]) or "–"
    text = record["task_options"].get("book", "prideprejudice") if isinstance(record.get("task_options"), dict) else record["task"]
    same = "yes" if record["identical_to_baseline"] else "no"
    return (f"| {record['dtype']} | {text} | {record['temperature']:g} | `{record['label']}` | {record['speedup']:.2f}× | {same} | "
            f"{per_forward:.2f} | {acceptance} | {ms:.1f} |")


def main(directories: list[str]) -> None:
    print("| dtype | text | T | stack | speedup | identical | tokens per target forward | acceptance per level | verify ms per forward |")
    print("|---|---|---|---|---|---|---|---|---|")
    for directory in directories:
        for line in (Path(directory) / "results.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("status") == "ok":
                print(_row(record))


if __name__ == "__main__":
    main(sys.argv[1:])
