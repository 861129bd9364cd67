"""Public-domain books shipped with specstack (see SOURCES.md)."""

from __future__ import annotations

import lzma
from importlib import resources

from ..errors import SpecstackError

AUSTEN = ("prideprejudice", "sensesensibility", "mansfieldpark", "emma", "northangerabbey", "persuasion")
BOOKS = (*AUSTEN, "kjv")  # kjv: the King James Bible, a public-domain text of another kind (held out from every shipped model)
DEFAULT_BOOK = "prideprejudice"


def load_book(name: str = DEFAULT_BOOK) -> str:
    """The full text of a shipped book."""
    if name not in BOOKS:
        raise SpecstackError(f"unknown book {name!r}; available: {', '.join(BOOKS)}")
    return lzma.decompress(resources.files(__package__).joinpath(f"{name}.txt.xz").read_bytes()).decode("utf-8")


def book_tokens(tokenizer, length: int, name: str = DEFAULT_BOOK, offset: int = 0) -> list[int]:
    """Exactly ``length`` tokens of a book, starting ``offset`` tokens in."""
    return cut(tokenizer(load_book(name)).input_ids, length, name=name, offset=offset)


def cut(ids, length: int, *, name: str, offset: int = 0) -> list[int]:
    """Exactly ``length`` of a book's token ``ids``, starting ``offset`` tokens in."""
    if offset + length > len(ids):
        raise SpecstackError(f"book {name!r} has {len(ids)} tokens; cannot cut {length} tokens at offset {offset}")
    return list(ids[offset : offset + length])
