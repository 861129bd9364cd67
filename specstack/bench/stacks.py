"""What the harness can run by name: the registry's stack recipes, the transformers baselines and
llama.cpp's (``llama_cpp.LlamaCpp``).

Both are *bench stacks*: ``options()`` (the tunable parameters, for crossing grid axes),
``baseline`` (the stack whose run in the same group a speedup is measured against), ``warm`` (a
short untimed run before the first timed one in a process) and ``measure`` (one timed run).

Timing differs, and every record says which was used (``timing``):

* recipes and ``llama-cpp`` report decode seconds (prefill excluded) and compare with ``autoregressive``;
* the HF baselines cannot separate prefill from decoding inside ``generate``; they report total
  seconds and compare with ``hf-generate`` run on the same prompt, seed and sampling; their decode
  seconds, from the end of ``generate``'s first round, give every record a comparable
  ``decode_tokens_per_second``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Protocol

import attrs
import torch

from ..errors import SpecstackError
from ..hf import transformers_attention
from ..registry import Kind, Registry
from ..run import WARMUP_PROMPT, WARMUP_TOKENS, warm_up
from ..sampling import SamplingConfig
from ..types import LevelStats
from .models import Models


@attrs.define(eq=False)
class SharedPrefill:
    """The target's full-cache prefill of one prompt, paid once by the runs of a group: the first
    stack whose top level holds the target's full cache keeps it, later ones copy it
    (``SpeculationStack.share_prefill``) and prefill only their lower levels."""

    prompt: tuple[int, ...]
    source: Any = None  # a SpeculationStack that prefilled ``prompt``

    def lend(self, stack: Any) -> bool:
        return self.source is not None and stack.share_prefill(self.source, self.prompt)

    def keep(self, stack: Any) -> None:
        lm = getattr(stack.top, "lm", None)
        if self.source is None and lm is not None and lm.policy.complete:
            self.source = stack


@attrs.frozen(kw_only=True, eq=False)
class RunSetup:
    """What one timed run needs."""

    models: Models
    registry: Registry
    sampling: SamplingConfig
    stop_tokens: tuple[int, ...]
    prompt: tuple[int, ...]
    max_new_tokens: int
    seed: int
    prefill: SharedPrefill | None = None  # the group's shared target prefill (None: every run prefills)

    def short(self) -> "RunSetup":
        """The same run on a short prompt and a few tokens (warm-up)."""
        return attrs.evolve(self, prompt=self.prompt[:WARMUP_PROMPT], max_new_tokens=WARMUP_TOKENS, prefill=None)


@attrs.frozen(kw_only=True, eq=False)
class Measurement:
    """One timed run. ``decode_seconds``/``prefill_seconds`` are ``None`` when they cannot be
    separated; ``timing`` says which seconds a speedup compares: ``"decode"`` or ``"total"``."""

    tokens: tuple[int, ...]
    levels: tuple[LevelStats, ...]  # lowest level first; empty for the HF baselines
    decode_seconds: float | None
    prefill_seconds: float | None
    total_seconds: float
    timing: str
    notes: Mapping[str, Any] = attrs.field(factory=dict)
    peak_cuda_mb: float | None = None  # filled in by the runner, which resets the peak before the run
    decode_tokens: int | None = None  # tokens produced within decode_seconds (None: all of them)

    @property
    def timed_seconds(self) -> float:
        return self.decode_seconds if self.timing == "decode" else self.total_seconds

    @property
    def decode_tokens_per_second(self) -> float | None:
        """New tokens per second of decoding alone, prefill excluded: the one figure that compares every
        kind of run (recipes, the transformers baselines, llama.cpp) on one footing."""
        tokens = len(self.tokens) if self.decode_tokens is None else self.decode_tokens
        if not self.decode_seconds or tokens <= 0:
            return None
        return tokens / self.decode_seconds


class BenchStack(Protocol):
    name: str
    baseline: str
    family: str  # stacks of one family share a warm-up
    couples: bool  # whether it samples coupled when asked (SamplingConfig.coupled), so its coupled text is its baseline's

    def options(self) -> dict[str, Any]: ...

    def warm(self, run: RunSetup) -> None: ...

    def measure(self, run: RunSetup, options: Mapping[str, Any]) -> Measurement: ...

    def check(self, run: RunSetup, options: Mapping[str, Any]) -> None:
        """Raise the input error ``measure(run, options)`` would meet before its first forward, without running
        anything (``run.prompt`` may be empty)."""


@attrs.frozen(kw_only=True)
class RecipeStack:
    """A registered stack recipe, built into a :class:`~specstack.stack.SpeculationStack` per run."""

    recipe: Any
    baseline: str = "autoregressive"
    family: str = "specstack"
    couples: bool = True

    @property
    def name(self) -> str:
        return self.recipe.name

    def options(self) -> dict[str, Any]:
        return self.recipe.options()

    def warm(self, run: RunSetup) -> None:
        warm_up(run.registry, [model for model in (run.models.target, run.models.draft) if model is not None], run.prompt)

    def measure(self, run: RunSetup, options: Mapping[str, Any]) -> Measurement:
        """One timed run; a γ option ``auto`` or ``adaptive`` (``triforce:gamma=auto``) tunes γ first, untimed, as
        ``specstack generate -o gamma=auto`` does (:mod:`specstack.autotune`), and the record notes the choice."""
        from ..autotune import described, tuned

        stack, mode = self._built(run, options)
        shared = run.prefill is not None and run.prefill.lend(stack)
        run.models.synchronize()  # building the stack queues cache allocations: not part of the timed prefill
        tuning, retuner = tuned(stack, list(run.prompt), mode, seed=run.seed, reuse_cache=shared) if mode else (None, None)
        result = stack.generate(list(run.prompt), run.max_new_tokens, seed=run.seed, reuse_cache=shared or tuning is not None,
                                after_round=retuner)  # synchronizes before each clock reading
        if run.prefill is not None:
            run.prefill.keep(stack)
        notes = {"prefill_shared": shared} | ({"tuning": described(tuning, retuner)} if tuning else {})
        return Measurement(tokens=result.tokens, levels=result.levels, decode_seconds=result.seconds, prefill_seconds=result.prefill_seconds,
                           total_seconds=result.seconds + result.prefill_seconds, timing="decode", notes=notes)

    def check(self, run: RunSetup, options: Mapping[str, Any]) -> None:
        self._built(run, options)

    def _built(self, run: RunSetup, options: Mapping[str, Any]) -> tuple[Any, str | None]:
        """The run's stack, built (its caches still empty), and the γ tuning asked for (``None``: none)."""
        from ..autotune import tunable_levels, tuning_options

        options, mode = tuning_options(options)
        draft = run.models.draft if self.recipe.needs_draft else None
        stack = run.registry.stack(self.recipe.name, target=run.models.target, draft=draft, sampling=run.sampling,
                                   stop_tokens=run.stop_tokens, seed=run.seed, **options)
        if mode is not None:
            tunable_levels(stack)
        return stack, mode


# -- transformers baselines ---------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Baseline:
    """``transformers`` ``generate`` with the target's module, plus ``extra(models, options)`` kwargs."""

    name: str
    description: str
    defaults: Mapping[str, Any]
    extra: Callable[[Models, Mapping[str, Any]], dict]
    baseline: str = "hf-generate"
    family: str = "transformers"
    couples: bool = False  # transformers' own sampler

    def options(self) -> dict[str, Any]:
        return {"attn_implementation": "sdpa", **self.defaults}

    def warm(self, run: RunSetup) -> None:
        self.measure(run, {})

    def check(self, run: RunSetup, options: Mapping[str, Any]) -> None:
        options = self._with_defaults(options)
        with transformers_attention(self._modules(run, self.extra(run.models, options)), options["attn_implementation"]):
            pass

    def measure(self, run: RunSetup, options: Mapping[str, Any]) -> Measurement:
        options = self._with_defaults(options)
        extra = self.extra(run.models, options)
        modules = self._modules(run, extra)
        clock = DecodeClock()
        with transformers_attention(modules, options["attn_implementation"]):
            tokens, seconds = _timed_generate(modules[0], run, {**_sampling_kwargs(run), **extra, "streamer": clock})
        return Measurement(tokens=tokens, levels=(), decode_seconds=clock.seconds, prefill_seconds=None, total_seconds=seconds, timing="total",
                           decode_tokens=clock.tokens, notes={"attn_implementation": options["attn_implementation"]})

    def _with_defaults(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return with_defaults(self.name, self.options(), options)

    def _modules(self, run: RunSetup, extra: Mapping[str, Any]) -> list[torch.nn.Module]:
        """The transformers modules ``generate`` runs: the target's first, then the assistant ``extra`` names, if any."""
        return [_module(run.models.target, "target"), *([extra["assistant_model"]] if "assistant_model" in extra else [])]


def with_defaults(name: str, allowed: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """A baseline's ``options`` over its defaults ``allowed``; an unknown option is a one-line error."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise SpecstackError(f"stack '{name}' has no option '{unknown[0]}'; options: {', '.join(allowed)}")
    return {**allowed, **options}


@attrs.define(eq=False)
class DecodeClock:
    """A ``generate()`` streamer that times decoding after the first round, which holds the prefill.

    ``generate`` hands the prompt to ``put`` first, then each round's new tokens as it commits them.
    The first round (the prefill forward; for assisted generation also the assistant's prefill and a
    first verification) is excluded: ``seconds`` runs from its ``put`` to the last one, over the
    ``tokens`` committed in between. Both are ``None`` when there was only one round."""

    puts: list[tuple[float, int]] = attrs.field(factory=list)  # (clock, new tokens) per put, the prompt first

    def put(self, value: torch.Tensor) -> None:
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass

    @property
    def seconds(self) -> float | None:
        return self.puts[-1][0] - self.puts[1][0] if len(self.puts) > 2 else None

    @property
    def tokens(self) -> int | None:
        return sum(n for _, n in self.puts[2:]) if len(self.puts) > 2 else None


def _module(model: Any, role: str) -> torch.nn.Module:
    module = getattr(model, "module", None)
    if not isinstance(module, torch.nn.Module) or not hasattr(module, "generate"):
        raise SpecstackError(f"the transformers baselines need a transformers {role} (HFCausalLM); got {type(model).__name__}")
    return module


def _sampling_kwargs(run: RunSetup) -> dict[str, Any]:
    sampling = run.sampling
    stop = run.stop_tokens[0] if run.stop_tokens else None
    common = {"max_new_tokens": run.max_new_tokens, "eos_token_id": stop, "pad_token_id": stop if stop is not None else 0}
    if sampling.greedy:
        return {**common, "do_sample": False}
    return {**common, "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or 0}


def _timed_generate(module: torch.nn.Module, run: RunSetup, kwargs: dict[str, Any]) -> tuple[tuple[int, ...], float]:
    device = next(module.parameters()).device
    ids = torch.tensor([run.prompt], device=device)  # [1, T]
    with torch.random.fork_rng(devices=run.models.cuda_devices), torch.inference_mode():  # generate samples from the global RNG
        torch.manual_seed(run.seed)
        run.models.synchronize()
        began = time.perf_counter()
        out = module.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)  # [1, T + new]
        run.models.synchronize()
        seconds = time.perf_counter() - began
    return tuple(out[0, len(run.prompt) :].tolist()), seconds


def _no_extra(models: Models, options: Mapping[str, Any]) -> dict:
    return {}


def _assisted(models: Models, options: Mapping[str, Any]) -> dict:
    if options["schedule"] not in ASSISTANT_SCHEDULES:
        raise SpecstackError(f"hf-assisted schedule {options['schedule']!r} is not allowed; use one of {', '.join(ASSISTANT_SCHEDULES)}")
    tokens = _positive("hf-assisted", "num_assistant_tokens", options)
    return {"assistant_model": _module(models.draft, "draft"), "num_assistant_tokens": tokens, "num_assistant_tokens_schedule": options["schedule"]}


ASSISTANT_SCHEDULES = ("heuristic", "heuristic_transient", "constant")  # transformers' num_assistant_tokens_schedule


def _prompt_lookup(models: Models, options: Mapping[str, Any]) -> dict:
    return {"prompt_lookup_num_tokens": _positive("hf-prompt-lookup", "num_tokens", options),
            "max_matching_ngram_size": _positive("hf-prompt-lookup", "max_ngram", options)}


def _positive(stack: str, option: str, options: Mapping[str, Any]) -> int:
    value = options[option]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecstackError(f"{stack} {option} {value!r} is not allowed; use an integer >= 1")
    return value


BASELINES = (
    Baseline(name="hf-generate", description="transformers generate() with the target", defaults={}, extra=_no_extra),
    Baseline(name="hf-assisted", description="transformers assisted generation, the draft as assistant_model",
             defaults={"num_assistant_tokens": 20, "schedule": "heuristic"}, extra=_assisted),
    Baseline(name="hf-prompt-lookup", description="transformers prompt lookup decoding",
             defaults={"num_tokens": 10, "max_ngram": 2}, extra=_prompt_lookup),
)


def all_baselines() -> tuple[Any, ...]:
    """The transformers baselines and llama.cpp's (``specstack.bench.llama_cpp``)."""
    from .llama_cpp import LlamaCpp

    return (*BASELINES, LlamaCpp())


@attrs.frozen(kw_only=True, eq=False)
class Catalog:
    """Bench stacks by name: the registry's stack recipes first, then the baselines (transformers', llama.cpp's)."""

    registry: Registry
    baselines: tuple[Any, ...] = attrs.field(factory=all_baselines)

    def get(self, name: str) -> BenchStack:
        if name in self.registry.entries[Kind.STACK]:
            return RecipeStack(recipe=self.registry.stack_recipe(name))
        for baseline in self.baselines:
            if baseline.name == name:
                return baseline
        raise SpecstackError(f"unknown stack {name!r}; available: {', '.join(self.names())}")

    def names(self) -> list[str]:
        return [*self.registry.names(Kind.STACK), *(b.name for b in self.baselines)]

    def options_of(self, name: str) -> dict[str, Any]:
        """The stack's options, or none for an unknown name (its run records the error)."""
        try:
            return self.get(name).options()
        except SpecstackError:
            return {}

    def baseline_of(self, name: str) -> str | None:
        try:
            return self.get(name).baseline
        except SpecstackError:
            return None
