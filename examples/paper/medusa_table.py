"""The Medusa table of docs/results.md from `specstack bench` output directories.

    python examples/paper/medusa_table.py results/medusa_float32 results/medusa_bfloat16

Per run: the speedup against autoregressive decoding in the same process, whether the output was
identical to it, the tokens emitted per forward pass of the target (full cache), the acceptance
(accepted / drafted) at each verifying level, lowest first, and the milliseconds per forward pass of
the level verifying level 0's draft.
"""

from __future__ import annotations

import sys

from tables import load, table


HEADER = ["dtype", "text", "T", "stack", "speedup", "identical", "tokens per target forward", "acceptance per level", "verify ms per forward"]


def _row(record: dict) -> list[str]:
    levels = record["levels"]
    top, verifying = levels[-1], levels[min(1, len(levels) - 1)]
    per_forward = record["new_tokens"] / max(top["forward_calls"], 1)
    ms = 1000 * verifying["forward_seconds"] / max(verifying["forward_calls"], 1)
    acceptance = " / ".join(f"{level['accepted'] / level['drafted']:.2f}" if level["drafted"] else "–" for level in levels[1:]) or "–"
    options = record.get("task_options")
    text = record["task"]
    if isinstance(options, dict):  # the book, and where in it the prompt starts when not at its beginning
        text = options.get("book", "prideprejudice") + (f" @{options['offset']:,}" if options.get("offset") else "")
    return [record["dtype"], text, f"{record['temperature']:g}", f"`{record['label']}`", f"{record['speedup']:.2f}×",
            "yes" if record["identical_to_baseline"] else "no", f"{per_forward:.2f}", acceptance, f"{ms:.1f}"]


def main(directories: list[str]) -> None:
    print(table(HEADER, [_row(record) for directory in directories for record in load(directory) if record.get("status") == "ok"]))


if __name__ == "__main__":
    main(sys.argv[1:])
