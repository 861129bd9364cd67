"""TriForce's level 0 compared in one process: the distilled draft (``triforce``), prompt lookup
(``triforce-lookup``) and lookup where it matches, else the draft (``triforce-hybrid``), at fixed γ and
with ``gamma=adaptive``, on the demo's prompt (Pride and Prejudice + a summary request).

The target's prefill is paid once (autoregressive decoding, whose cache every stack copies:
``share_prefill``); each stack's speedup is against that run. Autoregressive decoding runs again at the
end, to show how far the host drifted meanwhile.

    python examples/triforce_level0.py --context 32768 --dtype bfloat16   # YaRN x4; about 8 minutes here
    python examples/triforce_level0.py --dtype float32                    # 7,000-token passage; about 1.5 minutes
"""

from __future__ import annotations

import argparse

import torch

from specstack import Registry, autotune
from specstack.demo import SUMMARY, passage_tokens, task_prompt
from specstack.models import load_default
from specstack.speedup import measured_speedup

CONFIGS = [  # (stack, options, tuning)
    ("triforce", {}, None),
    ("triforce-hybrid", {}, None),
    ("triforce-hybrid", {"gamma1": 3, "gamma2": 6}, None),
    ("triforce-hybrid", {"gamma1": 4, "gamma2": 8}, None),
    ("triforce-lookup", {}, None),
    ("triforce-hybrid", {}, "adaptive"),
    ("triforce", {}, "adaptive"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=None, help="the target's window (default: its trained one); beyond it, YaRN")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.prompt_tokens = None  # the demo's passage: 7,000 tokens, or what fills --context
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_default(dtype=getattr(torch, args.dtype), context=args.context, rope_scaling="yarn")
    prompt = task_prompt(tokenizer, book="prideprejudice", length=passage_tokens(args), request=SUMMARY)
    registry, stops = Registry.create(), [tokenizer.eos_token_id]
    autoregressive = registry.stack("autoregressive", target=target, stop_tokens=stops)
    reference = autoregressive.generate(prompt, args.max_new_tokens)
    print(f"{len(prompt)} prompt tokens, {args.dtype}; autoregressive {1e3 * reference.seconds / len(reference.tokens):.1f} ms/token", flush=True)
    for name, options, tuning in CONFIGS:
        needs_draft = registry.stack_recipe(name).needs_draft
        stack = registry.stack(name, target=target, draft=draft if needs_draft else None, stop_tokens=stops, **options)
        shared = stack.share_prefill(autoregressive, prompt)
        retuner = autotune.tuned(stack, prompt, tuning, seed=0, reuse_cache=shared)[1] if tuning else None
        result = stack.generate(prompt, args.max_new_tokens, seed=0, reuse_cache=True, after_round=retuner)
        speedup = measured_speedup(reference.seconds, len(reference.tokens), result.seconds, len(result.tokens))
        acceptance = [round(level.acceptance_rate, 2) for level in result.levels[1:]]
        per_forward = len(result.tokens) / max(result.levels[-1].forward_calls, 1)
        print(f"{name:16} {str(options):28} {tuning or '':9} {speedup:5.2f}x  acceptance {acceptance}  {per_forward:.2f} tokens per target forward"
              f"  identical {list(result.tokens) == list(reference.tokens)}" + (f"  retuned {retuner.history}" if retuner else ""), flush=True)
    again = autoregressive.generate(prompt, args.max_new_tokens, reuse_cache=True)
    print(f"autoregressive again {1e3 * again.seconds / len(again.tokens):.1f} ms/token")


if __name__ == "__main__":
    main()
