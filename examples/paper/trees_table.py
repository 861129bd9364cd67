"""The token-tree table of docs/results.md from `specstack bench` output directories.

    python examples/paper/trees_table.py results/trees_bfloat16 results/trees_float32

Per run: the speedup against autoregressive decoding in the same process; for the level that
verifies level 0's draft, the draft size and the tokens accepted per verify and its milliseconds per
forward pass; and the target's forward passes per generated token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _row(record: dict) -> str:
    levels = record["levels"]
    verifying, top = levels[min(1, len(levels) - 1)], levels[-1]
    ms = 1000 * verifying["forward_seconds"] / max(verifying["forward_calls"], 1)
    per_token = top["forward_calls"] / record["new_tokens"]
    head = f"| {record['dtype']} | {record['temperature']:g} | `{record['label']}` | {record['speedup']:.2f}× |"
    if len(levels) == 1:
        return f"{head} – | – | {ms:.1f} | {per_token:.2f} |"
    rounds = max(verifying["rounds"], 1)
    return f"{head} {verifying['drafted'] / rounds:.2f} | {verifying['accepted'] / rounds:.2f} | {ms:.1f} | {per_token:.2f} |"


def main(directories: list[str]) -> None:
    print("| dtype | T | stack | speedup | draft size per verify | accepted per verify | verify ms per forward | target forwards per token |")
    print("|---|---|---|---|---|---|---|---|")
    for directory in directories:
        for line in (Path(directory) / "results.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("status") == "ok":
                print(_row(record))


if __name__ == "__main__":
    main(sys.argv[1:])
