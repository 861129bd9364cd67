"""What a draft vocabulary saves: the embedded default's LM head against its rows for the chained heads'
first 8,192 ranked tokens (docs/medusa.md, "A draft vocabulary"), bf16, best of three loops of 200 calls.

    python examples/draft_vocab_cost.py [--threads 2] [--size 8192]
"""

from __future__ import annotations

import argparse
import time

import torch

from specstack.models import load_default
from specstack_medusa.heads import load_heads


def best_ms(function, states: torch.Tensor, calls: int = 200) -> float:
    for _ in range(10):
        function(states)
    loops = []
    for _ in range(3):
        began = time.perf_counter()
        for _ in range(calls):
            function(states)
        loops.append((time.perf_counter() - began) / calls * 1000)
    return min(loops)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _, _ = load_default(dtype=torch.bfloat16, with_draft=False)
    part = target.output_head(load_heads("chained").token_rank[: args.size])
    for rows in (1, 2, 4):
        states = torch.randn(rows, target.hidden_size)
        whole, some = best_ms(target.output_logits, states), best_ms(part, states)
        print(f"{rows} rows: whole LM head {whole:.2f} ms, {args.size} rows {some:.2f} ms, {whole / some:.1f}x less")


if __name__ == "__main__":
    main()
