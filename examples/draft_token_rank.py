"""Write a draft's token ranking (``token_rank.safetensors``, :mod:`specstack.draft_vocabulary`): the target's
token ids by how often they occur in the draft's training texts, most often first, which ``-o draft_vocab=R``
cuts the draft's vocabulary to. Prints how much of held-out text the first R tokens cover.

    python examples/draft_token_rank.py --out specstack/assets/smollm2-draft \\
        --text emma --text mansfieldpark --text northangerabbey --text persuasion --text sensesensibility \\
        --held-out prideprejudice --held-out kjv
    python examples/draft_token_rank.py --out specstack/assets/smollm2-draft-shared \
        --text emma --text mansfieldpark --text northangerabbey --text persuasion --text sensesensibility \
        --text /usr/lib/python3.11/json --text /usr/lib/python3.11/email --text /usr/lib/python3.11/asyncio \
        --held-out prideprejudice --held-out kjv
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer

from specstack.data import BOOKS
from specstack.draft_vocabulary import coverage, token_rank, write_token_rank
from specstack.models import prepare_target
from specstack_training.command import read_text  # a shipped book's name, a file, or a directory of .py/.txt files

SIZES = (4096, 8192, 16384)


def text_ids(tokenizer, name: str) -> torch.Tensor:
    """[N] the token ids of a text, as the trainers read it (``specstack train --text``)."""
    return torch.tensor(tokenizer(read_text(name), add_special_tokens=False).input_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the draft's directory (the file is written beside its weights)")
    parser.add_argument("--text", action="append", required=True, help="a training text of the draft: a shipped book, a file or a directory")
    parser.add_argument("--held-out", action="append", choices=BOOKS, default=[], help="a text to report coverage on")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(prepare_target())
    vocab = len(tokenizer)
    training = torch.cat([text_ids(tokenizer, name) for name in args.text])  # [N]
    rank = token_rank(training, vocab)  # [V]
    print(f"{training.numel():,} training tokens, {training.unique().numel():,} distinct; wrote {write_token_rank(rank, args.out)}")
    for name in args.held_out:
        ids = text_ids(tokenizer, name)
        print(f"{name}: " + ", ".join(f"the first {size:,} cover {coverage(rank, ids, size):.4f}" for size in SIZES))


if __name__ == "__main__":
    main()
