"""The demo: a three-level stack against autoregressive decoding, on identical input."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Sequence

import attrs
import torch

from .errors import whole_number
from .registry import Registry
from .speedup import turns_range
from .policies import StreamingLLM
from .stack import Level, SpeculationStack
from .synthetic import SyntheticLM

if TYPE_CHECKING:
    from .autotune import Tuning


def synthetic_demo(*, max_new_tokens: int, seed: int, device: str = "cpu", draft_device: str | None = None) -> None:
    """TriForce's shape on synthetic models: small draft + StreamingLLM -> mid model -> target; the
    target and the middle model on ``device``, the draft on ``draft_device`` (default: ``device``)."""
    from .run import check_devices

    device, draft_device = check_devices(device, draft_device)
    target = SyntheticLM(vocab_size=32, seed=seed, sharpness=3.0, device=device)
    middle = SyntheticLM(vocab_size=32, seed=seed + 1, base=target, noise=0.3, device=device)
    small = SyntheticLM(vocab_size=32, seed=seed + 2, base=target, noise=0.8, device=draft_device)
    prompt = list(range(1, 17))
    reference = Registry.create().stack("autoregressive", target=target).generate(prompt, max_new_tokens)
    stack = SpeculationStack.build(
        [Level(model=small, policy=StreamingLLM(sinks=4, window=16), name="draft+streaming"),
         Level(model=middle, gamma=2, name="middle"),
         Level(model=target, gamma=6, name="target")],
    )
    result = stack.generate(prompt, max_new_tokens)
    where = f"on {device}" + (f", the draft on {draft_device}" if draft_device != device else "")
    print(f"synthetic models, vocabulary 32, prompt {len(prompt)} tokens, {max_new_tokens} new tokens, greedy, {where}")
    for level in result.levels[1:]:
        print(f"  {level.name:<16} acceptance {level.acceptance_rate:.3f} ({level.accepted}/{level.drafted} drafted tokens, {level.rounds} rounds)")
    print(f"  target forward passes: {result.levels[-1].forward_calls} (autoregressive: {reference.levels[-1].forward_calls})")
    print(f"  output identical to autoregressive greedy: {result.tokens == reference.tokens}")


# The demo's request after its passage. Decoding greedily in fp32 on the default 7,000 tokens the 135M model answers
# it for all 128 tokens with no 8 tokens repeated (2026-11-28; in bf16 it repeats its 19th-26th tokens from its 47th).
# To the summary request the demo made before it repeats from token 59 in fp32, 19 in bf16; the examples' documented
# runs used it.
QUESTION = "What does Elizabeth think of Mr. Darcy in the passage above? Answer in a short paragraph."
SUMMARY = "Summarize the passage above in a few sentences."


@attrs.frozen(kw_only=True)
class DemoRow:
    """One stack's line of the demo: measured against autoregressive decoding in the same process."""

    stack: str
    speedup: float
    ms_per_token: float  # the first turn's (the acceptance and tokens per forward are the first turn's too)
    acceptance: dict[str, float | None]  # level name -> accepted / drafted tokens (None: it drafted nothing)
    tokens_per_target_forward: float
    exactness: str
    identical: bool | None  # greedy runs only
    tuning: dict | None
    speedups: tuple[float, ...] = ()  # with --repeats: each turn's, against autoregressive decoding of the same turn; speedup is their median

    def as_dict(self) -> dict:
        return attrs.asdict(self)

    def with_turn(self, speedup: float) -> "DemoRow":
        """This row after one more turn measured ``speedup``: the speedup the median of all its turns'."""
        from .speedup import median_speedup

        turns = (*(self.speedups or (self.speedup,)), speedup)
        return attrs.evolve(self, speedups=turns, speedup=median_speedup(turns))

    def describe_speedup(self) -> str:
        """``1.21x``, with the range of its turns where it had several: ``1.21x (turns 1.12-1.30)``."""
        spread = turns_range(self.speedups)
        return f"{self.speedup:.2f}x" + (f" (turns {spread[0]:.2f}-{spread[1]:.2f})" if spread else "")

    def describe(self) -> str:
        """The stack's line: its speedup (the median of its turns), then its first turn's time per token, tokens per
        target forward and acceptance (said to be turn 1's where there were more turns: the median's turn may be
        another), and its γ."""
        accept = ", ".join(f"{name} {rate:.2f}" if rate is not None else f"{name} none drafted" for name, rate in self.acceptance.items())
        gammas = f"; {self.tuning['description']}" if self.tuning else ""
        rest = f"{self.tokens_per_target_forward:.2f} tokens per target forward; acceptance {accept}{gammas}"
        if len(self.speedups) > 1:
            return f"{self.stack}: {self.describe_speedup()}; turn 1: {self.ms_per_token:.1f} ms/token, {rest}"
        return f"{self.stack}: {self.describe_speedup()} ({self.ms_per_token:.1f} ms/token), {rest}"


def task_prompt(tokenizer, *, book: str, length: int, request: str = QUESTION) -> list[int]:
    """``length`` tokens of ``book`` followed by ``request`` (the demo's question, or :data:`SUMMARY`), in the
    model's chat format."""
    from .data import book_tokens

    passage = tokenizer.decode(book_tokens(tokenizer, length, name=book))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": f"{passage}\n\n{request}"}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


TASK_ROOM = 64  # tokens of the chat template and the request around the passage


def passage_tokens(args) -> int:
    """``--prompt-tokens``; by default 7,000 (the trained 8K window), or what fills a ``--context`` window."""
    if args.prompt_tokens is not None:
        return whole_number(args.prompt_tokens, "--prompt-tokens")
    return 7000 if args.context is None else args.context - args.max_new_tokens - TASK_ROOM


def triforce_demo(args) -> int:
    """The README's main job: each of ``args.stacks`` (TriForce and the fastest stack on this machine,
    γ tuned by :mod:`specstack.autotune` unless ``--no-tune``) against autoregressive decoding on
    the embedded default, same prompt, same process: speedup, acceptance per level, tokens per
    target forward, and the exactness result."""
    from . import autotune, run
    from .testing.certificate import GreedyReference

    args.repeats = whole_number(args.repeats, "--repeats")  # before any model loads
    run.given_once(args.option)  # an -o key given twice: one line, before any model loads too
    session = run.Session.open(args)
    session.check_draft_taken([run.split_spec(text, "--stacks entry")[0] for text in args.stacks], args)
    if args.prompt_file is not None:
        prompt, source = session.prompt_tokens(prompt=None, prompt_file=args.prompt_file, book=None, length=args.prompt_tokens), args.prompt_file
    else:
        prompt, source = task_prompt(session.tokenizer, book="prideprejudice", length=passage_tokens(args)), "Pride and Prejudice + a question about it"
    sampling = session.sampling
    run.status(f"prompt: {source}, {len(prompt)} tokens; {args.max_new_tokens} new tokens; temperature {sampling.temperature}; "
               f"{session.dtype}; torch threads {torch.get_num_threads()}; device {session.target.device}")
    stacks, modes = {}, {}
    for text in args.stacks:  # bad names and options fail before any decoding
        name, options = _spec(text, args.option)
        options, modes[text] = autotune.auto_options(options)
        stacks[text] = session.stack(name, options)
    autoregressive = session.stack("autoregressive", [])
    run.warm_up(session.registry, session.models, prompt)  # no timed run pays for first-call set-up (as specstack bench warms)
    reference = autoregressive.generate(prompt, args.max_new_tokens, seed=args.seed, progress=run.progress_printer("autoregressive"),
                                        prefill_progress=run.progress_printer("autoregressive: prefill", long_only=True))
    rows, tunings = [], []
    replay = functools.cache(lambda: GreedyReference(session.target, prompt, list(reference.tokens), decoded_by=autoregressive))  # made once, for every stack's certificate
    for name, stack in stacks.items():
        shared = stack.share_prefill(autoregressive, prompt)  # the target's prefill, paid once
        row, tuning = _demo_row(session, name, stack, modes[name] or ("auto" if args.tune else None), args, prompt, reference, shared, replay)
        rows.append(row)
        tunings.append(tuning)
    for turn in range(2, args.repeats + 1):  # each turn: autoregressive decoding, then every stack, against it
        again = autoregressive.generate(prompt, args.max_new_tokens, seed=args.seed, reuse_cache=True, progress=run.progress_printer(f"autoregressive, turn {turn}"))
        rows = [row.with_turn(_turn(stack, tuning, modes[name] == "adaptive", args, prompt, again, f"{name}, turn {turn}"))
                for row, tuning, (name, stack) in zip(rows, tunings, stacks.items())]
    drift = _baseline_drift(autoregressive, prompt, reference, args)
    text = session.tokenizer.decode(list(reference.tokens))
    if args.json:
        print(json.dumps({"prompt": source, "prompt_tokens": len(prompt), "new_tokens": args.max_new_tokens, "dtype": str(session.dtype).removeprefix("torch."),
                          "temperature": sampling.temperature, "coupled": sampling.coupled, "device": str(session.target.device),
                          "autoregressive_ms_per_token": 1e3 * reference.seconds / max(len(reference.tokens), 1),
                          "baseline_again": attrs.asdict(drift),
                          "stacks": [row.as_dict() for row in rows], "text": text}))
        return 0
    coupled = " (coupled)" if sampling.coupled and not sampling.greedy else ""
    print(f"prompt: {source}, {len(prompt)} tokens; {len(reference.tokens)} new tokens; temperature {sampling.temperature}{coupled}; {session.dtype}")
    first = " in turn 1" if args.repeats > 1 else ""
    print(f"autoregressive: {1e3 * reference.seconds / max(len(reference.tokens), 1):.1f} ms/token{first}; {drift.describe(args.repeats)}")
    for row in rows:
        print(row.describe())
        print(f"  exactness: {row.exactness}")
    print("text:", text[:600].replace("\n", " "))
    return 0


@attrs.frozen(kw_only=True)
class BaselineDrift:
    """Autoregressive decoding measured again after every stack, as ``specstack bench`` measures each group's
    baseline again at its end: ``drift`` is its speed then over its speed first. The speedups stay against the
    first measurement; a drift far from 1 says the shared host changed speed while the stacks ran, by about that
    factor in either direction."""

    ms_per_token: float
    drift: float

    def describe(self, turns: int = 1) -> str:
        from .bench.report import DRIFT_NOTED

        again = f"{self.ms_per_token:.1f} ms/token measured again after the stacks (drift {self.drift:.2f})"
        if abs(self.drift - 1) <= DRIFT_NOTED:
            return again
        if turns > 1:
            return f"{again}: the host changed speed by more than {DRIFT_NOTED:.0%} during the run; each turn's speedups are against its own autoregressive run"
        return f"{again}: the host changed speed by more than {DRIFT_NOTED:.0%} during the run, and the speedups with it"


def _speedup(reference, result) -> float:
    """``result``'s decoding speed over ``reference``'s, per token (two :class:`~specstack.types.GenerationResult`)."""
    from .speedup import measured_speedup

    return measured_speedup(reference.seconds, len(reference.tokens), result.seconds, len(result.tokens))


def _baseline_drift(autoregressive, prompt: list[int], reference, args) -> BaselineDrift:
    """The reference's decoding once more, from its own cache of the prompt (no second prefill)."""
    from . import run

    again = autoregressive.generate(prompt, args.max_new_tokens, seed=args.seed, reuse_cache=True, progress=run.progress_printer("autoregressive again"))
    return BaselineDrift(ms_per_token=1e3 * again.seconds / max(len(again.tokens), 1),
                         drift=_speedup(reference, again))


def _spec(text: str, shared: Sequence[str]) -> tuple[str, list[str]]:
    """A ``--stacks`` entry, ``NAME`` or ``NAME:key=value,key=value`` (as ``specstack bench`` takes it), as the
    recipe's name and its options: the ``-o`` options every stack shares, then the entry's own, which win."""
    from .run import given_once, option_key, split_spec

    name, own = split_spec(text, "--stacks entry")
    overridden = {option_key(option) for option in given_once(own)}
    return name, [option for option in shared if option_key(option) not in overridden] + own


def _turn(stack, tuning: "Tuning | None", adaptive: bool, args, prompt: list[int], reference, label: str) -> float:
    """One more turn of a stack (``--repeats``): from its tuned γ again (a retuned generation moved it; and a new
    retuner where it is re-tuned during decoding), its speedup against ``reference``, this turn's autoregressive run."""
    from . import autotune, run

    retuner = None
    if tuning is not None:
        tuning.apply(stack)
        retuner = autotune.Retuner.follow(stack, tuning) if adaptive else None
    result = stack.generate(prompt, args.max_new_tokens, seed=args.seed, reuse_cache=True, progress=run.progress_printer(label), after_round=retuner)
    return _speedup(reference, result)


def _demo_row(session, name: str, stack, tuning_mode: str | None, args, prompt: list[int], reference, shared: bool, replay) -> tuple[DemoRow, "Tuning | None"]:
    """The stack's first turn (tuned first where ``tuning_mode`` says), and the tuning it ran with."""
    from . import autotune, run

    tuning = retuner = None
    if tuning_mode:
        run.status(f"{name}: tuning γ (calibration run and forward timings)")
        tuning, retuner = autotune.tuned(stack, prompt, tuning_mode, seed=args.seed, reuse_cache=shared,
                                         prefill_progress=run.progress_printer(f"{name}: prefill", long_only=True))
        run.status(tuning.describe())
    result = stack.generate(prompt, args.max_new_tokens, seed=args.seed, progress=run.progress_printer(name), reuse_cache=shared or tuning is not None,
                            prefill_progress=run.progress_printer(f"{name}: prefill", long_only=True), after_round=retuner)
    target = result.levels[-1]
    identical = list(result.tokens) == list(reference.tokens) if session.sampling.deterministic else None
    return DemoRow(
        stack=name, speedup=_speedup(reference, result),
        ms_per_token=1e3 * result.seconds / max(len(result.tokens), 1),
        acceptance={level.name: level.as_dict()["acceptance_rate"] for level in result.levels[1:]},  # None: drafted nothing
        tokens_per_target_forward=len(result.tokens) / max(target.forward_calls, 1),
        exactness=_exactness(session, result, identical, replay), identical=identical,
        tuning=None if tuning is None else _tuning_record(tuning, retuner),
    ), tuning


def _tuning_record(tuning, retuner) -> dict:
    """What the demo prints and records of a stack's γ: the tuner's choice and any changes during decoding."""
    from .autotune import described

    record = {**tuning.as_dict(), "description": described(tuning, retuner)}
    if retuner is not None:
        record |= {"retuned": [[emitted, list(gammas)] for emitted, gammas in retuner.history]}
    return record


def _exactness(session, result, identical: bool | None, replay) -> str:
    """fp32 greedy: identical or not; reduced-precision greedy: the bf16 certificate, against ``replay()`` (the
    autoregressive reference replayed, one for every stack: its prefill is paid once); sampled: by construction."""
    if identical is None:
        return "sampled: distributed exactly as the target (tests/test_distribution.py); outputs differ from the baseline's by design"
    if identical:
        return "identical to autoregressive decoding, token for token"
    if session.dtype == torch.float32:
        return "DIFFERS from autoregressive decoding in float32: a bug, please report it"
    hint = "" if session.widen_bf16 else "; --widen-bf16 gives every verify token the step's logits, bit for bit"
    if not session.sampling.greedy:  # coupled: the certificate reads margins of greedy decoding, not of the race
        return f"coupled: differs from autoregressive decoding in reduced precision (the certificate covers greedy decoding only{hint})"
    return replay().certify(list(result.tokens)).describe() + hint
