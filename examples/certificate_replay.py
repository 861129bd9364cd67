"""The bf16 certificate's replay, made two ways: prefilling the prompt itself, or copying the prefill of
the autoregressive stack whose output it certifies (``GreedyReference(decoded_by=...)``, what
``specstack demo`` does).

In one process: bf16 autoregressive decoding of ``--new-tokens`` tokens after ``--prompt-tokens`` tokens
of Pride and Prejudice and the demo's summary request, then each replay made and run to its last token
(construction and replay timed together), and their logits compared bit for bit.

    python examples/certificate_replay.py --threads 2 --prompt-tokens 7000
"""

from __future__ import annotations

import argparse
import time

import torch

from specstack import Registry
from specstack.models import load_target
from specstack.demo import SUMMARY, task_prompt
from specstack.testing.certificate import GreedyReference


def replayed(make) -> tuple[float, GreedyReference]:
    """Seconds to make a replay and run it to the last generated token, and the replay."""
    began = time.perf_counter()
    reference = make()
    reference.logits(len(reference.tokens) - 1)
    return time.perf_counter() - began, reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=7000)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(dtype=torch.bfloat16)
    prompt = task_prompt(tokenizer, book="prideprejudice", length=args.prompt_tokens, request=SUMMARY)
    stack = Registry.create().stack("autoregressive", target=target)
    began = time.perf_counter()
    tokens = stack.generate(prompt, args.new_tokens).tokens
    print(f"{len(prompt)} prompt tokens, {len(tokens)} generated in bf16: {time.perf_counter() - began:.1f} s with the prefill")
    copied_s, copied = replayed(lambda: GreedyReference(target, prompt, tokens, decoded_by=stack))
    paid_s, paid = replayed(lambda: GreedyReference(target, prompt, tokens))
    same = all(torch.equal(copied.logits(i), paid.logits(i)) for i in range(len(tokens)))
    print(f"replay copying the prefill: {copied_s:.2f} s; prefilling itself: {paid_s:.2f} s ({paid_s / copied_s:.1f}x); logits equal bit for bit: {same}")


if __name__ == "__main__":
    main()
