"""Heads side by side on the held-out data ``specstack train medusa`` scores heads on: for each step (head) k, how
often its top candidate is the target's greedy token a_{t+k} (what a greedy stack accepts) and the target's mean
probability of it at ``--temperature`` (what a token tree accepts at that T), teacher-forced on the fp32 target's greedy
continuations of 64-token prompts from ``--book`` (the trainer's held-out set for that book, seed 0).

    python examples/compare_heads.py chained /tmp/heads.safetensors          # shipped chained heads against a new file
    python examples/compare_heads.py parallel chained --book kjv --temperature 1.0
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specstack.data import load_book
from specstack.models import prepare_target
from specstack_medusa.heads import load_heads
from specstack_training.medusa import DEFAULTS, first_candidate_mass, label_held_out, rank_accuracy
from specstack_training.shared import encode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", nargs="+", help="heads files (.safetensors) or shipped names (parallel, chained)")
    parser.add_argument("--book", default="prideprejudice")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = str(prepare_target())
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    data = label_held_out(target, encode(tokenizer, [load_book(args.book)])[0], DEFAULTS, 0, print)["greedy"]  # tokens, states, greedy tokens
    lm_head, embedding = target.lm_head.weight.detach(), target.get_input_embeddings().weight.detach()  # [V, H] each
    print(f"{args.book}, greedy continuations: step k's top-1 accuracy / the target's mean p of its top candidate at T = {args.temperature}")
    for name in args.heads:
        heads = load_heads(name)
        top1 = [row[0] for row in rank_accuracy(heads, lm_head, embedding, data, 1)]
        mass = first_candidate_mass(heads, lm_head, embedding, data, args.temperature)
        print(f"{name} | " + " | ".join(f"{a:.3f} / {m:.3f}" for a, m in zip(top1, mass)) + f" | mean {sum(top1) / len(top1):.3f} / {sum(mass) / len(mass):.3f}")


if __name__ == "__main__":
    main()
