"""``specstack quality``: what a longer window costs the target in quality (docs/long-context.md).

* :func:`perplexity_by_position` — one pass of a text through the target with its full cache, the
  next-token negative log-likelihood of every token summed per position bucket. A model that uses
  a longer context well predicts later tokens at least as well as earlier ones; one pushed beyond
  what its RoPE was trained on falls apart past that position.
* :func:`passkey` — passkey retrieval (Mohtashami & Jaggi, 2023) with the ``needle`` task's prompt
  (specstack/bench/tasks.py) and greedy decoding: can the model read back a key hidden at a depth?

Both take a :class:`~specstack.hf.HFCausalLM` whose window was set by ``--context`` and
``--rope-scaling`` (:func:`specstack.hf.load_model`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Sequence

import attrs
import torch
import torch.nn.functional as F

from ..data import BOOKS
from ..errors import SpecstackError, whole_number
from ..run import torch_threads

CHUNK = 2048  # tokens per forward: at most one [CHUNK, V] block of logits is held at a time
PASSKEY_TOKENS = 12  # greedy tokens decoded after the passkey question
DEFAULT_DEPTHS = (0.25, 0.75)
SCALINGS = ("yarn", "linear", "extrapolate", "none")


@attrs.frozen(kw_only=True)
class Bucket:
    """The next-token negative log-likelihood (nats, summed) of the ``tokens`` predicted tokens at
    positions ``start`` … ``end - 1`` (position 0 has no prediction)."""

    start: int
    end: int
    tokens: int
    nll: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    def as_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "tokens": self.tokens, "nll": self.nll, "perplexity": self.perplexity}


@attrs.frozen(kw_only=True)
class PasskeyResult:
    """One passkey prompt of ``length`` tokens, the key at relative ``depth``; ``answer`` is the
    decoded greedy continuation, ``found`` whether it contains the key."""

    length: int
    depth: float
    key: int
    answer: str
    found: bool

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def check_edges(edges: Sequence[int], length: int) -> tuple[int, ...]:
    """``edges`` as bucket ends: increasing integers, the first >= 2 (a bucket predicts a token), the
    last at most ``length``."""
    edges = tuple(edges)
    if not edges:
        raise SpecstackError("no bucket edges given; give increasing token positions, e.g. 1024 2048")
    if any(not isinstance(e, int) or isinstance(e, bool) for e in edges):
        raise SpecstackError(f"bucket edges {list(edges)} are not all integers")
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise SpecstackError(f"bucket edges {list(edges)} are not increasing")
    if edges[0] < 2:
        raise SpecstackError(f"bucket edge {edges[0]} is too small; the first bucket must end at position 2 or later")
    if edges[-1] > length:
        raise SpecstackError(f"bucket edge {edges[-1]} is beyond the {length} tokens given")
    return edges


def perplexity_by_position(model, tokens: Sequence[int], edges: Sequence[int], *, chunk: int = CHUNK, progress=None) -> tuple[Bucket, ...]:
    """One pass of ``tokens[:edges[-1]]`` through ``model`` (full cache, ``chunk`` tokens per forward):
    bucket i sums -log p(token t | tokens before t) over t in [edges[i-1], edges[i]), bucket 0 from t = 1."""
    from ..model import CachedModel
    from ..policies import FullCache
    from ..types import LevelStats

    tokens = [int(t) for t in tokens]
    edges = check_edges(edges, len(tokens))
    if chunk < 1:
        raise SpecstackError(f"chunk {chunk} is not allowed; use an integer >= 1")
    if edges[-1] > model.max_length:
        raise SpecstackError(f"{edges[-1]} tokens do not fit the model's window of {model.max_length}; use a larger --context")
    level = CachedModel(model=model, policy=FullCache(), stats=LevelStats(name="quality"))
    nll = torch.zeros(edges[-1], dtype=torch.float64)  # [n]; nll[t] = -log p(token t | before t), nll[0] = 0
    targets = torch.tensor(tokens[: edges[-1]], dtype=torch.long)  # [n]
    with torch.inference_mode():
        for start in range(0, edges[-1], chunk):
            end = min(start + chunk, edges[-1])
            nll[start + 1 : end + 1] = _chunk_nll(level, tokens[:end], end - start, targets[start + 1 : end + 1])
            if progress is not None:
                progress(end, edges[-1])
    return _buckets(nll, edges)


def _chunk_nll(level, prefix: list[int], size: int, targets: torch.Tensor) -> torch.Tensor:
    """[m] float64: -log p of ``targets`` (the m <= size tokens after each of the last ``size`` of ``prefix``)."""
    logits = level.logits(prefix, size)[: len(targets)]  # [m, V]; the last row of the last chunk predicts nothing
    return F.cross_entropy(logits.float(), targets.to(logits.device), reduction="none").double().cpu()  # [m]


def _buckets(nll: torch.Tensor, edges: tuple[int, ...]) -> tuple[Bucket, ...]:
    starts = (0, *edges[:-1])
    return tuple(Bucket(start=a, end=b, tokens=b - max(a, 1), nll=float(nll[a:b].sum())) for a, b in zip(starts, edges))


def total(buckets: Sequence[Bucket]) -> Bucket:
    """All ``buckets`` (consecutive) as one."""
    return Bucket(start=buckets[0].start, end=buckets[-1].end, tokens=sum(b.tokens for b in buckets), nll=sum(b.nll for b in buckets))


def passkey(model, tokenizer, length: int, depth: float, seed: int = 0, *, book: str = "kjv", offset: int = 0) -> PasskeyResult:
    """The ``needle`` task's prompt of ``length`` tokens (filler from ``book``), answered by greedy
    decoding of :data:`PASSKEY_TOKENS` tokens with the target alone."""
    from .. import Registry
    from .tasks import Books, task_by_name

    prompt = task_by_name("needle").prompt(Books(tokenizer), length, seed, {"book": book, "offset": offset, "depth": depth})
    if len(prompt.tokens) + PASSKEY_TOKENS > model.max_length:
        raise SpecstackError(f"a passkey prompt of {length} tokens and {PASSKEY_TOKENS} answer tokens does not fit the model's window "
                             f"of {model.max_length}; use a larger --context")
    stack = Registry.create().stack("autoregressive", target=model)
    with torch.inference_mode():
        result = stack.generate(list(prompt.tokens), PASSKEY_TOKENS)
    answer = tokenizer.decode(list(result.tokens))
    return PasskeyResult(length=length, depth=depth, key=prompt.info["key"], answer=answer, found=bool(prompt.score(answer)))


# -- the command ------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Options:
    book: str
    offset: int
    tokens: int
    edges: tuple[int, ...]
    context: int | None
    rope_scaling: str | None
    dtype: str
    threads: int | None
    passkey: tuple[int, ...]
    depths: tuple[float, ...]
    seed: int


def add_quality_parser(commands) -> argparse.ArgumentParser:
    """Add the ``quality`` subcommand to ``commands`` (an argparse subparsers object). Numbers are
    read as text and checked in :func:`options`, so that a bad one is a one-line error."""
    quality = commands.add_parser("quality", help="perplexity by position and passkey retrieval of the embedded default over a long window",
                                  description="Perplexity of a shipped book per position bucket, one pass with the full cache, and "
                                              "optionally passkey retrieval, with the target's window set by --context/--rope-scaling.")
    quality.add_argument("--book", default="kjv", help=f"the text: {', '.join(BOOKS)} (default: kjv, held out from every shipped model)")
    quality.add_argument("--offset", default="0", metavar="N", help="tokens into the book to start at (default: 0)")
    quality.add_argument("--tokens", default="8192", metavar="N", help="tokens of perplexity text; 0 skips perplexity (default: 8192)")
    quality.add_argument("--edges", nargs="+", default=None, metavar="N",
                         help="bucket ends in tokens, increasing, the last at most --tokens (default: 1024, doubling, then --tokens)")
    quality.add_argument("--context", default=None, metavar="N", help="the target's window in tokens (default: its trained one)")
    quality.add_argument("--rope-scaling", default="yarn", choices=SCALINGS,
                         help="how a --context beyond the trained window stretches RoPE (default: yarn; extrapolate: RoPE as trained, "
                              "for measuring; none: refuse such a context)")
    quality.add_argument("--dtype", default="float32", help="weights and KV cache: float32 (default) or bfloat16")
    quality.add_argument("--threads", default=None, metavar="N", help="torch intra-op threads (default: torch's choice)")
    quality.add_argument("--passkey", nargs="+", default=[], metavar="LENGTH", help="passkey prompt lengths in tokens (default: none)")
    quality.add_argument("--depths", nargs="+", default=[str(d) for d in DEFAULT_DEPTHS], metavar="D",
                         help=f"passkey depths in [0, 1] (default: {' '.join(map(str, DEFAULT_DEPTHS))})")
    quality.add_argument("--seed", default="0", metavar="N", help="the passkey's seed (default: 0)")
    quality.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    quality.set_defaults(run=run_quality)
    return quality


def _depth(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise SpecstackError(f"--depths {text!r} is not allowed; use a number in [0, 1]")
    return value


def default_edges(tokens: int) -> tuple[int, ...]:
    """1024, 2048, 4096, … below ``tokens``, then ``tokens``."""
    edges, edge = [], 1024
    while edge < tokens:
        edges.append(edge)
        edge *= 2
    return (*edges, tokens)


def options(args: argparse.Namespace) -> Options:
    """The checked options of ``specstack quality``; a bad one is a :class:`SpecstackError`."""
    from ..floor import dtype_name

    if args.book not in BOOKS:
        raise SpecstackError(f"unknown book {args.book!r}; available: {', '.join(BOOKS)}")
    tokens = whole_number(args.tokens, "--tokens", minimum=0)
    given = [whole_number(e, "--edges") for e in args.edges] if args.edges else None
    edges = () if tokens == 0 else check_edges(given or default_edges(tokens), tokens)
    if tokens == 0 and not args.passkey:
        raise SpecstackError("nothing to measure; give --tokens N >= 2 or --passkey LENGTH")
    return Options(book=args.book, offset=whole_number(args.offset, "--offset", minimum=0), tokens=tokens, edges=edges,
                   context=None if args.context is None else whole_number(args.context, "--context"),
                   rope_scaling=None if args.rope_scaling == "none" else args.rope_scaling, dtype=dtype_name(args.dtype),
                   threads=None if args.threads is None else whole_number(args.threads, "--threads"),
                   passkey=tuple(whole_number(n, "--passkey") for n in args.passkey), depths=tuple(_depth(d) for d in args.depths),
                   seed=whole_number(args.seed, "--seed", minimum=0))


def run_quality(args: argparse.Namespace, loaded=None) -> int:
    """``specstack quality``; ``loaded`` = (model, tokenizer) replaces the embedded default (tests)."""
    opts = options(args)  # before any weights are read
    with torch_threads(opts.threads):
        record = _measure(opts, loaded)
    print(json.dumps(record) if args.json else "\n".join(report(record)))
    return 0


def _measure(opts: Options, loaded) -> dict:
    """The record of one ``quality`` run: perplexity buckets and passkey answers."""
    from ..floor import DTYPES
    from ..run import status
    from .runner import peak_rss_mb

    if loaded is None:
        from transformers.utils import logging as hf_logging

        from ..models import load_default

        hf_logging.disable_progress_bar()
        status("loading the embedded default")
        model, _, tokenizer = load_default(dtype=DTYPES[opts.dtype], with_draft=False, context=opts.context, rope_scaling=opts.rope_scaling)
    else:
        model, tokenizer = loaded
    record = {"book": opts.book, "offset": opts.offset, "context": model.max_length, "rope_scaling": opts.rope_scaling if opts.context else None,
              "dtype": opts.dtype, "threads": torch.get_num_threads(), "perplexity": None, "passkey": []}
    if opts.tokens:
        record["perplexity"] = _measure_perplexity(model, tokenizer, opts)
    for length in opts.passkey:
        for depth in opts.depths:
            began = time.perf_counter()
            result = passkey(model, tokenizer, length, depth, opts.seed, book=opts.book, offset=opts.offset)
            record["passkey"].append({**result.as_dict(), "seconds": time.perf_counter() - began, "peak_mib": peak_rss_mb()})
            status(f"passkey {length} tokens, depth {depth}: {'found' if result.found else 'missed'} {result.key} in {result.answer!r}")
    return record


def _measure_perplexity(model, tokenizer, opts: Options) -> dict:
    from ..run import status
    from .runner import peak_rss_mb
    from .tasks import Books

    text = Books(tokenizer).tokens(opts.book, opts.tokens, opts.offset)
    status(f"perplexity of {opts.tokens} tokens of {opts.book} from token {opts.offset}, window {model.max_length}")
    began = time.perf_counter()
    buckets = perplexity_by_position(model, text, opts.edges, progress=lambda done, n: status(f"perplexity: {done}/{n} tokens"))
    return {"buckets": [b.as_dict() for b in buckets], "all": total(buckets).as_dict(),
            "seconds": time.perf_counter() - began, "peak_mib": peak_rss_mb()}


def report(record: dict) -> list[str]:
    """The markdown tables of one ``quality`` record."""
    scaling = record["rope_scaling"] or "none"
    lines = [f"{record['book']} from token {record['offset']}, window {record['context']} (rope scaling: {scaling}), "
             f"{record['dtype']}, {record['threads']} thread(s)"]
    if record["perplexity"]:
        ppl = record["perplexity"]
        lines += ["", "| positions | tokens | perplexity |", "| --- | ---: | ---: |"]
        lines += [f"| {b['start']}-{b['end']} | {b['tokens']} | {b['perplexity']:.3f} |" for b in (*ppl["buckets"], ppl["all"])]
        lines += ["", f"{ppl['seconds']:.1f} s, peak memory {ppl['peak_mib']:.0f} MiB"]
    if record["passkey"]:
        lines += ["", "| length | depth | key | found | answer |", "| ---: | ---: | ---: | --- | --- |"]
        lines += [f"| {p['length']} | {p['depth']} | {p['key']} | {'yes' if p['found'] else 'no'} | {_cell(p['answer'])} |"
                  for p in record["passkey"]]
    return lines


def _cell(text: str) -> str:
    """``text`` quoted for one markdown table cell (a ``|`` of a chat template would end the cell)."""
    return json.dumps(text).replace("|", "\\|")
