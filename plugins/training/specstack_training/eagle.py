"""Train EAGLE's draft layer for a frozen target on CPU (Li et al., 2024; the layer: :mod:`specstack_medusa.eagle`).

Data: the Medusa trainer's (:func:`~specstack_training.medusa.cached_prepare`, the same settings and ``--data`` file):
rows of text and of the target's own continuations, with the target's last hidden state f_t and greedy token a_t at
every position.

Training is unrolled over ``steps`` passes, as drafting runs (the "training-time test" of EAGLE-3, Li et al., 2025),
on windows of ``window`` consecutive positions. Pass 1's row at each base position i reads the true f_i and x_{i+1}
and attends causally over the true rows of the window; its output ŝ_{i+1} stands for f_{i+1}. Pass p's row at base i
reads pass p - 1's ŝ_{i+p-1} and the row's token x_{i+p}, sits at position i + p - 1, and attends over the true rows
up to i and the rows of passes 2 … p at the same base: exactly what a drafted row sees, its ancestors being the
drafted rows before it. Each pass's output ŝ_{i+p} is trained by cross-entropy of its logits through the target's
frozen LM head, over the draft vocabulary, to the greedy token a_{i+p}, and by ``feature_weight`` × smooth L1 to the
true f_{i+p} (EAGLE's two losses).

Evaluation (:func:`rank_accuracy`): per step, the fraction of held-out positions whose rank-r candidate (over the
draft vocabulary) is a_{t+k}, as the Medusa trainer measures its heads; the first held-out text's greedy
continuations pick the best layer and ship as its accuracy table, which shapes the drafter's trees.

Command line (:mod:`specstack_training.command`)::

    specstack train eagle --text emma ... --eval-text prideprejudice --data /tmp/medusa-data.pt \\
        --out layer.safetensors --minutes 45 [--set key=value ...]
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from specstack import SpecstackError
from specstack.draft_vocabulary import token_rank

from .medusa import DATA_KEYS, check_values, held_out_metrics, labelled_data, write_metrics
from .medusa import DEFAULTS as MEDUSA_DEFAULTS
from .shared import check_counts_at_least_one, fit

DEFAULTS = dict(
    {key: MEDUSA_DEFAULTS[key] for key in (*DATA_KEYS, "gen_batch", "label_batch", "eval_chunks", "eval_every", "top_k", "threads", "lr",
                                           "warmup", "weight_decay", "autocast")},
    steps=5,  # passes unrolled: step k predicts the token k + 1 positions after the true feature it starts from
    window=128,  # consecutive positions a training window holds, and the committed rows a drafted row attends over
    windows=3,  # training windows per optimiser step
    intermediate_size=1024,  # the layer's MLP width
    attention_heads=9,
    feature_weight=1.0,  # the smooth-L1 loss to the true features, against 1 for the cross-entropy
    draft_vocab=8192,  # logits over the tokens the target chose most often in the training data (0: all)
)
DEFAULTS["lr"] = 5e-4

COUNTS = ("steps", "window", "windows", "intermediate_size", "attention_heads", "label_batch", "gen_batch", "top_k", "threads", "seq_len")


def check_hyperparameters(hyperparams: dict) -> None:
    """Known keys with allowed values: one error line otherwise."""
    check_values(hyperparams, DEFAULTS)
    check_counts_at_least_one(hyperparams, COUNTS)
    hp = {**DEFAULTS, **hyperparams}
    if hp["prompt_len"] >= hp["seq_len"]:
        raise SpecstackError("hyperparameter prompt_len must be smaller than seq_len (a continuation adds seq_len - prompt_len tokens)")
    if hp["window"] + hp["steps"] > hp["seq_len"] - hp["prompt_len"] + 1:
        raise SpecstackError(f"hyperparameter window={hp['window']} is not allowed with steps={hp['steps']}; use at most "
                             f"{hp['seq_len'] - hp['prompt_len'] + 1 - hp['steps']} (a held-out continuation's positions less the steps)")


@attrs.frozen(kw_only=True)
class Vocabulary:
    """The draft vocabulary the logits cover: ``rows`` [R] token ids, and ``index`` [V] each token's column (-1: none)."""

    rows: torch.Tensor
    index: torch.Tensor

    @classmethod
    def of(cls, rank: torch.Tensor, size: int) -> "Vocabulary":
        rows = rank[:size] if size else torch.arange(rank.shape[0])
        index = torch.full((rank.shape[0],), -1, dtype=torch.long)
        index[rows] = torch.arange(rows.shape[0])
        return cls(rows=rows, index=index)


def unrolled(layer, embedding: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The layer unrolled over ``steps`` passes on windows: ``features`` [B, W, H] the true f_i of the window's
    positions and ``tokens`` [B, W + steps] the window's tokens x_i from its first position on. -> ``steps``
    tensors [B, W, H]: pass p's ŝ_{i+p} at every base i (what drafting predicts p tokens after a true feature)."""
    width = features.shape[1]
    embedded = embedding[tokens]  # [B, W + steps, H]
    base = torch.arange(width)
    u, q, k, v = layer.rows(features, embedded[:, 1 : width + 1], base)  # [B, W, H], [B, W, A, D] x3
    attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)  # [B, A, W, D]
    outputs = [layer.finish(u, attended.transpose(1, 2))]  # [B, W, H]
    context, drafted = (k.transpose(1, 2), v.transpose(1, 2)), []  # the true rows [B, A, W, D]; the drafted rows' (k, v) [B, W, A, D]
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # [W, W] base i sees the true rows j <= i
    for p in range(2, steps + 1):
        u, q, k, v = layer.rows(outputs[-1], embedded[:, p : width + p], base + p - 1)
        drafted.append((k, v))
        outputs.append(layer.finish(u, _over_ancestors(q, context, drafted, causal)))
    return outputs


def _over_ancestors(q: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor], drafted: list[tuple[torch.Tensor, torch.Tensor]],
                    causal: torch.Tensor) -> torch.Tensor:
    """Queries [B, W, A, D] of pass p's rows over the true rows up to their base (``context``: keys and values
    [B, A, W, D]) and the drafted rows of passes 2 … p at the same base (``drafted``, each [B, W, A, D]) ->
    [B, W, A, D]."""
    keys, values = context
    scale = 1 / math.sqrt(q.shape[-1])
    scores = (q.transpose(1, 2) @ keys.transpose(-1, -2)) * scale  # [B, A, W, W]
    scores = scores.masked_fill(~causal, float("-inf"))
    own = torch.stack([(q * key).sum(-1) for key, _ in drafted], -1).transpose(1, 2) * scale  # [B, A, W, p-1]
    weights = torch.softmax(torch.cat([scores, own], -1).float(), dim=-1).to(q.dtype)  # [B, A, W, W + p - 1]
    width = keys.shape[2]
    out = weights[..., :width] @ values  # [B, A, W, D]
    stacked = torch.stack([value for _, value in drafted], -1).transpose(1, 2)  # [B, A, W, D, p-1]
    return (out + (stacked * weights[..., None, width:]).sum(-1)).transpose(1, 2)  # [B, W, A, D]


def window_batch(data: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: torch.Tensor, starts: torch.Tensor, width: int,
                 steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Windows of ``width`` base positions from ``starts`` of ``rows``: tokens [B, W + steps], features [B, W, H]
    (float32), and for each pass p the greedy labels a_{i+p} [B, W, steps] and true features f_{i+p} [B, W, steps, H]."""
    tokens, states, greedy = data
    span = starts[:, None] + torch.arange(width + steps)  # [B, W + steps]
    picked = rows[:, None]
    labels = torch.stack([greedy[picked, span[:, p : width + p]] for p in range(1, steps + 1)], -1)  # [B, W, S]
    targets = torch.stack([states[picked, span[:, p : width + p]] for p in range(1, steps + 1)], -2).float()  # [B, W, S, H]
    return tokens[picked, span], states[picked, span[:, :width]].float(), labels, targets


def step_logits(outputs: list[torch.Tensor], lm_head: torch.Tensor) -> torch.Tensor:
    """Every pass's predicted features -> [S, B, W, R] logits over the draft vocabulary (``lm_head``: its rows [R, H])."""
    return torch.stack(outputs) @ lm_head.T.to(outputs[0].dtype)  # [S, B, W, R]


def loss_of(outputs: list[torch.Tensor], lm_head: torch.Tensor, vocabulary: Vocabulary, labels: torch.Tensor, targets: torch.Tensor,
            feature_weight: float) -> torch.Tensor:
    """Cross-entropy of every pass's logits to its greedy labels [B, W, S] (tokens outside the draft vocabulary
    are not learned), plus ``feature_weight`` × smooth L1 of its features to the true ones [B, W, S, H]."""
    logits = step_logits(outputs, lm_head)  # [S, B, W, R]
    columns = vocabulary.index[labels].permute(2, 0, 1)  # [S, B, W]
    loss = F.cross_entropy(logits.flatten(0, 2).float(), columns.flatten(), ignore_index=-1)
    if feature_weight:
        loss = loss + feature_weight * F.smooth_l1_loss(torch.stack(outputs, -2).float(), targets)
    return loss


def evaluation_windows(length: int, width: int, steps: int) -> list[tuple[int, int]]:
    """(start, first base counted) of windows covering every base of a row of ``length`` positions that has
    ``steps`` positions after it, each base counted once: the last window ends at the row's end."""
    last = length - steps - width
    starts = list(range(0, max(last, 0) + 1, width))
    if starts[-1] != last and last > 0:
        starts.append(last)
    return [(start, 0 if i == 0 else starts[i - 1] + width - start) for i, start in enumerate(starts)]


@torch.inference_mode()
def rank_accuracy(layer, lm_head: torch.Tensor, embedding: torch.Tensor, vocabulary: Vocabulary,
                  data: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int, batch: int = 8) -> list[list[float]]:
    """[S][top_k]: over every base of ``data``'s rows (windows of the layer's own), the fraction whose step-k
    rank-r candidate (over the draft vocabulary) is the target's greedy token a_{t+k}, given the true tokens
    before it (top-1 is column 0)."""
    steps, width = layer.info.heads, min(layer.info.window, data[0].shape[1] - layer.info.heads)
    hits, counted = torch.zeros(steps, top_k), 0
    for start, skip in evaluation_windows(data[0].shape[1], width, steps):
        for first in range(0, data[0].shape[0], batch):
            rows = torch.arange(first, min(first + batch, data[0].shape[0]))
            tokens, features, labels, _ = window_batch(data, rows, torch.full_like(rows, start), width, steps)
            ranks = step_logits(unrolled(layer, embedding, tokens, features, steps), lm_head).topk(top_k, -1).indices  # [S, B, W, k]
            columns = vocabulary.index[labels].permute(2, 0, 1)  # [S, B, W]
            hit = (ranks == columns[..., None]) & (columns[..., None] >= 0)  # [S, B, W, k]
            hits += hit[:, :, skip:].sum((1, 2)).float()
            counted += rows.shape[0] * (width - skip)
    return (hits / max(counted, 1)).tolist()


def train(layer, lm_head: torch.Tensor, embedding: torch.Tensor, vocabulary: Vocabulary, data, hp: dict, seconds: float, evaluate, log,
          seed: int) -> dict:
    """Train ``layer`` on ``data`` for ``seconds`` of wall-clock time; keep the state with the best ``evaluate()``."""
    n, t = data[0].shape

    def loss(generator: torch.Generator) -> torch.Tensor:
        rows = torch.randint(n, (hp["windows"],), generator=generator)  # [B]
        starts = torch.randint(t - hp["window"] - hp["steps"] + 1, (hp["windows"],), generator=generator)  # [B]
        tokens, features, labels, targets = window_batch(data, rows, starts, hp["window"], hp["steps"])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=hp["autocast"]):
            outputs = unrolled(layer, embedding, tokens, features, hp["steps"])
        return loss_of(outputs, lm_head, vocabulary, labels, targets, hp["feature_weight"])

    return fit(layer, hp, seconds, evaluate, log, seed, loss)


def train_eagle(*, target_dir: str, texts: list[str], out: str, minutes: float, seed: int = 0, eval_texts: dict[str, str] | None = None,
                log=print, data: str | None = None, **hyperparams) -> dict:
    """Train an EAGLE layer for the target in ``target_dir`` on ``texts``; write it (with its measured accuracy) to
    ``out`` and the metrics beside it (``.json``). ``eval_texts`` as for the Medusa trainer; ``data`` the Medusa
    trainer's labelled-data file (the same texts, seed and data settings read it)."""
    from specstack_medusa.eagle import EagleInfo, EagleLayer, save_layer

    check_hyperparameters(hyperparams)
    hp = {**DEFAULTS, **hyperparams}
    torch.set_num_threads(hp["threads"])
    target, training, held_out = labelled_data(target_dir, texts, eval_texts, hp, seed, log, data)
    config = target.config
    rank = token_rank(training[2], config.vocab_size)
    draft_vocab = min(hp["draft_vocab"], config.vocab_size)
    vocabulary = Vocabulary.of(rank, draft_vocab)
    layer = EagleLayer(EagleInfo(hidden_size=config.hidden_size, attention_heads=hp["attention_heads"], intermediate_size=hp["intermediate_size"],
                                 heads=hp["steps"], window=hp["window"], vocab_size=config.vocab_size, target=Path(target_dir).name))
    lm_head = target.lm_head.weight.detach()[vocabulary.rows]  # [R, H], frozen
    embedding = target.get_input_embeddings().weight.detach()  # [V, H], frozen
    first = next(iter(eval_texts or {}), None)
    score_on = held_out.get(f"{first}:greedy") or tuple(part[: hp["eval_chunks"]] for part in training)

    def evaluate() -> float:  # the mean top-1 accuracy over steps (what a greedy stack gets)
        return float(np.mean([row[0] for row in rank_accuracy(layer, lm_head, embedding, vocabulary, score_on, 1)]))

    began = time.time()
    run = train(layer, lm_head, embedding, vocabulary, training, hp, 60 * minutes, evaluate, log, seed)
    accuracy = {name: rank_accuracy(layer, lm_head, embedding, vocabulary, held, hp["top_k"]) for name, held in held_out.items()}
    shipped = accuracy.get(f"{first}:greedy") or rank_accuracy(layer, lm_head, embedding, vocabulary, score_on, hp["top_k"])
    layer.info = attrs.evolve(layer.info, accuracy=shipped, draft_vocab=draft_vocab)
    layer.token_rank = rank
    save_layer(out, layer)
    return write_metrics(out, {**run, "train_minutes": (time.time() - began) / 60, "training_tokens": int(training[2].numel()),
                               "hyperparams": hp, "seed": seed, "held_out": held_out_metrics(accuracy, held_out, rank)})
