"""Train Medusa heads for a frozen target on CPU (Cai et al., 2024, Medusa-1: frozen backbone).

Data (:func:`prepare`): chunks of the training texts, plus the target's own continuations of
prompts drawn from them (self-distillation: half greedy, half sampled at ``gen_temperature``),
because the heads draft for what the target itself writes. One pass of the target labels every chunk:
its last hidden state h_t [H] at each position and its greedy token a_t (what it predicts for
position t + 1). With ``teacher_bf16`` a bfloat16 copy of the target writes and labels it (labelling
ran 4.7x faster on 2 threads of a CPU with AMX: 3,021 against 649 tokens/s); ``--data`` keeps it for the next run
(:func:`cached_prepare`). Held-out data is always labelled by the float32 target.

Loss: head k (k = 1 … K) on h_t, through the target's own frozen LM head, is trained by cross-entropy
to predict a_{t+k}: the target's greedy token k positions further on, what the level it drafts for will
accept at temperature 0. With ``soft_temperature`` τ > 0 it is trained instead by cross-entropy to the
target's distribution there, p_τ = softmax(LM head(h_{t+k}) / τ) over its ``soft_top`` most likely tokens,
renormalised (soft labels, as in Medusa-2's self-distillation; computed once from the stored states before
training), whose argmax is a_{t+k}: a token tree verifies a deterministic candidate with
the target's probability of it at the stack's T, so candidates ranked by E[p_τ] cover the most of
it at T = τ, where hard labels rank by how often a token is the argmax and give no weight to a
reliable runner-up. The held-out score is then that coverage: the mean p_τ of every head's top
candidate. Heads with ``token_input`` also read the embedding of x_{t+1}, the chunk's
next token (:mod:`specstack_medusa.heads`). Chained heads (one head, K steps) are trained unrolled: step k
reads its own step k - 1 and the embedding of x_{t+k}, the row's token, and is trained to predict
a_{t+k}, with the same loss, labels and evaluation as parallel head k. Only the heads learn (AdamW, warm-up then cosine decay, all driven by the
wall-clock budget ``minutes``).

Evaluation (:func:`rank_accuracy`): on held-out text the drafter never saw, the fraction of positions
whose head-k rank-r candidate is a_{t+k}, for r < ``top_k``: top-1 is the r = 0 column, top-5 the sum
of the first five. It is measured twice, on the held-out text itself and on the target's greedy
continuations of held-out prompts (the regime of a greedy stack); the second table ships with the
heads and shapes the drafter's tree.

Command line (:mod:`specstack_training.command`)::

    specstack train medusa --text emma --text /usr/lib/python3.11/json --eval-text prideprejudice \\
        --out heads.safetensors --minutes 60 [--set key=value ...]
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from specstack import SpecstackError
from specstack.draft_vocabulary import coverage, token_rank  # the ranking a draft_vocab takes, as the core reads it

from .shared import check_counts_at_least_one, check_names, continuations, encode, fit, self_distillation, text_chunks

DEFAULTS = dict(
    heads=4,  # K: head k predicts the token k + 1 positions ahead of the state it reads
    layers=1,  # residual blocks per head
    seq_len=256,  # tokens per labelled chunk
    chunks=1200,  # chunks of the training texts to label
    generations=1536,  # self-distillation: continuations the target writes (half greedy, half sampled)
    prompt_len=64,  # tokens of text each continuation starts from (it adds seq_len - prompt_len)
    gen_temperature=0.7,
    gen_batch=64,  # continuations written at once
    label_batch=16,  # chunks labelled per target forward
    positions=256,  # positions per optimiser step (each trains every head)
    lr=1e-3,
    warmup=0.05,  # fraction of the budget spent warming up the learning rate
    weight_decay=0.0,
    eval_chunks=24,  # held-out chunks of text, and as many greedy continuations of held-out prompts
    eval_every=5.0,  # minutes between held-out evaluations (the best heads are kept)
    top_k=8,  # ranks measured per head (the drafter's tree uses them)
    threads=1,
    token_input=True,  # heads also read the embedding of the token after the state they read (heads.py)
    chained=False,  # one head applied step after step on its own output, reading each next token (heads.py)
    draft_vocab=8192,  # the heads' default draft vocabulary: the tokens the target chose most often in the training data (0: all)
    teacher_bf16=True,  # a bfloat16 copy of the target writes and labels the training data (held-out data: always float32)
    autocast=True,  # bfloat16 autocast for the heads' forward and backward
    soft_temperature=0.0,  # > 0: learn the target's distribution at this temperature (soft labels), not its greedy token
    soft_top=32,  # soft labels: the target's most likely tokens kept at each position (renormalised)
)

COUNTS = ("heads", "layers", "seq_len", "positions", "label_batch", "gen_batch", "eval_chunks", "top_k", "threads", "soft_top")  # each at least 1

DATA_KEYS = ("seq_len", "chunks", "generations", "prompt_len", "gen_temperature", "teacher_bf16")  # what the labelled data depends on


def check_values(hyperparams: dict, defaults: dict) -> None:
    """Every key must be one of ``defaults`` and its value of the default's kind (true or false, a non-negative integer
    or number): one error line otherwise. Flags given as 0 or 1 become booleans."""
    check_names(hyperparams, defaults)
    for key, value in hyperparams.items():
        if isinstance(defaults[key], bool):
            if value not in (True, False, 0, 1):
                raise SpecstackError(f"hyperparameter {key}={value!r} is not allowed; use true or false")
            hyperparams[key] = bool(value)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (isinstance(defaults[key], int) and not isinstance(value, int)):
            kind = "a non-negative integer" if isinstance(defaults[key], int) else "a non-negative number"
            raise SpecstackError(f"hyperparameter {key}={value!r} is not allowed; use {kind}")


def check_hyperparameters(hyperparams: dict) -> None:
    """Every key must be a known hyperparameter: one error line otherwise."""
    check_values(hyperparams, DEFAULTS)
    check_counts_at_least_one(hyperparams, COUNTS)
    if hyperparams.get("prompt_len", DEFAULTS["prompt_len"]) >= hyperparams.get("seq_len", DEFAULTS["seq_len"]):
        raise SpecstackError("hyperparameter prompt_len must be smaller than seq_len (a continuation adds seq_len - prompt_len tokens)")


# -- data ------------------------------------------------------------------------------------------


@torch.inference_mode()
def label(target, chunks: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's last hidden states [N, T, H] (in its dtype) and greedy tokens [N, T] over ``chunks`` [N, T]."""
    states, greedy = [], []
    for first in range(0, chunks.shape[0], batch):
        hidden = target.model(input_ids=chunks[first : first + batch]).last_hidden_state  # [b, T, H]
        states.append(hidden)  # in the target's dtype: a bfloat16 teacher's states take half the memory
        greedy.append(target.lm_head(hidden).argmax(-1))  # [b, T]
    return torch.cat(states), torch.cat(greedy)


def prepare(target, token_arrays: list[np.ndarray], hp: dict, seed: int, log) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labelled training data, rows of ``seq_len`` tokens: (tokens [N, T], states [N, T, H], greedy tokens
    [N, T]) over text chunks and the target's own continuations (``seq_len - prompt_len`` tokens after a prompt)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    began = time.time()
    chunks = text_chunks(token_arrays, hp["seq_len"], hp["chunks"], rng)  # [N, T]
    if hp["generations"]:
        prompts = text_chunks(token_arrays, hp["prompt_len"], hp["generations"], rng)  # [G, P]
        chunks = torch.cat([chunks, self_distillation(target, prompts, hp["seq_len"], hp["gen_temperature"], hp["gen_batch"])])
        log(f"the target wrote {prompts.shape[0] * (hp['seq_len'] - hp['prompt_len']):,} tokens of continuations in {time.time() - began:.0f} s")
    states, greedy = label(target, chunks, hp["label_batch"])
    log(f"labelled {chunks.numel():,} tokens in {time.time() - began:.0f} s")
    return chunks, states, greedy


def cached_prepare(target, token_arrays: list[np.ndarray], hp: dict, seed: int, log, path: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`prepare`, kept in ``path`` (when given) for the next run with the same texts, seed and data
    hyperparameters (``DATA_KEYS``): training other heads on the same data skips the target's passes."""
    key = hashlib.sha256(repr((seed, [hp[k] for k in DATA_KEYS], [hashlib.sha256(a.tobytes()).hexdigest() for a in token_arrays])).encode()).hexdigest()
    if path and Path(path).is_file():
        saved = torch.load(path, weights_only=True)
        if saved.get("key") == key:
            log(f"labelled data read from {path}")
            return saved["tokens"], saved["states"], saved["greedy"]
        log(f"{path} holds data labelled from other texts or settings: labelling again")
    tokens, states, greedy = prepare(target, token_arrays, hp, seed, log)
    if path:
        torch.save({"key": key, "tokens": tokens, "states": states, "greedy": greedy}, path)
    return tokens, states, greedy


def positions_ahead(cols: torch.Tensor, heads: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, K] the position whose label head k (1 … K) on column ``col`` learns, col + k (the row's last past its end),
    and [n, K] whether col + k is inside a row of ``length``."""
    ahead = cols[:, None] + torch.arange(1, heads + 1)  # [n, K]
    return ahead.clamp_max(length - 1), ahead < length


def targets(greedy: torch.Tensor, heads: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[n, K] what head k (1 … K) on the state at (row, col) predicts: a_{col+k}, or -1 past the row's end."""
    ahead, inside = positions_ahead(cols, heads, greedy.shape[1])  # [n, K] each
    return torch.where(inside, greedy[rows[:, None], ahead], -1)  # [n, K]


COVERAGE_SIZES = (4096, 8192, 16384)  # draft vocabularies whose coverage of the held-out greedy tokens is reported


# -- training and evaluation -----------------------------------------------------------------------


def head_logits(heads, lm_head: torch.Tensor, embedding: torch.Tensor, tokens: torch.Tensor, states: torch.Tensor,
                rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The states at (``rows``, ``cols``) [n] of ``states`` [N, T, H] -> [K, n, V] logits of every head through
    the frozen LM head weight [V, H]; heads with token input also read the embedding (``embedding`` [V, H])
    of the token after each state, ``tokens[row, col + 1]`` (chained heads: of ``tokens[row, col + k]`` at
    step k; past the row's end, the last token: those steps have no label)."""
    after = None
    if heads.info.token_input:
        steps = heads.info.heads if heads.info.chained else 1
        ahead = positions_ahead(cols, steps, tokens.shape[1])[0].T  # [S, n]
        after = embedding[tokens[rows[None], ahead]]  # [S, n, H]
        after = after if heads.info.chained else after[0]  # chained: [K, n, H]; else [n, H]
    return heads(states[rows, cols].float(), after) @ lm_head.T  # [K, n, V]


def head_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every head's ``logits`` [K, n, V] against its labels [n, K] (-1: none)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.T.flatten(), ignore_index=-1)


@torch.no_grad()
def teacher_probs(lm_head: torch.Tensor, states: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, heads: int,
                  temperature: float) -> torch.Tensor:
    """[K, n, V] the target's distribution at ``temperature`` where head k on the state at (row, col) predicts:
    softmax(LM head(h_{col+k}) / T), whose argmax is the label a_{col+k} (past the row's end: the last
    position's, and :func:`targets` marks it -1)."""
    ahead, _ = positions_ahead(cols, heads, states.shape[1])  # [n, K]
    return torch.softmax(target_logits(lm_head, states[rows[:, None], ahead].transpose(0, 1)) / temperature, dim=-1)  # [K, n, V]


def target_logits(lm_head: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """[..., H] stored states -> [..., V] the target's logits, in float32, computed in the states' dtype (the
    labelling target's) as that target computed them."""
    return (hidden @ lm_head.T.to(hidden.dtype)).float()


@torch.inference_mode()
def soft_labels(lm_head: torch.Tensor, states: torch.Tensor, temperature: float, top: int, batch: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's soft label, computed once before training: the target's distribution at ``temperature``
    over its ``top`` most likely tokens, renormalised ([N, T, top] probabilities), and those tokens' ids
    ([N, T, top]), from the stored states [N, T, H] through the LM head [V, H] in the labelling target's dtype."""
    flat = states.flatten(0, 1)  # [N*T, H]
    probs, ids = [], []
    for first in range(0, flat.shape[0], batch):
        hidden = flat[first : first + batch]  # [b, H]
        values, index = target_logits(lm_head, hidden).topk(min(top, lm_head.shape[0]), dim=-1)  # [b, top]
        probs.append(torch.softmax(values / temperature, dim=-1))
        ids.append(index.int())
    return torch.cat(probs).view(*states.shape[:2], -1), torch.cat(ids).view(*states.shape[:2], -1)


def soft_head_loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, cols: torch.Tensor,
                   inside: torch.Tensor) -> torch.Tensor:
    """Mean soft cross-entropy of every head's ``logits`` [K, n, V] (head k on the state at (row, col)) to the
    soft label at (row, col + k) (:func:`soft_labels`), over the positions with a label (``inside`` [n, K])."""
    probs, ids = labels  # [N, T, top] each
    ahead, _ = positions_ahead(cols, logits.shape[0], probs.shape[1])  # [n, K]
    q, index = probs[rows[:, None], ahead].transpose(0, 1), ids[rows[:, None], ahead].transpose(0, 1).long()  # [K, n, top] each
    each = -(q * torch.log_softmax(logits.float(), dim=-1).gather(-1, index)).sum(-1)  # [K, n]
    weight = inside.T.float()  # [K, n]
    return (each * weight).sum() / weight.sum().clamp_min(1)


def loss_of(logits: torch.Tensor, greedy: torch.Tensor, soft: tuple[torch.Tensor, torch.Tensor] | None, rows: torch.Tensor,
            cols: torch.Tensor) -> torch.Tensor:
    """The training loss of the heads' ``logits`` [K, n, V] at (``rows``, ``cols``): cross-entropy to the greedy
    tokens, or with ``soft`` (:func:`soft_labels`) to the target's distributions."""
    labels = targets(greedy, logits.shape[0], rows, cols)  # [n, K]
    if soft is None:
        return head_loss(logits, labels)
    return soft_head_loss(logits, soft, rows, cols, labels >= 0)


def every_position(states: torch.Tensor, batch: int):
    """The (rows [b], cols [b]) of every position of ``states`` [N, T, H], ``batch`` at a time, row by row."""
    n, t, _ = states.shape
    rows, cols = torch.meshgrid(torch.arange(n), torch.arange(t), indexing="ij")
    rows, cols = rows.reshape(-1), cols.reshape(-1)
    for first in range(0, rows.shape[0], batch):
        yield rows[first : first + batch], cols[first : first + batch]


@torch.inference_mode()
def rank_accuracy(heads, lm_head: torch.Tensor, embedding: torch.Tensor, data: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int,
                  batch: int = 512) -> list[list[float]]:
    """[K][top_k]: over every position of ``data`` (tokens [N, T], states [N, T, H], greedy tokens [N, T])
    with a label, the fraction whose head-k rank-r candidate is the target's greedy token a_{t+k} (top-1
    is column 0)."""
    tokens, states, greedy = data
    hits = torch.zeros(heads.info.heads, top_k)  # [K, top_k]
    counted = torch.zeros(heads.info.heads)  # [K]
    for r, c in every_position(states, batch):
        labels = targets(greedy, heads.info.heads, r, c)  # [b, K]
        ranks = head_logits(heads, lm_head, embedding, tokens, states, r, c).topk(top_k, dim=-1).indices  # [K, b, top_k]
        hit = (ranks == labels.T[:, :, None]) & (labels.T[:, :, None] >= 0)  # [K, b, top_k]
        hits += hit.sum(1).float()
        counted += (labels >= 0).sum(0).float()
    return (hits / counted.clamp_min(1)[:, None]).tolist()


@torch.inference_mode()
def first_candidate_mass(heads, lm_head: torch.Tensor, embedding: torch.Tensor, data: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                         temperature: float, batch: int = 512) -> list[float]:
    """[K]: over every position of ``data`` with a label, the mean probability the target gives, at
    ``temperature``, to head k's top candidate: the chance a token tree accepts it at that T
    (teacher-forced)."""
    tokens, states, greedy = data
    mass, counted = torch.zeros(heads.info.heads), torch.zeros(heads.info.heads)  # [K], [K]
    for r, c in every_position(states, batch):
        inside = (targets(greedy, heads.info.heads, r, c) >= 0).T.float()  # [K, b]
        top = head_logits(heads, lm_head, embedding, tokens, states, r, c).argmax(-1, keepdim=True)  # [K, b, 1]
        p = teacher_probs(lm_head, states, r, c, heads.info.heads, temperature).gather(-1, top)[..., 0]  # [K, b]
        mass += (p * inside).sum(1)
        counted += inside.sum(1)
    return (mass / counted.clamp_min(1)).tolist()


def train(heads, lm_head: torch.Tensor, embedding: torch.Tensor, data: tuple[torch.Tensor, torch.Tensor, torch.Tensor], hp: dict, seconds: float,
          evaluate, log, seed: int) -> dict:
    """Train ``heads`` on ``data`` (tokens, states, greedy tokens) for ``seconds`` of wall-clock time; keep
    the state with the best ``evaluate()`` score."""
    tokens, states, greedy = data
    n, t, _ = states.shape
    soft = None
    if hp["soft_temperature"]:
        began = time.time()
        soft = soft_labels(lm_head, states, hp["soft_temperature"], hp["soft_top"])  # [N, T, top] probabilities and ids
        log(f"soft labels (the target's top {hp['soft_top']} at T = {hp['soft_temperature']}) in {time.time() - began:.0f} s")

    def loss(generator: torch.Generator) -> torch.Tensor:
        rows = torch.randint(n, (hp["positions"],), generator=generator)  # [n]
        cols = torch.randint(t - 1, (hp["positions"],), generator=generator)  # [n]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=hp["autocast"]):
            logits = head_logits(heads, lm_head, embedding, tokens, states, rows, cols)  # [K, n, V]
        return loss_of(logits, greedy, soft, rows, cols)

    return fit(heads, hp, seconds, evaluate, log, seed, loss)


def train_medusa(*, target_dir: str, texts: list[str], out: str, minutes: float, seed: int = 0, eval_texts: dict[str, str] | None = None,
                 log=print, data: str | None = None, **hyperparams) -> dict:
    """Train heads for the target in ``target_dir`` on ``texts``; write them (with their measured
    accuracy) to ``out`` and the metrics beside it (``out`` with ``.json``). ``eval_texts`` (name ->
    text) are held out: the first one's greedy continuations pick the best heads and shape the
    drafter's tree; every one is reported. ``data``: a file that keeps the labelled training data
    (:func:`cached_prepare`)."""
    from specstack_medusa.heads import HeadsInfo, MedusaHeads, save_heads

    check_hyperparameters(hyperparams)
    hp = {**DEFAULTS, **hyperparams}
    torch.set_num_threads(hp["threads"])
    target, training, held_out = labelled_data(target_dir, texts, eval_texts, hp, seed, log, data)
    config = target.config
    heads = MedusaHeads(HeadsInfo(hidden_size=config.hidden_size, heads=hp["heads"], layers=hp["layers"], vocab_size=config.vocab_size,
                                  token_input=hp["token_input"] or hp["chained"], chained=hp["chained"], target=Path(target_dir).name))
    lm_head = target.lm_head.weight.detach()  # [V, H], frozen
    embedding = target.get_input_embeddings().weight.detach()  # [V, H], frozen
    first = next(iter(eval_texts or {}), None)
    score_on = held_out.get(f"{first}:greedy") or tuple(part[: hp["eval_chunks"]] for part in training)

    def evaluate() -> float:  # the mean top-1 accuracy over heads (what a greedy stack gets), or their top candidates' p_τ
        if hp["soft_temperature"]:
            return float(np.mean(first_candidate_mass(heads, lm_head, embedding, score_on, hp["soft_temperature"])))
        return float(np.mean([row[0] for row in rank_accuracy(heads, lm_head, embedding, score_on, 1)]))

    began = time.time()
    run = train(heads, lm_head, embedding, training, hp, 60 * minutes, evaluate, log, seed)
    accuracy = {name: rank_accuracy(heads, lm_head, embedding, held, hp["top_k"]) for name, held in held_out.items()}
    shipped = accuracy.get(f"{first}:greedy") or rank_accuracy(heads, lm_head, embedding, score_on, hp["top_k"])
    heads.info = attrs.evolve(heads.info, accuracy=shipped, draft_vocab=min(hp["draft_vocab"], config.vocab_size))
    heads.token_rank = token_rank(training[2], config.vocab_size)
    save_heads(out, heads)
    per_text = held_out_metrics(accuracy, held_out, heads.token_rank)
    if hp["soft_temperature"]:
        for name, held in held_out.items():
            per_text[name]["first_candidate_mass"] = first_candidate_mass(heads, lm_head, embedding, held, hp["soft_temperature"])
    return write_metrics(out, {**run, "train_minutes": (time.time() - began) / 60, "training_tokens": int(training[2].numel()),
                               "hyperparams": hp, "seed": seed, "held_out": per_text})


def labelled_data(target_dir: str, texts: list[str], eval_texts: dict[str, str] | None, hp: dict, seed: int, log, data: str | None) -> tuple:
    """What a draft that reads the target's hidden states trains on: the frozen float32 target in ``target_dir``, the
    labelled training data of ``texts`` (written by a bf16 copy of the target where ``teacher_bf16``; kept in the file
    ``data``: :func:`cached_prepare`), and each held-out text's labelled data by ``name:text`` and ``name:greedy``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    writer = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval() if hp["teacher_bf16"] else target
    training = cached_prepare(writer, encode(tokenizer, texts), hp, seed, log, data)  # (tokens, states, greedy)
    del writer
    held_out = {f"{name}:{kind}": part for name, text in (eval_texts or {}).items()
                for kind, part in label_held_out(target, encode(tokenizer, [text])[0], hp, seed, log).items()}
    return target, training, held_out


def held_out_metrics(accuracy: dict[str, list[list[float]]], held_out: dict, rank: torch.Tensor) -> dict[str, dict]:
    """Per held-out text: its positions, each step's top-1 and top-5 accuracy, the whole rank accuracy table, and how
    much of its greedy tokens draft vocabularies of the ``rank`` ordering cover."""
    return {name: {"positions": int(held[2].numel()), "top1": [row[0] for row in accuracy[name]], "top5": [sum(row[:5]) for row in accuracy[name]],
                   "rank_accuracy": accuracy[name], "draft_vocab_coverage": {size: coverage(rank, held[2], size) for size in COVERAGE_SIZES}}
            for name, held in held_out.items()}


def write_metrics(out: str, metrics: dict) -> dict:
    """Write ``metrics`` beside the trained file ``out`` (as .json) and return them."""
    Path(out).with_suffix(".json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def label_held_out(target, tokens: np.ndarray, hp: dict, seed: int, log) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Held-out data, labelled: ``text`` (chunks of the held-out text) and ``greedy`` (the target's greedy
    continuations of prompts from it)."""
    if hp["eval_chunks"] == 0:
        return {}
    rng = np.random.default_rng(seed + 1)
    chunks = text_chunks([tokens], hp["seq_len"], hp["eval_chunks"], rng)  # [E, T]
    prompts = text_chunks([tokens], hp["prompt_len"], hp["eval_chunks"], rng)  # [E, P]
    written = continuations(target, prompts, hp["seq_len"] - hp["prompt_len"], None, hp["gen_batch"])  # [E, T]
    text, greedy = label(target, chunks, hp["label_batch"]), label(target, written, hp["label_batch"])
    keep = hp["prompt_len"] - 1  # score the continuation only: heads predicting tokens the target wrote
    log(f"held out: {chunks.numel():,} text tokens, {prompts.shape[0] * (written.shape[1] - hp['prompt_len']):,} continuation tokens")
    return {"text": (chunks, *text), "greedy": (written[:, keep:], greedy[0][:, keep:], greedy[1][:, keep:])}
