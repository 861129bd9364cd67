"""What block verification (``-o verifier=block``) buys over token-by-token speculative sampling, on identical inputs.

The stacks decode with the token rule as usual. At every round of every chain level, a recording verifier also
computes, for the same draft and the same distributions p, the expected number of tokens each rule emits:
token rule 1 + sum_i prod_{j <= i} min(1, p(x_j) / q(x_j)) (:func:`specstack.verify.expected_emitted`); block rule
1 + sum_i P(τ >= i), P(τ >= i) = 1 - prod_{j >= i} (1 - h_j) (:func:`specstack.verify.block_chances`). The ratio of their means is the gain in tokens
per round that the block rule would give on these rounds, free of the noise of comparing two different texts.
The tokens the levels emit are the token rule's, as ``specstack generate`` writes them; the output is unchanged.

    python examples/block_verification_gain.py                      # bf16, 7,000-token passages, T = 0.6, three seeds
    python examples/block_verification_gain.py --temperature 1.0 --seeds 0
"""

from __future__ import annotations

import argparse
import collections

import attrs
import torch

from specstack import Registry, SamplingConfig, SpeculationStack, SpeculativeSamplingVerifier
from specstack.demo import QUESTION, task_prompt
from specstack.models import load_default
from specstack.verify import SequoiaVerifier, block_chances, expected_emitted

CONFIGS = [  # (stack, options): TriForce with the retrieval level drafting alone (γ1 = 0, as the tuner sets it at
    ("triforce", {"gamma1": 0, "gamma2": 3}),  # T = 0.6 here), with the draft model under it, with prompt lookup, and
    ("triforce", {"gamma1": 0, "gamma2": 6}),  # plain speculative decoding with the draft model
    ("triforce", {"gamma1": 2, "gamma2": 4}),
    ("triforce-lookup", {"gamma1": 8, "gamma2": 3}),
    ("speculative", {"gamma": 4}),
]


@attrs.define(eq=False)
class RecordingVerifier(SpeculativeSamplingVerifier):
    """The token rule, noting each round's expected emitted tokens under it and under the block rule."""

    sums: collections.Counter = attrs.field(factory=collections.Counter)

    def verify(self, draft, p, generator):
        if len(draft):
            hold = block_chances(draft, p)[1][1:]  # [k]: h_1 … h_k
            fail_after = torch.flip(torch.cumprod(torch.flip(1 - hold, (0,)), 0), (0,))  # [k]: prod_{j >= i} (1 - h_j)
            self.sums["rounds"] += 1
            self.sums["token"] += expected_emitted(SequoiaVerifier(), draft, p)  # on a chain, Sequoia's rule is the token rule
            self.sums["block"] += 1 + float((1 - fail_after).sum())
            self.sums["drafted"] += len(draft)
        return super().verify(draft, p, generator)


def recorded_stack(registry, name: str, options: dict, target, draft, sampling, stops, seed: int):
    levels = registry.stack_recipe(name).levels(registry, target=target, draft=draft, **options)
    recorders = [RecordingVerifier() for _ in levels[1:]]
    levels = [levels[0]] + [attrs.evolve(level, verifier=recorder) for level, recorder in zip(levels[1:], recorders)]
    return SpeculationStack.build(levels, sampling=sampling, stop_tokens=stops, seed=seed), recorders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--books", nargs="+", default=["prideprejudice", "kjv"])
    parser.add_argument("--prompt-tokens", type=int, default=7000)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_default(dtype=getattr(torch, args.dtype))
    registry, stops = Registry.create(), [tokenizer.eos_token_id]
    sampling = SamplingConfig(temperature=args.temperature)
    print(f"{args.dtype}, T = {args.temperature}, {args.prompt_tokens}-token passages, {args.max_new_tokens} tokens, seeds {args.seeds}")
    print("book | stack | level | rounds | drafted/round | token rule: tokens/round | block rule | block / token")
    for book in args.books:
        prompt = task_prompt(tokenizer, book=book, length=args.prompt_tokens, request=QUESTION)
        for name, options in CONFIGS:
            needs_draft = registry.stack_recipe(name).needs_draft
            totals = collections.defaultdict(collections.Counter)
            for seed in args.seeds:
                stack, recorders = recorded_stack(registry, name, options, target, draft if needs_draft else None, sampling, stops, seed)
                result = stack.generate(prompt, args.max_new_tokens, seed=seed)
                for level, recorder in zip(result.levels[1:], recorders):
                    totals[level.name].update(recorder.sums)
            for level, sums in totals.items():
                if sums["rounds"]:
                    n = sums["rounds"]
                    print(f"{book} | {name} {options} | {level} | {n} | {sums['drafted'] / n:.2f} | {sums['token'] / n:.3f} | "
                          f"{sums['block'] / n:.3f} | {sums['block'] / sums['token']:.3f}", flush=True)


if __name__ == "__main__":
    main()
