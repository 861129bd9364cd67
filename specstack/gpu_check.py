"""The speed half of ``make gpu-check``: TriForce's forward costs on random-weight models.

``python -m specstack.gpu_check [--out FILE] [--tiny] [--contexts 16384,32768,65536,122880] [--budget 4096]``

Builds a target shaped like Llama-2-7B and a draft shaped like JackFram/llama-68m with random bf16
weights (no weights travel with the repo), then for each context N runs the real levels
(:class:`~specstack.model.CachedModel` over the full cache, the retrieval view and StreamingLLM)
and times one forward of each kind a TriForce round makes. Random weights make acceptance
meaningless, so the speedup is *predicted* (:mod:`specstack.speedup`) from the measured costs at
the paper's acceptance rates, not measured end to end. ``--tiny`` uses tiny shapes so the script
runs on a CPU in seconds (that is how the tests run it).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import attrs
import torch

from . import speedup
from .hf import HFCausalLM
from .model import CachedModel
from .policies import FullCache, StreamingLLM
from .retrieval import Retrieval
from .types import LevelStats

GAMMA1, GAMMA2 = 2, 6  # TriForce's best on A100
ALPHA, BETA = 0.9, 0.8  # acceptance retrieval → full, draft → retrieval
PAPER = {122880: 2.31}  # TriForce Table 2: A100, Llama-2-7B-128K, 122K prompt, T = 0
DRAFT_PREFIX = 1024  # the draft's 256-slot view is the same after any prefix longer than its window
PREFILL_CHUNK = 4096  # prompt tokens per prefill forward (a 7B forward of 122K tokens does not fit)
HEADROOM = 1024  # full-cache slots beyond the prompt


@attrs.frozen(kw_only=True)
class Setup:
    """Model shapes and what to measure."""

    target: dict
    draft: dict
    contexts: tuple[int, ...]
    budget: int
    tiny: bool
    reps: int = 10
    warmup: int = 3


LLAMA_2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=131072)
LLAMA_68M = dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                 num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048)
TINY_TARGET = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)
TINY_DRAFT = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048)


@attrs.frozen(kw_only=True)
class Row:
    """One context's measurements, in milliseconds; ``failure`` when it did not run to the end."""

    context: int
    ms: dict[str, float] = attrs.field(factory=dict)  # c_ar, c2, c1/c1x1/t0 + "_off"/"_on"
    peak_gib: float | None = None
    failure: str | None = None

    @property
    def predicted(self) -> float | None:
        if self.failure:
            return None
        return speedup.triforce(c_ar=self.ms["c_ar"], c2=self.ms["c2"], c1=self.ms["c1_on"], t0=self.ms["t0_on"],
                                alpha=ALPHA, beta=BETA, gamma1=GAMMA1, gamma2=GAMMA2).speedup


def random_llama(shape: dict, device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> torch.nn.Module:
    """A Llama with N(0, 0.02²) weights (norms 1), built on ``meta`` and filled on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    with torch.device("meta"):
        module = LlamaForCausalLM(config)
    module = module.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() == 1:  # RMSNorm scales
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    with torch.device(device):  # to_empty left inv_freq uninitialised: build the rotary module again
        module.model.rotary_emb = type(module.model.rotary_emb)(config)
    return module


def median_ms(call: Callable[[], object], device: torch.device, reps: int, warmup: int) -> float:
    """Median wall time of ``call`` in ms: CUDA events on a GPU (idle GPU before each), else perf_counter."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            call()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def measure(target_module, draft_module, context: int, setup: Setup, device: torch.device) -> Row:
    """Prefill the three levels with ``context`` random tokens and time each forward of a round."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    stage = "KV caches"
    try:
        target = HFCausalLM(module=target_module, tokenizer_id="random-llama", name="target")  # fresh per context
        draft = HFCausalLM(module=draft_module, tokenizer_id="random-llama", name="draft")
        target.max_length = context + HEADROOM  # the full cache preallocates max_length slots
        full = CachedModel(target, FullCache(), LevelStats(name="L2 target, full cache"))
        view = CachedModel(target, Retrieval(budget=setup.budget, chunk_size=8, stride=64, reserve=32),
                           LevelStats(name="L1 target, retrieval"), channel=full.open_channel())
        small = CachedModel(draft, StreamingLLM(sinks=16, window=240), LevelStats(name="L0 draft, StreamingLLM"))
        ids = torch.randint(target.vocab_size, (context + GAMMA2 + 1,), generator=torch.Generator().manual_seed(context))
        prompt, new = ids[:context].tolist(), ids[context:].tolist()
        stage = "prefill"
        for end in range(min(PREFILL_CHUNK, context), context + PREFILL_CHUNK, PREFILL_CHUNK):
            full.logits(prompt[: min(end, context)], 1)  # rolls back to what it holds, feeds the rest
        stage = "retrieval gather"
        view.logits([*prompt, new[0]], 1)  # gathers the view from the full cache, then feeds one token
        small.logits(prompt[-DRAFT_PREFIX:], 1)
        stage = "timing"

        def time_(lm: CachedModel, prefix: list[int], k: int) -> float:
            tokens = [*prefix, *new[:k]]  # each call rolls back to prefix (a pointer move) and feeds k tokens
            return median_ms(lambda: lm.logits(tokens, k), device, setup.reps, setup.warmup)

        ms = {"c_ar": time_(full, prompt, 1), "c2": time_(full, prompt, GAMMA2 + 1)}
        for suffix, on in (("_off", False), ("_on", True)):
            target.cuda_graphs = draft.cuda_graphs = on  # the same modules; graphs apply on CUDA only
            ms["c1" + suffix] = time_(view, prompt, GAMMA1 + 1)
            ms["c1x1" + suffix] = time_(view, prompt, 1)
            ms["t0" + suffix] = time_(small, prompt[-DRAFT_PREFIX:], 1)
    except torch.OutOfMemoryError:
        return Row(context=context, peak_gib=_peak_gib(device), failure=f"does not fit (out of memory in {stage})")
    return Row(context=context, ms=ms, peak_gib=_peak_gib(device))


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def table(rows: Sequence[Row]) -> str:
    """The markdown table: one row per context, "off / on" for CUDA graphs."""
    def ms(row: Row, key: str) -> str:
        pair = [row.ms.get(key + s) for s in ("_off", "_on")]
        return " / ".join("—" if x is None else f"{x:.2f}" for x in pair)

    lines = ["| context | c_ar ms | c2 ms (7 tok) | c1 ms (3 tok) off / on | c1 ms (1 tok) off / on | t0 ms off / on | peak GiB | predicted speedup | paper (A100) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        peak = "—" if row.peak_gib is None else f"{row.peak_gib:.1f}"
        paper = f"{PAPER[row.context]:.2f}×" if row.context in PAPER else "—"
        if row.failure:
            lines.append(f"| {row.context} | {row.failure} | | | | | {peak} | | {paper} |")
            continue
        lines.append(f"| {row.context} | {row.ms['c_ar']:.2f} | {row.ms['c2']:.2f} | {ms(row, 'c1')} | {ms(row, 'c1x1')} | "
                     f"{ms(row, 't0')} | {peak} | {row.predicted:.2f}× | {paper} |")
    return "\n".join(lines)


def report(rows: Sequence[Row], setup: Setup, device: torch.device, seconds: float) -> str:
    """A markdown section: heading, versions, the table and how it was measured."""
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    shapes = "tiny shapes (--tiny)" if setup.tiny else "Llama-2-7B-shaped target, llama-68m-shaped draft"
    return "\n".join([
        f"## GPU check, {datetime.date.today().isoformat()}: {name}",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}; {shapes}, random weights "
        f"({'bf16' if device.type == 'cuda' else 'fp32'}); retrieval budget {setup.budget}; {seconds:.0f} s in all.",
        "",
        table(rows),
        "",
        f"- Each figure is the median of {setup.reps} repetitions after {setup.warmup} warm-up calls "
        f"({'CUDA events' if device.type == 'cuda' else 'time.perf_counter'}) of `CachedModel.logits`: the cache "
        "rolls back to the prompt (a pointer move) and runs one forward of the new tokens, bookkeeping included.",
        f"- c_ar: target, full cache, 1 token; c2: full cache, γ2+1 = {GAMMA2 + 1} tokens; c1: target over the "
        f"retrieval view (budget {setup.budget}, chunks of 8), γ1+1 = {GAMMA1 + 1} tokens (and 1); t0: draft over "
        "StreamingLLM (16 sinks + 240), 1 token. off / on: `HFCausalLM.cuda_graphs` off / on (graphs apply on "
        "CUDA only, and only to stores of at most 16,384 slots: never to these full caches).",
        f"- Predicted speedup (`specstack.speedup.triforce`) from these costs with graphs on at the "
        f"paper's acceptance rates (α = {ALPHA} retrieval → full, β = {BETA} draft → retrieval, γ1 = {GAMMA1}, "
        f"γ2 = {GAMMA2}). Random weights make real acceptance meaningless: this is predicted from measured costs, "
        "not measured end to end. The paper's figure is TriForce Table 2 (A100, 122K prompt, T = 0).",
        f"- The full cache holds the prompt + {HEADROOM} slots and is prefilled in chunks of {PREFILL_CHUNK} tokens; "
        f"the draft is prefilled with the last {DRAFT_PREFIX} prompt tokens (its 256-slot view is the same after any longer prefix).",
        "- Peak: `torch.cuda.max_memory_allocated` per context (weights included); \"does not fit\" names the step "
        "that ran out of memory.",
        "",
    ])


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specstack.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown section to this file")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and contexts: seconds on a CPU")
    parser.add_argument("--contexts", help="comma-separated prompt lengths (default 16384,32768,65536,122880; tiny 256,512)")
    parser.add_argument("--budget", type=int, help="retrieval budget in tokens (default 4096; tiny 64)")
    parser.add_argument("--tests-log", type=Path, help="a pytest log (make gpu-check's correctness half): its summary goes into the report")
    parser.add_argument("--tests-ids", type=Path, help="the test ids pytest collected for that log, one a line: those that did not "
                        "run to the end go into the log's name with .rest")
    return parser.parse_args(argv)


OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


def outcomes_in_log(lines: Sequence[str]) -> dict[str, str]:
    """Test id -> outcome from a verbose pytest log: ``[gw0] [ 10%] PASSED id`` under xdist, ``id PASSED [ 10%]``
    without it (a test id may hold spaces, inside its brackets)."""
    outcomes = {}
    for line in lines:
        for outcome in OUTCOMES:
            before, found, after = line.partition(f" {outcome} ")
            if not found and line.endswith(f" {outcome}"):
                before, found, after = line[: -len(outcome) - 1], outcome, ""
            test = after.strip() if "::" in after else before.strip() if "::" in before and " " not in before.split("::")[0] else ""
            if found and test:
                outcomes[test] = outcome
                break
    return outcomes


T = TypeVar("T")
DURATION = re.compile(r"^(?P<seconds>[0-9.]+)s (?:setup|call|teardown) +(?P<test>\S.*?)\s*$")


def recorded_seconds(lines: Sequence[str]) -> dict[str, float]:
    """Test id -> seconds from pytest's ``--durations`` lines (``145.54s call     tests/a.py::t[x]``), a test's
    setup, call and teardown added up; other lines are ignored."""
    seconds: dict[str, float] = {}
    for line in lines:
        if match := DURATION.match(line):
            seconds[match["test"]] = seconds.get(match["test"], 0.0) + float(match["seconds"])
    return seconds


def slowest_first(tests: Sequence[T], seconds: dict[str, float], name: Callable[[T], str] = str) -> list[T]:
    """``tests`` (ids, or what ``name`` gives an id of) with those recorded slowest first, the unrecorded after them
    in their own order. Under the check's time cap the long sampled-distribution tests then run side by side from
    the start instead of beginning last, when the cap would cut them off (docs/gpu.md)."""
    return sorted(tests, key=lambda test: -seconds.get(name(test), 0.0))  # stable: ties keep collection order


def tests_summary(log: Path, collected: Sequence[str] = (), rest: Path | None = None) -> str:
    """The correctness half in a few lines, from a verbose pytest ``log`` (one PASSED/FAILED line per
    test, so that a run stopped by its time cap still tells what finished; the cap interrupts pytest, which
    then still prints the failures' tracebacks into the log). Of the ``collected`` test ids, those the cap
    stopped are written to ``rest``, one a line, for ``make gpu-check GPU_TESTS=@FILE`` to run next."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    outcomes = outcomes_in_log(lines)
    passed = [test for test, outcome in outcomes.items() if outcome == "PASSED"]
    failed = [test for test, outcome in outcomes.items() if outcome in ("FAILED", "ERROR")]
    interrupted = any(line.startswith("!") and "KeyboardInterrupt" in line for line in lines)  # the cap's SIGINT, as pytest reports it
    finished = not interrupted and any(line.startswith("=") and (" passed" in line or " failed" in line) for line in lines)
    stopped = [test for test in collected if test not in outcomes]
    if rest is not None:
        rest.write_text("".join(f"{test}\n" for test in stopped))
    where = f" (`make gpu-check GPU_TESTS=@{rest}` runs them)" if rest is not None and stopped else ""
    return "\n".join([
        "Correctness on this device (`pytest --device cuda -v`, the Makefile's `GPU_TESTS`): "
        f"{len(passed)} passed, {len(failed)} failed" + ("." if finished else ", then the time cap stopped pytest before the rest."),
        *([f"Of the {len(collected)} tests collected, {len(stopped)} did not run to the end{where}."] if collected else []),
        "", *(f"- FAILED {name}" for name in failed[:20]), "",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    contexts = args.contexts or ("256,512" if args.tiny else "16384,32768,65536,122880")
    setup = Setup(target=TINY_TARGET if args.tiny else LLAMA_2_7B, draft=TINY_DRAFT if args.tiny else LLAMA_68M,
                  contexts=tuple(int(c) for c in contexts.split(",")), budget=args.budget or (64 if args.tiny else 4096), tiny=args.tiny)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    began = time.perf_counter()
    generator = torch.Generator(device=device).manual_seed(0)
    target = random_llama(setup.target, device, dtype, generator)
    draft = random_llama(setup.draft, device, dtype, generator)
    rows = []
    for context in setup.contexts:
        rows.append(measure(target, draft, context, setup, device))
        gc.collect()  # the previous context's caches go before the next one's are allocated
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"context {context}: {rows[-1].failure or 'done'} ({time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
    text = report(rows, setup, device, time.perf_counter() - began)
    if args.tests_log:
        collected = [line.strip() for line in args.tests_ids.read_text().splitlines() if "::" in line] if args.tests_ids and args.tests_ids.exists() else []
        text += "\n" + tests_summary(args.tests_log, collected, args.tests_log.with_suffix(".rest") if collected else None)
    if args.out:
        args.out.write_text(text)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
