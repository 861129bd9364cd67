"""Benchmark tasks: prompts of an exact token length, and how to score what a stack generated.

* ``prose`` — shipped Austen text cut to exactly the requested length (``book``, ``offset``).
* ``needle`` — passkey retrieval (Mohtashami & Jaggi, 2023): filler prose with "The pass key is
  48213. Remember it." inserted at relative ``depth`` (0 = start, 1 = just before the question),
  ending with "What is the pass key?". The key is drawn from the run's seed; the score is 1 when the
  generated text contains it. The needle and the question are whole, whatever the length.

A tokenizer is anything with ``tokenizer(text).input_ids`` and ``tokenizer.decode(ids)``: the
transformers tokenizer of the embedded default, or :class:`~specstack.bench.models.ByteTokenizer`.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Mapping, Sequence

import attrs

from ..data import BOOKS, DEFAULT_BOOK, cut, load_book
from ..errors import SpecstackError

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
SENTENCE_SEARCH = 64  # tokens either side of the requested depth searched for a sentence end


@attrs.frozen(kw_only=True)
class Prompt:
    """A task prompt. ``answer`` is the text whose presence in the output counts as correct
    (``None``: the task is not scored); ``info`` is recorded with every run on this prompt."""

    tokens: tuple[int, ...]
    info: Mapping[str, Any] = attrs.field(factory=dict)
    answer: str | None = None

    def score(self, text: str) -> float | None:
        return None if self.answer is None else float(self.answer in text)


@attrs.define(eq=False)
class Books:
    """A tokenizer and the token ids of each shipped book it has tokenized (once per book)."""

    tokenizer: Any
    _ids: dict[str, list[int]] = attrs.field(factory=dict)

    def tokens(self, name: str, length: int, offset: int) -> list[int]:
        """Exactly ``length`` tokens of book ``name`` from ``offset`` on (as :func:`specstack.data.book_tokens`)."""
        if name not in self._ids:
            self._ids[name] = list(self.tokenizer(load_book(name)).input_ids)
        return cut(self._ids[name], length, name=name, offset=offset)

    def encode(self, text: str) -> list[int]:
        """``text`` without special tokens (it goes inside a prompt)."""
        try:
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)
        except TypeError:  # a minimal tokenizer without that keyword
            return list(self.tokenizer(text).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


def _book(instance, attribute, value) -> None:
    if value not in BOOKS:
        raise SpecstackError(f"task option book {value!r} is not allowed; available: {', '.join(BOOKS)}")


def _offset(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SpecstackError(f"task option offset {value!r} is not allowed; use an integer >= 0")


def _depth(instance, attribute, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise SpecstackError(f"task option depth {value!r} is not allowed; use a number in [0, 1]")


@attrs.frozen(kw_only=True)
class ProseOptions:
    book: str = attrs.field(default=DEFAULT_BOOK, validator=_book)
    offset: int = attrs.field(default=0, validator=_offset)


@attrs.frozen(kw_only=True)
class NeedleOptions:
    book: str = attrs.field(default=DEFAULT_BOOK, validator=_book)
    offset: int = attrs.field(default=0, validator=_offset)
    depth: float = attrs.field(default=0.5, validator=_depth)


@attrs.frozen(kw_only=True)
class Task:
    """A named task: ``build(books, length, seed, options)`` makes the prompt of one run."""

    name: str
    description: str
    options_type: type
    build: Callable[[Books, int, int, Any], Prompt]

    def check_options(self, options: Mapping[str, Any]) -> Any:
        allowed = [f.name for f in attrs.fields(self.options_type)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise SpecstackError(f"task '{self.name}' has no option '{unknown[0]}'; options: {', '.join(allowed)}")
        return self.options_type(**options)

    def prompt(self, books: Books, length: int, seed: int, options: Mapping[str, Any]) -> Prompt:
        return self.build(books, length, seed, self.check_options(options))


def _prose(books: Books, length: int, seed: int, options: ProseOptions) -> Prompt:
    return Prompt(tokens=tuple(books.tokens(options.book, length, options.offset)))


def _needle(books: Books, length: int, seed: int, options: NeedleOptions) -> Prompt:
    key = random.Random(f"needle:{seed}").randint(10_000, 99_999)
    needle, question = books.encode(NEEDLE.format(key=key)), books.encode(QUESTION)
    room = length - len(needle) - len(question)
    if room < 1:
        raise SpecstackError(f"context length {length} is too short for the needle task; use at least {len(needle) + len(question) + 1} tokens")
    filler = books.tokens(options.book, room, options.offset)
    at = _sentence_end(books, filler, round(options.depth * room))
    tokens = (*filler[:at], *needle, *filler[at:], *question)
    return Prompt(tokens=tokens, answer=str(key), info={"key": key, "needle_token": at, "needle_depth": round(at / room, 4)})


def _sentence_end(books: Books, filler: Sequence[int], at: int) -> int:
    """The insertion point nearest ``at`` that follows a sentence end (or ``at`` if none is near)."""
    if at in (0, len(filler)):
        return at
    for distance in range(SENTENCE_SEARCH + 1):
        for i in (at - distance, at + distance):
            if 0 < i < len(filler) and books.decode(filler[i - 1 : i]).rstrip().endswith((".", "!", "?")):
                return i
    return at


TASKS = (
    Task(name="prose", description="Austen prose cut to the context length", options_type=ProseOptions, build=_prose),
    Task(name="needle", description="passkey retrieval: a pass key hidden in Austen prose at a depth", options_type=NeedleOptions, build=_needle),
)


def task_by_name(name: str) -> Task:
    for task in TASKS:
        if task.name == name:
            return task
    raise SpecstackError(f"unknown task {name!r}; available: {', '.join(t.name for t in TASKS)}")
