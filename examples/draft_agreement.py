"""Greedy agreement of distilled drafts with the target on held-out text: the table in the shipped
draft's TRAINING.md.

Two measures per held-out book, both teacher-forced, both against the fp32 target's argmax:
  * ``text``: the book itself, its first ``--positions`` tokens in windows of 512
    (``specstack_training.distill.greedy_agreement``, what training reports);
  * ``greedy``: the target's own greedy continuations (192 tokens) of 24 prompts of 64 tokens drawn
    from the book, scored on the continuation only: the text a greedy speculative stack drafts for.

    python examples/draft_agreement.py --draft specstack/assets/smollm2-draft --draft OTHER_DIR \\
        --books prideprejudice kjv
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

from specstack.data import load_book
from specstack.models import copy_target_weights, prepare_target
from specstack_training.distill import argmax_predictions, greedy_agreement
from specstack_training.shared import continuations, text_chunks
from specstack_training.shared import encode

PROMPTS, PROMPT_LEN, WRITTEN = 24, 64, 192


def load_draft(path: str, target) -> torch.nn.Module:
    """A draft saved by ``specstack train draft``, with what its file leaves out copied from the target
    (its embedding rounded to bf16, and any layers it shares)."""
    logging.set_verbosity_error()  # what the file leaves out is reported missing: it is, on purpose
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    copy_target_weights(draft, target)
    return draft


@torch.no_grad()
def held_out(target, tokens: np.ndarray, positions: int) -> dict:
    """The book's tokens with the target's argmaxes, and the target's greedy continuations with its argmaxes."""
    ids = torch.from_numpy(tokens)  # [L]
    prompts = text_chunks([tokens], PROMPT_LEN, PROMPTS, np.random.default_rng(1))  # [E, P]
    written = continuations(target, prompts, WRITTEN, None, 8)  # [E, P + W]
    return dict(ids=ids, positions=positions, text_preds=argmax_predictions(target, ids, positions),
                written=written, greedy_preds=target(input_ids=written).logits.argmax(-1))  # [E, P + W]


@torch.no_grad()
def agreement(draft, data: dict) -> dict:
    text = greedy_agreement(draft, None, data["ids"], positions=data["positions"], teacher_preds=data["text_preds"])
    scored = slice(PROMPT_LEN - 1, -1)  # positions predicting a token the target wrote
    mine = draft(input_ids=data["written"]).logits.argmax(-1)  # [E, P + W]
    greedy = (mine[:, scored] == data["greedy_preds"][:, scored]).float().mean().item()
    return dict(text=round(text, 4), greedy=round(greedy, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", action="append", required=True, help="a draft directory (repeatable)")
    parser.add_argument("--books", nargs="+", default=["prideprejudice", "kjv"])
    parser.add_argument("--positions", type=int, default=20480)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(prepare_target())
    target = AutoModelForCausalLM.from_pretrained(prepare_target(), dtype=torch.float32).eval()
    data = {book: held_out(target, encode(tokenizer, [load_book(book)])[0], args.positions) for book in args.books}
    for path in args.draft:
        draft = load_draft(path, target)
        print(json.dumps({"draft": path, "layers": draft.config.num_hidden_layers,
                          **{book: agreement(draft, held) for book, held in data.items()}}), flush=True)


if __name__ == "__main__":
    main()
