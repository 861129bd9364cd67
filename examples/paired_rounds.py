"""Two drafts on identical rounds: what drawn Medusa candidates (``-o draft_temperature=T``) buy over top ranks, a
union of prompt lookup's chain and the heads' tree (``-o first_only=false``) over ``medusa-lookup``'s first proposal,
other heads (``--compare heads --other-heads FILE``) over the stack's, or EAGLE's draft layer (``--compare eagle``)
over the stack's heads.

Whole runs compare different texts: every seed, and every stack, samples its own, and six seeds a text did not resolve
the difference (docs/results.md, "Drawn candidates by default?"). Here one stack decodes as usual with the heads'
top ranks, verified by the token-tree rule, and at every round of the top level the same drafter also draws a tree on
the same prefix at the stack's temperature (its own generator, so the text is the ranks' run's), the target scores
that tree in a forward of its own (dropped before the real one), and both trees' expected emitted tokens are
computed exactly from the target's distributions p at their nodes:

    E = 1 + sum over nodes of prod over the node's path of P(the verifier descends into that child)

with the token-tree rule's P (p(x), the first child of each token) for the ranks and Sequoia's (min(1, p(x) / q(x))
after the siblings tried before; :func:`specstack.verify.expected_emitted`) for the draws. Where prompt lookup's
chain is the draft (``medusa-lookup``) the two are the same draft (a merged draft is a tree either way, so those
rounds are scored too, and come out equal). Both trees are priced by the one calibration of
the ranks' run (a drawn run would calibrate on its own verdicts), and at T < 1 a draw's rank probabilities, taken at
τ = T, are sharper than the ranks' at 1, so the priced drawn trees come out larger. ``--shape fixed`` compares trees of
one shape instead: no pricing, ``min_prob`` 0, every node of the heads' rank tree of ``tree_size`` nodes. Each propose is
timed, so the two drafts' costs come with their tokens.

    python examples/paired_rounds.py                          # medusa-lookup and medusa-chain, T = 0.6
    python examples/paired_rounds.py --shape fixed            # both trees of the same 4 nodes
    python examples/paired_rounds.py --stacks medusa --seeds 0 --max-new-tokens 64
    python examples/paired_rounds.py --compare union --stacks medusa-lookup

With ``--compare union`` the alternative on each prefix is the merged draft with ``first_only`` off: where lookup
matched, its chain and the heads' tree together (one trie), else the heads' tree alone as in the real round; both
are deterministic and judged by the token-tree rule.

With ``--compare heads`` the alternative is the same drafter with the heads of ``--other-heads`` (a file from
``specstack train medusa``) in place of the stack's, reading the same hidden states, taking top ranks, and judged by
the token-tree rule. It takes ``--shape fixed``: a priced tree is sized by the calibration of the heads whose
verdicts it observes, the stack's own.

    python examples/paired_rounds.py --compare heads --other-heads /tmp/heads.safetensors --shape fixed

With ``--compare eagle`` the alternative is the EAGLE drafter (:mod:`specstack_medusa.eagle_drafter`) with the heads
drafter's options, its layer the shipped one or ``--other-heads`` (a file from ``specstack train eagle``), reading the
same hidden states, taking top ranks, judged by the token-tree rule; ``--shape fixed`` too (trees of as many nodes,
each shaped by its own draft's measured accuracies).

    python examples/paired_rounds.py --compare eagle --shape fixed --temperature 0

``--heads`` gives every stack other heads of its own (a file or a shipped name), for any alternative:

    python examples/paired_rounds.py --heads /tmp/heads.safetensors --shape fixed   # those heads' draws against their ranks
"""

from __future__ import annotations

import argparse
import contextlib
import time

import attrs
import torch

from specstack import LevelStats, Registry, SamplingConfig, SpeculationStack
from specstack.autotune import tuned
from specstack.demo import QUESTION, task_prompt
from specstack.models import load_default
from specstack.stack import SpeculativeLevel, row_positions
from specstack.verify import SequoiaVerifier, TokenTreeVerifier, expected_emitted


@attrs.define(eq=False)
class Paired:
    """The top level's rounds, each with both drafts' expected tokens, sizes and drafting times (the real round's and the
    other's)."""

    rounds: list[dict] = attrs.field(factory=list)

    def table_row(self) -> str:
        rounds, trees = self.rounds, [r for r in self.rounds if r["other"] is not None]
        for r in rounds:
            r["either"] = r["ranks"] if r["other"] is None else r["other"]  # an alternative chain is the real round's chain
        ranks, other = _mean("ranks", rounds), _mean("either", rounds)
        return (f"{len(rounds)} ({len(trees)}) | {_mean('rank_nodes', rounds):.2f}, {_mean('other_nodes', rounds):.2f} | "
                f"{ranks:.3f} | {other:.3f} | {other / ranks:.3f} ({_mean('other', trees) / max(_mean('ranks', trees), 1e-9):.3f}) | "
                f"{_mean('rank_ms', rounds):.2f}, {_mean('other_ms', rounds):.2f}")


def _mean(key: str, rows: list[dict]) -> float:
    return sum(r[key] for r in rows) / max(len(rows), 1)


@attrs.define(eq=False)
class RecordingTokenTree(TokenTreeVerifier):
    """The token-tree rule, completing each round of ``paired`` with the ranks' expected tokens for the draft it judges."""

    paired: Paired = attrs.field(factory=Paired)

    def verify(self, draft, p, generator):
        if self.paired.rounds and "ranks" not in self.paired.rounds[-1]:
            self.paired.rounds[-1]["ranks"] = expected_emitted(self, draft, p)
        return super().verify(draft, p, generator)


def heads_of(drafter):
    """The Medusa drafter at level 0 (alone, or a part of a merged draft)."""
    return next(part for part in getattr(drafter, "parts", (drafter,)) if part.name == "medusa")


@contextlib.contextmanager
def drawn(level: SpeculativeLevel, sampling: SamplingConfig, generator: torch.Generator):
    """Within: the heads (built to follow the stack's temperature) draw their candidates at ``sampling``'s, with
    ``generator``; outside they take their top ranks, as for a deterministic stack."""
    heads = heads_of(level.drafter)
    heads.attach_sampling(sampling, generator)
    try:
        yield
    finally:
        heads.attach_sampling(SamplingConfig(), generator)


@contextlib.contextmanager
def union(level: SpeculativeLevel):
    """Within: the merged draft is the union of its parts' (``first_only`` off)."""
    merged = level.drafter
    kept, merged.first_only = merged.first_only, False
    try:
        yield
    finally:
        merged.first_only = kept


@contextlib.contextmanager
def drafting_with(level: SpeculativeLevel, drafter):
    """Within: level 0 is ``drafter``."""
    kept, level.drafter = level.drafter, drafter
    try:
        yield
    finally:
        level.drafter = kept


def with_other_heads(level: SpeculativeLevel, path: str):
    """Level 0's drafter with the heads in ``path`` in place of its own (alone, or as a merged draft's part), reading
    the hidden states of the level's model and taking top ranks."""
    heads = heads_of(level.drafter)
    other = attrs.evolve(heads, heads=path, stats=LevelStats(name="medusa"))
    other.attach_hidden_states(level.lm.open_hidden_channel())
    other.attach_sampling(SamplingConfig(), torch.Generator())
    if level.drafter is heads:
        return other
    return attrs.evolve(level.drafter, parts=[other if part is heads else part for part in level.drafter.parts])


def with_eagle(registry, level: SpeculativeLevel, path: str | None):
    """Level 0's drafter with an EAGLE drafter (the layer in ``path``, else the shipped one) in place of its heads, with
    their options, reading the hidden states of the level's model and taking top ranks."""
    heads = heads_of(level.drafter)
    eagle = registry.drafter("eagle", vocab=heads.vocab, heads=path or "eagle", tree_size=heads.tree_size, top_k=heads.top_k,
                             min_prob=heads.min_prob)
    eagle.attach_hidden_states(level.lm.open_hidden_channel())
    eagle.attach_sampling(SamplingConfig(), torch.Generator())
    if level.drafter is heads:
        return eagle
    return attrs.evolve(level.drafter, parts=[eagle if part is heads else part for part in level.drafter.parts])


def timed_propose(level: SpeculativeLevel, prefix, k: int, variant):
    """Level 0's draft on ``prefix`` within ``variant`` (None: as the stack drafts), and its seconds."""
    with variant or contextlib.nullcontext():
        began = time.perf_counter()
        return level.drafter.propose(prefix, k).head(k).stop_at(level.stop_tokens), time.perf_counter() - began


def paired_round(level: SpeculativeLevel, prefix, k: int, alternative, verifier, paired: Paired) -> None:
    """Before the real round: both drafts on ``prefix`` (timed, in alternating order, since the first after a forward
    reads the heads' weights from memory), and the alternative (made within the context ``alternative()``) scored by
    the level's model and judged by ``verifier``."""
    first_alternative = len(paired.rounds) % 2 == 0
    made = {}
    for which in ((True, False) if first_alternative else (False, True)):
        made[which] = timed_propose(level, prefix, k, alternative() if which else None)
    (other, other_seconds), (ranked, rank_seconds) = made[True], made[False]
    row = {"rank_nodes": len(ranked), "other_nodes": len(other), "rank_ms": rank_seconds * 1e3, "other_ms": other_seconds * 1e3, "other": None}
    if other.is_tree:
        p = level.warp(level.lm.tree_logits(prefix, other), row_positions(len(prefix), other))  # [k+1, V]
        row["other"] = expected_emitted(verifier, other, p)
    paired.rounds.append(row)


def compared_stack(registry, name: str, target, sampling, stops, seed: int, options: dict):
    """The stack ``name`` with the heads' top ranks, its top level's verifier recording the ranks' expected tokens. The
    heads follow the stack's temperature (``draft_temperature=follow``), attached as for a deterministic stack but
    within :func:`drawn`."""
    levels = registry.stack_recipe(name).levels(registry, target=target, draft_temperature="follow", **options)
    recorder = RecordingTokenTree()
    levels = [*levels[:-1], attrs.evolve(levels[-1], verifier=recorder)]
    stack = SpeculationStack.build(levels, sampling=sampling, stop_tokens=stops, seed=seed)
    heads_of(stack.top.drafter).attach_sampling(SamplingConfig(), torch.Generator())  # top ranks in the real rounds
    return stack, recorder.paired


def run(registry, name: str, prompt, target, sampling, stops, seed: int, max_new_tokens: int, shape: str, compare: str,
        other_heads_path: str | None = None, heads: str | None = None) -> Paired:
    """One generation of ``name`` (with ``heads``, else its own) with top ranks, every top-level round paired with the
    alternative on its prefix."""
    options = {**({"min_prob": 0} if shape == "fixed" else {}), **({"heads": heads} if heads else {})}
    stack, paired = compared_stack(registry, name, target, sampling, stops, seed, options)
    if shape == "priced":
        tuned(stack, prompt, "auto", seed=seed)  # γ and the heads' prices, before the recording starts
    paired.rounds.clear()
    top, draws, original = stack.top, torch.Generator().manual_seed(1000 + seed), SpeculativeLevel.round
    if compare == "union" and not hasattr(top.drafter, "first_only"):
        raise SystemExit(f"--compare union needs a merged draft at level 0 (medusa-lookup); {name} has {top.drafter.name}")
    if compare in ("heads", "eagle"):
        other = with_other_heads(top, other_heads_path) if compare == "heads" else with_eagle(registry, top, other_heads_path)
        alternative, verifier = (lambda: drafting_with(top, other)), TokenTreeVerifier()
    else:
        alternative, verifier = {"drawn": (lambda: drawn(top, sampling, draws), SequoiaVerifier()),
                                 "union": (lambda: union(top), TokenTreeVerifier())}[compare]

    def round_(level, prefix, k):
        if level is top and k:
            paired_round(level, prefix, k, alternative, verifier, paired)
        return original(level, prefix, k)

    SpeculativeLevel.round = round_
    try:
        stack.generate(prompt, max_new_tokens, seed=seed)
    finally:
        SpeculativeLevel.round = original
    paired.rounds = [r for r in paired.rounds if "ranks" in r]  # a round the stack ended before verifying
    return paired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stacks", nargs="+", default=["medusa-lookup", "medusa-chain"])
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--books", nargs="+", default=["prideprejudice", "kjv"])
    parser.add_argument("--prompt-tokens", type=int, default=7000)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", choices=["priced", "fixed"], default="priced",
                        help="priced: gamma=auto, as the bench runs them; fixed: every node of the rank tree, in both")
    parser.add_argument("--compare", choices=["drawn", "union", "heads", "eagle"], default="drawn",
                        help="the alternative: the heads' candidates drawn at T, the union of lookup's chain and the heads' tree, "
                             "the heads of --other-heads, or EAGLE's draft layer")
    parser.add_argument("--other-heads", help="with --compare heads: a heads file (.safetensors) from `specstack train medusa`; "
                                              "with --compare eagle: a layer file from `specstack train eagle` (default: the shipped layer)")
    parser.add_argument("--heads", help="the stacks' own heads (a file or a shipped name); default: each stack's")
    args = parser.parse_args()
    if (args.compare == "heads" and not args.other_heads) or (args.other_heads and args.compare not in ("heads", "eagle")) \
            or (args.compare in ("heads", "eagle") and args.shape != "fixed"):
        parser.error("--compare heads takes --other-heads FILE and --shape fixed, --compare eagle --shape fixed; "
                     "--other-heads goes with those only")
    torch.set_num_threads(args.threads)
    target, _, tokenizer = load_default(dtype=torch.bfloat16)
    registry, stops = Registry.create(), [tokenizer.eos_token_id]
    sampling = SamplingConfig(temperature=args.temperature)
    heads_named = args.heads or "each stack's own"
    print(f"bfloat16, T = {args.temperature}, alternative: {args.compare}{' (draws at τ = T)' if args.compare == 'drawn' else ''}{f' ({args.other_heads})' if args.other_heads else ''}, "
          f"heads: {heads_named}, {args.prompt_tokens}-token passages, {args.max_new_tokens} tokens, "
          f"seeds {args.seeds}, " + ("gamma=auto (the ranks' calibration prices both trees)" if args.shape == "priced" else "every node of the rank tree"))
    print(f"book | stack | seed | rounds ({args.compare} trees scored) | nodes a round: ranks, {args.compare} | tokens a round: ranks | "
          f"{args.compare} | {args.compare} / ranks (trees only) | a propose, ms: ranks, {args.compare}")
    for book in args.books:
        prompt = task_prompt(tokenizer, book=book, length=args.prompt_tokens, request=QUESTION)
        for name in args.stacks:
            for seed in args.seeds:
                paired = run(registry, name, prompt, target, sampling, stops, seed, args.max_new_tokens, args.shape, args.compare, args.other_heads, args.heads)
                print(f"{book} | {name} | {seed} | {paired.table_row()}", flush=True)


if __name__ == "__main__":
    main()
