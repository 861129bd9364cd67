"""Where a stack's rounds spend their time outside the target's forwards: each drafter, verifier and Medusa step timed
inside a real generation.

A stack (``--stack``, tuned with ``gamma=auto`` unless ``--no-tune``) decodes ``--tokens`` new tokens after a
``--context``-token prompt from a shipped book, once per seed (after a short untimed run that fills the caches), with
the methods below wrapped in timers. Each line gives a method's calls, its seconds and its milliseconds a call; the
round's own line minus the target's forwards is what a round costs besides them. Then plain autoregressive decoding's
milliseconds a token, in the same process, for scale.

    python examples/round_costs.py --stack medusa-lookup --temperature 0.6          # docs/results.md, "What a Medusa draft costs"
    python examples/round_costs.py --stack prompt-lookup --temperature 0 --book kjv
"""

from __future__ import annotations

import argparse
import collections
import time

import torch


def timed(owner: type, method: str, label: str, totals: dict) -> None:
    """Wrap ``owner.method`` so that each call adds its count and seconds to ``totals[label]``."""
    inner = getattr(owner, method)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label][0] += 1
            totals[label][1] += time.perf_counter() - start

    setattr(owner, method, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", default="medusa-lookup")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--book", default="prideprejudice")
    parser.add_argument("--context", type=int, default=7500)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-tune", action="store_true", help="the recipe's γ instead of gamma=auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import specstack.drafters as drafters
    import specstack.stack as stacks
    import specstack.verify as verify
    from specstack.autotune import tuned
    from specstack.data import book_tokens
    from specstack.models import load_default_draft, load_target
    from specstack.registry import Registry
    from specstack.sampling import SamplingConfig

    target, tokenizer = load_target(dtype=getattr(torch, args.dtype))
    registry, sampling = Registry.create(), SamplingConfig(temperature=args.temperature)
    recipe = registry.stack_recipe(args.stack)
    draft = load_default_draft(target, dtype=getattr(torch, args.dtype)) if recipe.needs_draft else None
    stack = registry.stack(args.stack, target=target, draft=draft, sampling=sampling)
    prompt = book_tokens(tokenizer, args.context, name=args.book)
    if not args.no_tune:
        print(tuned(stack, prompt, "auto")[0].describe())

    totals: dict = collections.defaultdict(lambda: [0, 0.0])
    timed(type(target), "forward", "target forward", totals)
    timed(stacks.SpeculativeLevel, "round", "round", totals)
    for name in dir(drafters):
        kind = getattr(drafters, name)
        if isinstance(kind, type) and issubclass(kind, drafters.Drafter) and "propose" in vars(kind):
            timed(kind, "propose", f"{name}.propose", totals)
    for kind in (verify.GreedyVerifier, verify.SpeculativeSamplingVerifier, verify.TreeVerifier):
        timed(kind, "verify", f"{kind.__name__}.verify", totals)
    try:
        from specstack_medusa.drafter import MedusaDrafter

        for method in ("propose", "_step", "_candidates"):
            timed(MedusaDrafter, method, f"MedusaDrafter.{method}", totals)
    except ImportError:
        pass

    for seed in args.seeds:
        stack.generate(prompt, 16, seed=seed)
        totals.clear()
        out = stack.generate(prompt, args.tokens, seed=seed, reuse_cache=True)
        print(f"seed {seed}: {len(out.tokens)} tokens in {out.seconds:.2f} s, {1e3 * out.seconds / len(out.tokens):.2f} ms a token")
        for label, (calls, seconds) in sorted(totals.items(), key=lambda item: -item[1][1]):
            print(f"  {label:40s} {calls:5d} calls {seconds:7.3f} s {1e3 * seconds / calls:8.3f} ms a call")
    baseline = registry.stack("autoregressive", target=target, sampling=sampling)
    baseline.generate(prompt, 16, seed=0)
    out = baseline.generate(prompt, args.tokens, seed=0, reuse_cache=True)
    print(f"autoregressive: {1e3 * out.seconds / len(out.tokens):.2f} ms a token")


if __name__ == "__main__":
    main()
