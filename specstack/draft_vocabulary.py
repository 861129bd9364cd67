"""A draft model's vocabulary cut to the tokens it will be asked for most (FR-Spec, Zhao et al., 2025).

A small draft spends most of a step in its LM head: the shipped draft's 49,152 x 576 head is 32 MB of
its 35 MB read per token (docs/benchmarks.md). With ``draft_vocab=R`` a stack's draft computes logits
only for the R tokens first in its ``token_rank`` (token ids by how often they occur in the text the
draft was trained on), through a copy of those rows of its head, and -inf for the others. Its drafts
then come from those R tokens and its distributions are zero elsewhere; the verifier above reads them
as they are, so the output distribution is the target's for any R (speculative sampling is exact for
any draft distribution). Only acceptance can drop, where the target's token lies outside the R.

The ranking ships beside the draft's weights (``token_rank.safetensors``, :func:`write_token_rank`),
made by ``examples/draft_token_rank.py`` from the draft's training texts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import SpecstackError

RANK_FILE = "token_rank.safetensors"  # beside a draft's model.safetensors
RANK_TENSOR = "token_rank"


def token_rank(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[V] token ids by how often they occur in ``tokens`` (any shape; most often first, ties by id)."""
    counts = torch.bincount(tokens.flatten(), minlength=vocab)  # [V]
    return torch.sort(counts, descending=True, stable=True).indices  # [V]


def coverage(rank: torch.Tensor, tokens: torch.Tensor, size: int) -> float:
    """The fraction of ``tokens`` that are among the first ``size`` of ``rank``."""
    inside = torch.zeros(rank.shape[0], dtype=torch.bool)  # [V]
    inside[rank[:size]] = True
    return inside[tokens.flatten()].float().mean().item()


def write_token_rank(rank: torch.Tensor, directory: str | Path) -> Path:
    """Save ``rank`` [V] beside a draft's weights in ``directory``; returns the file's path."""
    from safetensors.torch import save_file

    path = Path(directory) / RANK_FILE
    save_file({RANK_TENSOR: rank.to(torch.int32).contiguous()}, str(path))
    return path


def read_token_rank(directory: str | Path) -> torch.Tensor | None:
    """The ranking saved beside a draft's weights in ``directory`` ([V] token ids), or None where there is none."""
    from safetensors.torch import load_file

    path = Path(directory) / RANK_FILE
    return load_file(str(path))[RANK_TENSOR].long() if path.is_file() else None


def with_draft_vocabulary(model, size: int):
    """``model`` drafting from the first ``size`` tokens of its ``token_rank`` (``model.with_vocabulary``);
    ``size`` 0: ``model`` itself, its whole vocabulary."""
    vocab = model.vocab_size
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= vocab:
        raise SpecstackError(f"draft_vocab {size!r} is not allowed; use 0 (the whole vocabulary) or an integer from 1 to {vocab}")
    if size == 0 or size == vocab:
        return model
    rank = getattr(model, "token_rank", None)
    if rank is None or not hasattr(model, "with_vocabulary"):
        name = getattr(model, "name", type(model).__name__)
        raise SpecstackError(f"draft_vocab={size} needs a draft that carries a token ranking ({RANK_FILE} beside its weights); "
                             f"{name!r} has none: use draft_vocab=0")
    return model.with_vocabulary(rank[:size])
