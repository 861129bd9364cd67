"""TriForce at 32K tokens in bf16 with the default draft and with the shared draft, in one process.

The target (bf16, YaRN to 32,768 tokens) prefills one ~32,500-token prompt (a book's opening and the demo's
summary request) once, autoregressively; both TriForce stacks copy that cache (``share_prefill``) and
prefill only their lower levels. Then, twice, each stack runs at γ1 = 1 and γ2 = 1, then at γ2 = 3, the
two drafts alternated, and autoregressive decoding runs again after each repeat (its drift). Each run
prints one JSON line: ms per token, speedup against the first autoregressive run, per-level acceptance
and mean forward time, tokens per target forward, and whether the tokens equal autoregressive
decoding's (bf16: near-ties may differ, docs/exactness.md). Both drafts cut to ``draft_vocab=8192``.

    python examples/draft_ab_32k.py prideprejudice 128
    python examples/draft_ab_32k.py kjv 128
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specstack.autotune import verifying_levels
from specstack.demo import SUMMARY, task_prompt
from specstack.models import load_default, load_draft
from specstack.registry import Registry
from specstack.speedup import measured_speedup

SHARED = "specstack/assets/smollm2-draft-shared"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("book", help="a book of specstack.data (prideprejudice, kjv, ...)")
    parser.add_argument("new_tokens", type=int)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, draft, tokenizer = load_default(dtype=torch.bfloat16, context=32768, rope_scaling="yarn")
    drafts = {"default": draft, "shared": load_draft(target, SHARED, dtype=torch.bfloat16)}
    prompt = task_prompt(tokenizer, book=args.book, length=32500, request=SUMMARY)
    registry = Registry.create()
    autoregressive = registry.stack("autoregressive", target=target)
    began = time.perf_counter()
    autoregressive.generate(prompt, 8)
    print(f"autoregressive prefill {time.perf_counter() - began:.0f} s", flush=True)
    stacks = {}
    for name, model in drafts.items():
        stack = registry.stack("triforce", target=target, draft=model, gamma1=1, gamma2=3, draft_vocab=8192)
        stack.share_prefill(autoregressive, prompt)
        stack.generate(prompt, 8, reuse_cache=True)  # the lower levels' prefill, and a warm-up
        stacks[name] = stack
    reference = autoregressive.generate(prompt, args.new_tokens, reuse_cache=True)
    base = reference.seconds / len(reference.tokens)
    print(f"autoregressive {1e3 * base:.1f} ms/token", flush=True)
    for repeat in range(2):
        for gamma2 in (1, 3):
            for name, stack in stacks.items():
                for level, gamma in zip(verifying_levels(stack), (1, gamma2)):
                    level.gamma = gamma
                result = stack.generate(prompt, args.new_tokens, reuse_cache=True)
                print(json.dumps({
                    "book": args.book, "repeat": repeat, "draft": name, "gamma2": gamma2, "ms": round(1e3 * result.seconds / len(result.tokens), 1),
                    "speedup": round(measured_speedup(reference.seconds, len(reference.tokens), result.seconds, len(result.tokens)), 3), "acceptance": [round(level.acceptance_rate, 3) for level in result.levels[1:]],
                    "tokens_per_target_forward": round(len(result.tokens) / max(1, result.levels[-1].forward_calls), 2),
                    "identical": list(result.tokens) == list(reference.tokens),
                    "level_ms": {level.name: round(1e3 * level.forward_seconds / max(1, level.forward_calls), 1) for level in result.levels},
                }), flush=True)
        again = autoregressive.generate(prompt, args.new_tokens, reuse_cache=True)
        print(f"autoregressive again {1e3 * again.seconds / len(again.tokens):.1f} ms/token (drift {again.seconds / len(again.tokens) / base:.3f})", flush=True)


if __name__ == "__main__":
    main()
