"""``specstack plan-tree``: measure acceptance and costs on this machine, print Sequoia's tree."""

from __future__ import annotations

import argparse
import random
import sys

from specstack import SamplingConfig, SpecstackError, StreamingLLM

from .planner import Plan, measure_costs, plan_tree, positional_acceptance

SYNTHETIC_VOCAB = 32


class PlanTreeCommand:
    """Registered through ``specstack_commands``: the ``plan-tree`` subcommand."""

    name = "plan-tree"
    help = "measure positional acceptance and forward costs, then choose a Sequoia tree (hardware-aware)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--target", help="target model: a transformers directory or .gguf file (default: embedded SmolLM2-135M)")
        parser.add_argument("--draft", help="draft model (default: the shipped distilled draft)")
        parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and KV cache dtype")
        parser.add_argument("--book", default=None, help="the shipped book whose opening is the context (default: prideprejudice)")
        parser.add_argument("--prompt-tokens", type=int, default=None, help="context length (default: 2048; 64 with --synthetic)")
        parser.add_argument("--max-size", type=int, default=32, help="the most draft nodes a tree may have")
        parser.add_argument("--max-depth", type=int, default=8, help="the deepest tree considered")
        parser.add_argument("--width", type=int, default=8, help="star width for measuring the acceptance vector p_1..p_W")
        parser.add_argument("--new-tokens", type=int, default=128, help="tokens decoded to measure the acceptance vector")
        parser.add_argument("--draft-window", type=int, default=256, help="the draft's StreamingLLM window, as in the sequoia stack")
        parser.add_argument("--sinks", type=int, default=16, help="the draft's StreamingLLM sinks")
        parser.add_argument("--temperature", type=float, default=0.0)
        parser.add_argument("--top-p", type=float, default=1.0)
        parser.add_argument("--top-k", type=int, default=None)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
        parser.add_argument("--synthetic", action="store_true", help="synthetic models (no weights; seconds)")

    def run(self, args: argparse.Namespace) -> int:
        for flag in ("max_size", "max_depth", "width", "new_tokens", "prompt_tokens", "draft_window"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise SpecstackError(f"--{flag.replace('_', '-')} {value} is not allowed; use an integer >= 1")
        target, draft, prompt, stops, sampling = _synthetic(args) if args.synthetic else _real(args)
        policy = StreamingLLM(sinks=args.sinks, window=args.draft_window)
        acceptance = positional_acceptance(target, draft, prompt, width=args.width, new_tokens=args.new_tokens, sampling=sampling,
                                           draft_policy=policy, stop_tokens=stops, seed=args.seed)
        sizes = sorted({1 << i for i in range(args.max_size.bit_length())} | {args.max_size})
        costs = measure_costs(target, draft, prompt, sizes=sizes, draft_width=args.width, draft_policy=policy)
        plan = plan_tree(acceptance, max_size=args.max_size, max_depth=args.max_depth, costs=costs)
        print(_report(plan, costs, len(prompt)))
        return 0


def _synthetic(args):
    from specstack.synthetic import SyntheticLM

    target = SyntheticLM(vocab_size=SYNTHETIC_VOCAB, seed=args.seed, sharpness=2.0)
    draft = SyntheticLM(vocab_size=SYNTHETIC_VOCAB, seed=args.seed + 1, base=target, noise=0.7)
    rng = random.Random(args.seed)
    prompt = [rng.randrange(SYNTHETIC_VOCAB) for _ in range(args.prompt_tokens or 64)]
    return target, draft, prompt, (), SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)


def _real(args):
    from specstack.data import DEFAULT_BOOK
    from specstack.run import Session

    session = Session.open(args)
    prompt = session.prompt_tokens(prompt=None, prompt_file=None, book=args.book or DEFAULT_BOOK, length=args.prompt_tokens or 2048)
    eos, draft = session.tokenizer.eos_token_id, session.draft
    print("[specstack] measuring acceptance and forward costs", file=sys.stderr, flush=True)
    return session.target, draft, prompt, ([eos] if eos is not None else []), session.sampling


def _report(plan: Plan, costs, context: int) -> str:
    shape = plan.shape
    verify = ", ".join(f"{n}: {1000 * s:.2f}" for n, s in zip(costs.verify_sizes, costs.verify_seconds))
    return "\n".join([
        f"positional acceptance p_1..p_{len(plan.acceptance)}: {' '.join(f'{p:.3f}' for p in plan.acceptance)}",
        f"verify forward over {context} cached tokens, ms by tree size: {verify}",
        f"draft forward per depth: {1000 * costs.draft_seconds:.2f} ms",
        f"tree: {shape.size} nodes, depth {shape.depth}, widths per depth {','.join(map(str, shape.nodes_per_depth))}",
        f"parents: {','.join(map(str, shape.parents))}",
        f"expected accepted tokens per round: {plan.expected_accepted:.3f} ({plan.tokens_per_round:.3f} emitted)",
        f"predicted: {plan.tokens_per_second:.1f} tokens/s ({1000 * plan.round_seconds:.2f} ms per round)",
        f"use it: -o tree={shape.spec}",
    ])
