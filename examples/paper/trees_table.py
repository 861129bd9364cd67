"""The token-tree table of docs/results.md from `specstack bench` output directories.

    python examples/paper/trees_table.py results/trees_bfloat16 results/trees_float32

Per run: the speedup against autoregressive decoding in the same process; for the level that
verifies level 0's draft, the draft size and the tokens accepted per verify and its milliseconds per
forward pass; and the target's forward passes per generated token.
"""

from __future__ import annotations

import sys

from tables import load, table


HEADER = ["dtype", "T", "stack", "speedup", "draft size per verify", "accepted per verify", "verify ms per forward", "target forwards per token"]


def _row(record: dict) -> list[str]:
    levels = record["levels"]
    verifying, top = levels[min(1, len(levels) - 1)], levels[-1]
    ms = 1000 * verifying["forward_seconds"] / max(verifying["forward_calls"], 1)
    per_token = top["forward_calls"] / record["new_tokens"]
    head = [record["dtype"], f"{record['temperature']:g}", f"`{record['label']}`", f"{record['speedup']:.2f}×"]
    if len(levels) == 1:
        return [*head, "–", "–", f"{ms:.1f}", f"{per_token:.2f}"]
    rounds = max(verifying["rounds"], 1)
    return [*head, f"{verifying['drafted'] / rounds:.2f}", f"{verifying['accepted'] / rounds:.2f}", f"{ms:.1f}", f"{per_token:.2f}"]


def main(directories: list[str]) -> None:
    print(table(HEADER, [_row(record) for directory in directories for record in load(directory) if record.get("status") == "ok"]))


if __name__ == "__main__":
    main(sys.argv[1:])
