"""``specstack floor``: the forward cost of each TriForce level against this machine's floor.

Measures the machine's roofs (:func:`specstack.floor.measure_machine`), then times
``HFCausalLM.forward`` of T new tokens (a chain, or with ``--tree`` a token tree of T tokens) for
each kind of forward a TriForce round makes on the embedded default:

- ``full``: the target over its full cache of each ``--cache`` length (L2, and autoregressive decoding),
- ``retrieval``: the target over a retrieval view of ``--budget`` slots (L1),
- ``draft``: the draft over its StreamingLLM window of ``--window`` slots (L0, cache-relative positions).

Each KV store is filled with random keys and values written straight into it (ascending positions:
no prefill), and rolled back with ``truncate`` after every forward, so every repeat runs over the
same cache length. Each figure is the median of ``--repeats`` forwards after one warm-up, with a
fresh :class:`~specstack.batch.TokenBatch` each time, the model's weights held as a generation holds
them (:func:`specstack.model.weights_held`: checked once, not before every forward), and is reported as a
ratio to :func:`specstack.floor.forward_floor`. See docs/benchmarks.md, "Forward cost against the floor".

The read bandwidth is measured again before each timed turn of every level and cache length
(:class:`specstack.floor.BandwidthProbe`), and that level's floors take the median of those readings: on a
shared machine whose bandwidth moves from minute to minute, a forward is priced at what the machine could
read while it ran, not at a reading taken minutes before (docs/benchmarks.md, "The floor read beside its
forwards"). The GEMM peaks are measured once, at the start.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Callable, Sequence

import attrs
import numpy as np
import torch

from ..errors import SpecstackError, whole_number
from ..floor import DTYPES, BandwidthProbe, Floor, Machine, ModelShape, dtype_name, forward_floor, measure_machine
from ..model import weights_held
from ..run import WIDEN_BF16_HELP, status, torch_threads, widen_bf16, widening_asked
from ..speedup import chain_ceiling

LEVELS = {"full": "L2 target+full", "retrieval": "L1 target+retrieval", "draft": "L0 draft+streaming"}
CACHES = (1024, 4096, 7500)
TOKENS = (1, 2, 4, 8, 16, 32, 64)
BUDGET = 512  # TriForce's retrieval budget on the embedded default (docs/benchmarks.md)
WINDOW = 272  # the draft's StreamingLLM window: 256 recent + 16 sinks
ACCEPTANCES = (0.7, 0.8, 0.9, 0.95)  # per-token acceptances at which the report prices a chain (ceilings)


@attrs.frozen(kw_only=True)
class Level:
    """One kind of forward: ``model`` over a KV store of each of ``caches`` slots."""

    name: str  # e.g. "L2 target+full"
    role: str  # "target" or "draft": which model, in the machine's GEMM table
    model: object  # an HFCausalLM
    caches: tuple[int, ...]
    relative_positions: bool = False

    @property
    def shape(self) -> ModelShape:
        return ModelShape.from_config(self.model.module.config)


@attrs.frozen(kw_only=True)
class Row:
    """One measured forward and its floor."""

    level: str
    cache: int
    tokens: int
    tree: bool
    seconds: float
    floor: Floor
    read_bandwidth: float | None = None  # bytes/s the floor was priced at: read beside these forwards (None: the machine's)

    @property
    def ratio(self) -> float:
        return self.seconds / self.floor.seconds

    def as_dict(self) -> dict:
        bandwidth = None if self.read_bandwidth is None else self.read_bandwidth / 1e9
        return {"level": self.level, "cache": self.cache, "tokens": self.tokens, "shape": "tree" if self.tree else "chain",
                "ms": 1e3 * self.seconds, **self.floor.as_dict(), "read_bandwidth_gb_s": bandwidth, "ratio": self.ratio}


def fill(store, cached: int, generator: torch.Generator) -> None:
    """Write ``cached`` random keys and values at positions 0 … cached-1 into an empty ``store``
    (the same random entries in every layer: the cost of attending to them is what counts)."""
    layers, heads, _, dim = store.keys.shape
    store.begin(torch.arange(cached, device="cpu"))
    keys = torch.randn(heads, cached, dim, generator=generator, device="cpu").to(store.keys.device, store.keys.dtype)  # [H, n, D]
    values = torch.randn(heads, cached, dim, generator=generator, device="cpu").to(store.keys.device, store.keys.dtype)  # [H, n, D]
    for layer in range(layers):
        store.write(layer, keys, values)
    store.commit()


def tree_parents(k: int) -> torch.Tensor:
    """[k] parents of a binary token tree in breadth-first order: nodes 0 and 1 are children of the
    last committed token, nodes 2i+2 and 2i+3 children of node i."""
    return torch.tensor([(i - 2) // 2 if i >= 2 else -1 for i in range(k)], dtype=torch.long, device="cpu")


def batch_maker(vocab: int, cached: int, tokens: int, tree: bool, generator: torch.Generator) -> Callable[[], object]:
    """A function building the batch of one forward: a chain of ``tokens`` tokens, or one committed
    token followed by a binary tree of ``tokens - 1`` nodes (logits for ``tokens`` rows either way)."""
    from ..batch import TokenBatch
    from ..types import Draft, DraftKind

    ids = torch.randint(vocab, (tokens,), generator=generator, device="cpu").tolist()
    if not tree:
        return lambda: TokenBatch.chain(ids, cached, tokens)
    k = tokens - 1
    draft = Draft(tokens=torch.tensor(ids[1:], dtype=torch.long, device="cpu"), probs=torch.zeros(k, vocab, device="cpu"),
                  parents=tree_parents(k), kind=DraftKind.TREE_DETERMINISTIC)
    return lambda: TokenBatch.tree(ids[:1], cached, draft)


def time_forward(model, store, *, cached: int, tokens: int, tree: bool, repeats: int, generator: torch.Generator, warmup: int = 1) -> float:
    """Median seconds of ``model.forward`` of a fresh batch over ``store`` holding ``cached`` slots,
    rolled back to them after each forward; the weights held as a generation holds them (checked once)."""
    make = batch_maker(model.vocab_size, cached, tokens, tree, generator)
    times = []
    with weights_held([model]):
        for i in range(warmup + repeats):
            began = time.perf_counter()
            model.forward(make(), store)
            elapsed = time.perf_counter() - began
            store.truncate(cached)
            if len(store) != cached:
                raise AssertionError(f"the store holds {len(store)} slots after rollback, not {cached}")
            if i >= warmup:
                times.append(elapsed)
    return statistics.median(times)


def time_forwards(model, store, *, cached: int, widths: Sequence[int], tree: bool, repeats: int, generator: torch.Generator,
                  between: Callable[[], object] | None = None) -> dict[int, float]:
    """Median seconds of ``model.forward`` at each of ``widths`` tokens (trees from 2 tokens where ``tree``) over
    ``store`` holding ``cached`` slots, the widths taken in turn within each repeat (after one warm-up turn), so
    that a slow spell of a shared machine weighs on every width alike instead of on whichever was being timed.
    ``between`` (a reading of the machine, such as its bandwidth) is called before each timed turn."""
    times: dict[int, list[float]] = {t: [] for t in widths}
    with weights_held([model]):  # one scope over all turns: each check runs in the warm-up turn
        for turn in range(1 + repeats):
            if turn > 0 and between is not None:
                between()
            for t in widths:
                seconds = time_forward(model, store, cached=cached, tokens=t, tree=tree and t >= 2, repeats=1, generator=generator, warmup=0)
                if turn > 0:
                    times[t].append(seconds)
    return {t: statistics.median(seconds) for t, seconds in times.items()}


def measure(levels: Sequence[Level], machine: Machine, *, tokens: Sequence[int], tree: bool = False, repeats: int = 5,
            seed: int = 0, progress: Callable[[str], None] | None = None, bandwidth: Callable[[], float] | None = None) -> list[Row]:
    """Time every level's forward at each cache length and number of tokens (chains, and trees of
    2 tokens or more with ``tree``), the widths in turn (:func:`time_forwards`), and pair each with its floor:
    at the median of the ``bandwidth`` readings (bytes/s) taken before each of those forwards' timed turns
    where given, else at the ``machine``'s read bandwidth."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    rows = []
    for level in levels:
        shape, dtype = level.shape, level.model.dtype
        for cached in level.caches:
            if progress:
                progress(f"{level.name} over {cached} slots")
            store = level.model.new_cache(cached + max(tokens), relative_positions=level.relative_positions)
            fill(store, cached, generator)
            readings: list[float] = []
            between = None if bandwidth is None else (lambda: readings.append(bandwidth()))
            timed = {False: time_forwards(level.model, store, cached=cached, widths=tokens, tree=False, repeats=repeats, generator=generator,
                                          between=between)}
            if tree and any(t >= 2 for t in tokens):
                timed[True] = time_forwards(level.model, store, cached=cached, widths=[t for t in tokens if t >= 2], tree=True, repeats=repeats,
                                            generator=generator, between=between)
            priced = attrs.evolve(machine, read_bandwidth=statistics.median(readings)) if readings else machine
            for t in tokens:
                for is_tree in (False, True) if tree and t >= 2 else (False,):
                    rows.append(Row(level=level.name, cache=cached, tokens=t, tree=is_tree, seconds=timed[is_tree][t],
                                    floor=forward_floor(shape, dtype, t, cached, t, priced, level.model.linear_bytes_per_weight(t),
                                                        level.model.head_bytes_per_weight(t)), read_bandwidth=priced.read_bandwidth))
            del store
    return rows


# -- the report -----------------------------------------------------------------------------------

def chain_costs(rows: Sequence[Row]) -> list[float]:
    """Seconds of a chain forward of every count from 1 to the most measured, for one level and cache: the measured
    ones, and between them the line through their neighbours."""
    counts, seconds = zip(*sorted((row.tokens, row.seconds) for row in rows))
    return [float(np.interp(count, counts, seconds)) for count in range(1, counts[-1] + 1)]


@attrs.frozen(kw_only=True)
class Ceiling:
    """The most chains verified by one level over one cache can gain over its own step, drafting free
    (:func:`specstack.speedup.chain_ceiling` on :func:`chain_costs`)."""

    level: str
    cache: int
    acceptance: float
    speedup: float
    gamma: int
    longest: bool  # gamma is the longest chain measured: longer forwards, had they been timed, might pay more
    drafted_by: str = ""  # the level whose one-token step each drafted token costs (TriForce's bound); "": drafting free

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def ceilings(rows: Sequence[Row], acceptances: Sequence[float] = ACCEPTANCES) -> list[Ceiling]:
    """A :class:`Ceiling` per acceptance for every level and cache whose chains were timed at one token and more,
    drafting free; then, where the retrieval level's step was timed too, the full level's drafted by it, each drafted
    token one retrieval step (TriForce's middle level drafting alone: the most its rounds can gain at that acceptance)."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        if not row.tree:
            groups.setdefault((row.level, row.cache), []).append(row)
    draft_costs = {"": 0.0}  # drafted_by -> seconds a drafted token costs ("": drafting free)
    draft_costs.update({row.level: row.seconds for row in rows if row.level == LEVELS["retrieval"] and row.tokens == 1 and not row.tree})
    found = []
    for drafted_by, draft_cost in draft_costs.items():
        for (level, cache), chains in groups.items():
            if min(row.tokens for row in chains) != 1 or len(chains) < 2 or (drafted_by and level != LEVELS["full"]):
                continue
            costs = chain_costs(chains)
            for acceptance in acceptances:
                speedup, gamma = chain_ceiling(acceptance, costs, draft_cost)
                found.append(Ceiling(level=level, cache=cache, acceptance=acceptance, speedup=speedup, gamma=gamma,
                                     longest=gamma == len(costs) - 1, drafted_by=drafted_by))
    return found


def ceiling_lines(found: Sequence[Ceiling]) -> list[str]:
    """The report's closing lines: a level and cache a line, its ceiling at each acceptance; drafting free first, then
    drafted by a level below."""
    headings = {False: "ceiling with drafting free (chains whose drafted tokens are each accepted with α; forwards between the "
                       "measured T on a line; *: the longest chain measured):",
                True: "ceiling with each drafted token one step of the level below (TriForce's middle level drafting alone):"}
    lines: list[str] = []
    for drafted, heading in headings.items():
        chosen = [c for c in found if bool(c.drafted_by) == drafted]
        if chosen:
            lines += ["", heading]
        for (level, cache, below), group in itertools.groupby(chosen, key=lambda c: (c.level, c.cache, c.drafted_by)):  # kept together
            label = f"{level.split()[0]} <- {below.split()[0]}" if below else level
            lines.append(f"{label:<20} {cache:>6}  " + "  ".join(
                f"α {c.acceptance:g}: {c.speedup:.2f}x (γ {c.gamma}{'*' if c.longest else ''})" for c in group))
    return lines


def machine_lines(machine: Machine) -> list[str]:
    """The roofs, then matrix-product GFLOP/s by what and rows."""
    bf16 = {True: "oneDNN bf16 kernels", False: "no oneDNN bf16 kernels", None: "oneDNN bf16 unknown"}[machine.onednn_bf16]
    peaks = ", ".join(f"{name} {flops / 1e9:.1f}" for name, flops in machine.gemm_peak.items())
    lines = [f"machine: {machine.threads} torch threads, CPU capability {machine.cpu_capability or '?'}, {bf16}",
             f"read bandwidth: {machine.read_bandwidth / 1e9:.1f} GB/s (sum of a {machine.bandwidth_mib} MiB buffer, best of several, "
             "at the start; each level's floors take it again beside their forwards)",
             f"GEMM peak (GFLOP/s, best measured): {peaks}"]
    if machine.bf16_products:
        lines.append(machine.bf16_products)
    rows = sorted({g.rows for g in machine.gemm if not g.what.startswith("square")})
    head = f"  {'dtype':<9} {'linear of':<14}" + "".join(f"{r:>8}" for r in rows) + "   rows"
    lines += ["", "GEMM GFLOP/s by rows:", head]
    for dtype in machine.gemm_peak:
        for what in dict.fromkeys(g.what for g in machine.gemm if g.dtype == dtype):
            found = {g.rows: g.flops_per_s for g in machine.gemm if g.dtype == dtype and g.what == what}
            if what.startswith("square"):
                lines.append(f"  {dtype:<9} {what:<14}{next(iter(found.values())) / 1e9:>8.1f}")
            else:
                lines.append(f"  {dtype:<9} {what:<14}" + "".join(f"{found[r] / 1e9:>8.1f}" if r in found else f"{'':>8}" for r in rows))
    return lines


def table(rows: Sequence[Row]) -> list[str]:
    lines = [f"{'level':<20} {'cache':>6} {'T':>3} {'shape':<5} {'ms':>8} {'floor ms':>9} {'memory ms':>9} {'compute ms':>10} "
             f"{'MB read':>8} {'GFLOP':>6} {'bound':<7} {'GB/s':>5} {'ratio':>6}"]
    for r in rows:
        f = r.floor
        bandwidth = "" if r.read_bandwidth is None else f"{r.read_bandwidth / 1e9:.1f}"
        lines.append(f"{r.level:<20} {r.cache:>6} {r.tokens:>3} {'tree' if r.tree else 'chain':<5} {1e3 * r.seconds:>8.2f} "
                     f"{1e3 * f.seconds:>9.2f} {1e3 * f.memory_s:>9.2f} {1e3 * f.compute_s:>10.2f} {f.bytes / 1e6:>8.1f} "
                     f"{f.flops / 1e9:>6.2f} {f.bound:<7} {bandwidth:>5} {r.ratio:>6.2f}")
    return lines


# -- the command line -----------------------------------------------------------------------------

def add_floor_parser(commands) -> argparse.ArgumentParser:
    """Add the ``floor`` subcommand to ``commands`` (an argparse subparsers object). Numbers are
    read as text and checked in :func:`options`, so that a bad one is a one-line error."""
    floor = commands.add_parser("floor", help="measure memory bandwidth and GEMM throughput, and each level's forward cost against its floor",
                                description="Each TriForce level's forward cost on the embedded default, against T tokens and cache "
                                            "length, as a ratio to the floor max(bytes / bandwidth, flops / GEMM peak).")
    floor.add_argument("--dtype", default="float32", help="weights and KV cache: float32 (default) or bfloat16")
    floor.add_argument("--cache", nargs="+", metavar="N", default=[str(n) for n in CACHES],
                       help=f"full-cache lengths of the target (default: {' '.join(map(str, CACHES))})")
    floor.add_argument("--tokens", nargs="+", metavar="T", default=[str(t) for t in TOKENS],
                       help=f"new tokens per forward (default: {' '.join(map(str, TOKENS))})")
    floor.add_argument("--tree", action="store_true", help="also time token trees of each T >= 2 (one committed token and a binary tree)")
    floor.add_argument("--levels", nargs="+", metavar="LEVEL", default=list(LEVELS), help=f"which forwards (default: {' '.join(LEVELS)})")
    floor.add_argument("--budget", default=None, metavar="N", help=f"slots of the retrieval view (default: {BUDGET})")
    floor.add_argument("--window", default=None, metavar="N", help=f"slots of the draft's StreamingLLM window (default: {WINDOW})")
    floor.add_argument("--repeats", default="5", metavar="N", help="timed forwards per figure, after one warm-up; the median is reported (default: 5)")
    floor.add_argument("--threads", default=None, metavar="N", help="torch intra-op threads (default: torch's choice)")
    floor.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    floor.add_argument("--widen-bf16", action="store_true", help=WIDEN_BF16_HELP)
    from ..cli import add_window_options  # the target's window, as generate, demo and bench take it

    add_window_options(floor)
    floor.set_defaults(run=run_floor)
    return floor


@attrs.frozen(kw_only=True)
class Options:
    dtype: str
    caches: tuple[int, ...]
    tokens: tuple[int, ...]
    levels: tuple[str, ...]
    budget: int
    window: int
    repeats: int
    threads: int | None
    tree: bool
    context: int | None = None  # the target's window (None: its trained one)
    rope_scaling: str | None = None  # how a window beyond the trained one is reached (specstack.hf.window_config)
    widen_bf16: bool = False  # the target's bf16 products widened (HFCausalLM.widen_bf16_products)


def options(args: argparse.Namespace) -> Options:
    """The checked options of ``specstack floor``; a bad one is a :class:`SpecstackError`."""
    unknown = [name for name in args.levels if name not in LEVELS]
    if unknown:
        raise SpecstackError(f"unknown level {unknown[0]!r}; available: {', '.join(LEVELS)}")
    for flag, given, level in (("--budget", args.budget, "retrieval"), ("--window", args.window, "draft")):
        if given is not None and level not in args.levels:
            raise SpecstackError(f"{flag} {given} sizes the {level} level, which --levels {' '.join(args.levels)} leaves out; "
                                 f"add {level} or drop {flag}")
    tokens = tuple(dict.fromkeys(whole_number(t, "--tokens") for t in args.tokens))
    if args.tree and max(tokens) < 2:
        raise SpecstackError(f"--tree times token trees of 2 tokens or more, and --tokens {' '.join(map(str, args.tokens))} has none; "
                             "add one or drop --tree")
    return Options(dtype=dtype_name(args.dtype), caches=tuple(whole_number(n, "--cache") for n in args.cache), tokens=tokens,
                   levels=tuple(dict.fromkeys(args.levels)), budget=whole_number(BUDGET if args.budget is None else args.budget, "--budget"),
                   window=whole_number(WINDOW if args.window is None else args.window, "--window"), repeats=whole_number(args.repeats, "--repeats"),
                   threads=None if args.threads is None else whole_number(args.threads, "--threads"), tree=args.tree,
                   context=args.context, rope_scaling=args.rope_scaling, widen_bf16=widening_asked(dtype_name(args.dtype), args.widen_bf16))


def default_levels(opts: Options) -> list[Level]:
    """The embedded default's levels (the draft loaded only when wanted), checked against its context."""
    from transformers.utils import logging as hf_logging

    from ..models import load_default_draft, load_target

    hf_logging.disable_progress_bar()
    dtype = DTYPES[opts.dtype]
    target = load_target(dtype=dtype, context=opts.context, rope_scaling=opts.rope_scaling)[0]
    widen_bf16([target], opts.widen_bf16)
    caches = {"full": opts.caches, "retrieval": (opts.budget,), "draft": (opts.window,)}
    levels = []
    for key in opts.levels:
        model = load_default_draft(target, dtype=dtype) if key == "draft" else target
        levels.append(Level(name=LEVELS[key], role="draft" if key == "draft" else "target", model=model, caches=caches[key], relative_positions=key == "draft"))
    for level in levels:
        longest = max(level.caches) + max(opts.tokens)
        if longest > level.model.max_length:
            raise SpecstackError(f"{level.name}: {max(level.caches)} cached + {max(opts.tokens)} new tokens exceed the model's "
                                 f"{level.model.max_length} positions; use a shorter --cache or fewer --tokens")
    return levels


def run_floor(args: argparse.Namespace, levels: Sequence[Level] | None = None) -> int:
    """``specstack floor``; ``levels`` replaces the embedded default (tests pass random-weight models)."""
    opts = options(args)  # before any weights are read
    with torch_threads(opts.threads):
        status("loading the models" if levels is None else "using the given models")
        levels = default_levels(opts) if levels is None else levels
        shapes = {level.role: level.shape for level in levels}
        status("measuring read bandwidth and GEMM throughput")
        machine = measure_machine(shapes, opts.tokens)
        probe = BandwidthProbe.of(mib=machine.bandwidth_mib)
        rows = measure(levels, machine, tokens=opts.tokens, tree=opts.tree, repeats=opts.repeats, progress=status, bandwidth=probe)
    if args.json:
        print(json.dumps({"dtype": opts.dtype, "widen_bf16": opts.widen_bf16, "repeats": opts.repeats, "machine": machine.as_dict(),
                          "models": {name: attrs.asdict(shape) for name, shape in shapes.items()},
                          "rows": [row.as_dict() for row in rows], "ceilings": [ceiling.as_dict() for ceiling in ceilings(rows)]}))
        return 0
    widened = ", the target's products widened (--widen-bf16)" if opts.widen_bf16 else ""
    print("\n".join([*machine_lines(machine), "", f"forwards ({opts.dtype}{widened}, median of {opts.repeats} after one warm-up; "
                     "ratio = ms / floor ms, floor = max(memory, compute); GB/s: the read bandwidth "
                     "measured between the turns of that level's forwards, the memory roof of their floors):", *table(rows), *ceiling_lines(ceilings(rows))]))
    return 0
