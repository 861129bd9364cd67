"""Shared plumbing of the command line: models, prompts, stacks by name, progress and summaries."""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import attrs
import torch

from .errors import SpecstackError, whole_number
from .registry import Registry
from .sampling import SamplingConfig
from .stack import SpeculationStack
from .types import GenerationResult


@attrs.define(eq=False, kw_only=True)
class Session:
    """Models, tokenizer, sampling and registry for one CLI invocation."""

    registry: Registry
    target: object
    tokenizer: object
    draft_path: str | None
    sampling: SamplingConfig
    seed: int
    dtype: torch.dtype = torch.float32
    draft_device: torch.device = torch.device("cpu")
    cuda_graphs: bool = True
    widen_bf16: bool = False  # the target's bf16 products widened (HFCausalLM.widen_bf16_products)
    _draft: object = None

    @classmethod
    def open(cls, args) -> "Session":
        from .hf import load_model
        from .models import load_target

        from transformers.utils import logging as hf_logging

        # checked before any weights are read; a plugin command without device flags (plan-tree) runs on the CPU
        device, draft_device = check_devices(getattr(args, "device", "cpu"), getattr(args, "draft_device", None))
        cuda_graphs = getattr(args, "cuda_graphs", True)
        widened = widening_asked(args.dtype, getattr(args, "widen_bf16", False))
        hf_logging.disable_progress_bar()  # our own progress lines are enough
        set_threads(args.threads)
        sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, coupled=getattr(args, "coupled", False))
        status(f"loading the target model on {device}")
        dtype = getattr(torch, args.dtype)
        context, scaling = getattr(args, "context", None), getattr(args, "rope_scaling", "yarn")
        if args.target:
            target, tokenizer = load_model(args.target, dtype=dtype, device=device, context=context, rope_scaling=scaling)
        else:
            target, tokenizer = load_target(dtype=dtype, device=device, context=context, rope_scaling=scaling)
        use_cuda_graphs([target], cuda_graphs)
        widen_bf16([target], widened)
        return cls(registry=Registry.create(), target=target, tokenizer=tokenizer, draft_path=args.draft, sampling=sampling, seed=args.seed,
                   dtype=dtype, draft_device=draft_device, cuda_graphs=cuda_graphs, widen_bf16=widened)

    @property
    def draft(self):
        if self._draft is None:
            from .models import load_default_draft, load_draft

            status(f"loading the draft model on {self.draft_device}")
            if self.draft_path:
                self._draft = load_draft(self.target, self.draft_path, dtype=self.dtype, device=self.draft_device)
            else:
                self._draft = load_default_draft(self.target, dtype=self.dtype, device=self.draft_device)
            use_cuda_graphs([self._draft], self.cuda_graphs)
        return self._draft

    @property
    def models(self) -> list:
        """The models loaded so far: the target, and the draft once a stack asked for it."""
        return [self.target] + ([self._draft] if self._draft is not None else [])

    def check_draft_taken(self, names: Sequence[str], args) -> None:
        """``--draft`` or ``--draft-device`` given where none of the stacks ``names`` has a draft model: one error line,
        rather than a model file or device left unused without a word."""
        given = [f"--draft {args.draft}"] if args.draft else []
        given += [f"--draft-device {args.draft_device}"] if getattr(args, "draft_device", None) else []
        if given and not any(self.registry.stack_recipe(name).needs_draft for name in names):
            raise SpecstackError(f"{given[0]} is for stacks with a draft model, and {', '.join(names)} has none; drop it or use a stack that has one "
                                 "(triforce, speculative, …: `specstack plugins`)")

    def stack(self, name: str, options: Sequence[str]) -> SpeculationStack:
        recipe = self.registry.stack_recipe(name)
        draft = self.draft if recipe.needs_draft else None
        stops = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        return self.registry.stack(name, target=self.target, draft=draft, sampling=self.sampling, stop_tokens=stops, seed=self.seed, **parse_options(options))

    def prompt_tokens(self, *, prompt: str | None, prompt_file: str | None, book: str | None, length: int | None) -> list[int]:
        if length is not None:
            whole_number(length, "--prompt-tokens")
        if book is not None:
            from .data import book_tokens

            return book_tokens(self.tokenizer, length or 7000, name=book)
        text = prompt if prompt is not None else _read(prompt_file or "-")
        ids = self.tokenizer(text).input_ids
        if length is not None:
            if length > len(ids):
                raise SpecstackError(f"--prompt-tokens {length} is more than the prompt's {len(ids)} tokens")
            ids = ids[-length:]
        return ids


WARMUP_PROMPT = 32  # tokens of the prompt a warm-up decodes after
WARMUP_TOKENS = 4  # and how many it decodes


def warm_up(registry: Registry, models: Iterable[object], prompt: Sequence[int]) -> None:
    """A short untimed autoregressive run on each of ``models`` (the first ``WARMUP_PROMPT`` tokens of
    ``prompt``, ``WARMUP_TOKENS`` new ones), so that no timed run pays for first-call set-up: a model's
    first decoding step makes its compiled layers' plan and checks its Q4_1 blocks against its weights
    (0.16 s for the default target in bf16; 0.4 s was seen in a demo's first step)."""
    for model in models:
        registry.stack("autoregressive", target=model).generate(list(prompt[:WARMUP_PROMPT]), WARMUP_TOKENS)


DEVICE = re.compile(r"cpu|cuda(?::(?P<index>[0-9]+))?")


def check_device(device: str | torch.device, *, available: bool = True) -> torch.device:
    """``device`` (``cpu``, ``cuda`` or ``cuda:N``) as a ``torch.device``; anything else is one
    :class:`SpecstackError` line. With ``available`` a CUDA device must exist on this machine;
    ``available=False`` checks the spelling only (a device of another machine, such as a Ray worker)."""
    text = str(device)
    match = DEVICE.fullmatch(text)
    if match is None:
        raise SpecstackError(f"device {text!r} is not allowed; use cpu, cuda or cuda:N")
    if text == "cpu" or not available:
        return torch.device(text)
    if not torch.cuda.is_available():
        raise SpecstackError(f"device {text!r} is not available: torch.cuda.is_available() is False on this machine")
    count = torch.cuda.device_count()
    if match["index"] is not None and int(match["index"]) >= count:
        allowed = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise SpecstackError(f"device {text!r} is not available: this machine has {count} CUDA device{'s' * (count != 1)}; use {allowed}")
    return torch.device(text)


def check_devices(device: str | torch.device, draft_device: str | torch.device | None) -> tuple[torch.device, torch.device]:
    """The target's device and the draft's (``None``: the target's), both checked."""
    target = check_device(device)
    return target, target if draft_device is None else check_device(draft_device)


WIDEN_BF16_HELP = ("the target's bf16 products widened to float32 on the CPU (no AMX tiles, no bf16 dot products): every token of a "
                   "verify then gets the one-token step's logits bit for bit, so bf16 stacks write autoregressive decoding's output; "
                   "wide verifies cost more where tiles or dot products pay")


def widening_asked(dtype: str, enabled: bool) -> bool:
    """``--widen-bf16`` as given, or one error line where ``dtype`` (a name) has no bf16 products to widen."""
    if enabled and dtype != "bfloat16":
        raise SpecstackError(f"--widen-bf16 widens bf16 products, and --dtype {dtype} has none; add --dtype bfloat16 or drop --widen-bf16")
    return enabled


def widen_bf16(models: Iterable[object], enabled: bool) -> None:
    """Where ``enabled``, every bf16 product of each transformers model of ``models`` widened to float32
    (:meth:`specstack.hf.HFCausalLM.widen_bf16_products`: a bf16 verify's tokens then get the one-token step's logits bit
    for bit on any CPU); others have no such products."""
    from .hf import HFCausalLM

    for model in models:
        if enabled and isinstance(model, HFCausalLM):
            model.widen_bf16_products()


def use_cuda_graphs(models: Iterable[object], enabled: bool) -> None:
    """Switch CUDA graphs on or off in each transformers model of ``models`` (others have none;
    on the CPU the switch has no effect)."""
    from .hf import HFCausalLM

    for model in models:
        if isinstance(model, HFCausalLM):
            model.cuda_graphs = enabled


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise SpecstackError(f"cannot read prompt file {path!r}: {error.strerror}") from None


def split_spec(text: str, what: str) -> tuple[str, list[str]]:
    """``NAME`` or ``NAME:key=value,key=value`` (a ``--stacks`` or ``--tasks`` entry) -> the name and its
    ``key=value`` options, unparsed (:func:`parse_options` parses them)."""
    if not isinstance(text, str) or not text.split(":", 1)[0].strip():
        raise SpecstackError(f"{what} {text!r} is not allowed; use NAME or NAME:key=value,key=value")
    name, _, rest = text.partition(":")
    return name.strip(), [part.strip() for part in rest.split(",")] if rest.strip() else []


def option_key(option: str) -> str:
    """``"draft-window=64"`` -> ``"draft_window"``."""
    return option.partition("=")[0].strip().replace("-", "_")


def given_once(options: Sequence[str]) -> list[str]:
    """``options`` as they are, or one error line for a key given twice (rather than the last one silently winning)."""
    seen: dict[str, str] = {}
    for option in options:
        key = option_key(option)
        if key in seen:
            raise SpecstackError(f"stack option '{key}' is given twice ({seen[key]!r}, {option!r}); give it once")
        seen[key] = option
    return list(options)


def parse_options(options: Sequence[str]) -> dict[str, object]:
    """``["budget=1024", "gamma2=6"]`` -> ``{"budget": 1024, "gamma2": 6}``; a key given twice is an error."""
    parsed = {}
    for option in given_once(options):
        key, sep, value = option.partition("=")
        if not sep or not key:
            raise SpecstackError(f"stack option {option!r} is not KEY=VALUE")
        parsed[option_key(option)] = _value(value)
    return parsed


def _value(text: str) -> object:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def status(message: str) -> None:
    print(f"[specstack] {message}", file=sys.stderr, flush=True)


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads at ``--threads`` (None: as they are); below 1 is one error line."""
    if threads is not None:
        torch.set_num_threads(whole_number(threads, "--threads"))


@contextlib.contextmanager
def torch_threads(threads: int | None = None) -> Iterator[None]:
    """torch's intra-op threads at ``threads`` (None: as they are) for the body, then as they were
    before it: the count is process-wide, and a command may run inside a longer process (a test, a
    notebook, a benchmark's other groups)."""
    before = torch.get_num_threads()
    set_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def progress_printer(label: str, *, long_only: bool = False):
    """A ``progress(done, total)`` callback drawing one updating line on stderr; ``long_only``: silent
    when the work is done in one step (a prompt prefilled in one chunk)."""
    first = True

    def show(done: int, total: int) -> None:
        nonlocal first
        if long_only and first and done >= total:
            return
        first = False
        end = "\n" if done >= total else ""
        print(f"\r[specstack] {label}: {done}/{total} tokens", end=end, file=sys.stderr, flush=True)

    return show


def summary(result: GenerationResult) -> str:
    lines = [f"{len(result.tokens)} tokens in {result.seconds:.2f} s ({result.tokens_per_second:.2f} tokens/s), prompt {result.prompt_length} tokens processed in {result.prefill_seconds:.2f} s"]
    for level in result.levels:
        ms = 1000 * level.forward_seconds / max(level.forward_calls, 1)
        accept = f"acceptance {level.acceptance_rate:.3f} ({level.accepted}/{level.drafted})" if level.drafted else f"drafted {level.drafted}"
        cache = f", KV cache {level.cache_bytes / 2**20:.1f} MiB" if level.cache_bytes else ""
        lines.append(f"  {level.name:<20} {accept:<28} {level.forward_calls:>5} forwards, {ms:6.1f} ms each{cache}")
    return "\n".join(lines)
