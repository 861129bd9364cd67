"""Distil a small draft model from a Llama-family target model on CPU.

The student is a standard ``LlamaForCausalLM`` (so the rest of specstack can
load it with ``AutoModelForCausalLM.from_pretrained``) that shares the target's
tokenizer and vocabulary but has a narrower residual stream and fewer layers.

Initialisation ("projected copy" of the target):
  * Take the top-``hidden`` right singular vectors ``P`` [D, d] of the target's
    tied embedding ``E`` [V, D]. The student's tied embedding is ``E @ P``.
  * The student's decoder layers are copies of chosen target layers, with the
    RMSNorm gains folded into the following projections and every matrix that
    reads or writes the residual stream projected through ``P``; attention
    heads / MLP channels beyond the student's sizes are dropped.

Sharing (``shared=K``, after Kangaroo, Liu et al., 2024, "double early exiting"): the
student starts with the target's own first K layers, unchanged and frozen, and trains the layers
after them (an adapter from layer K's hidden state to the target's output). The shared layers are not
saved: ``specstack.models.copy_target_weights`` copies them from the target at load time, as it
copies the embedding. They need the target's widths (``hidden``, ``heads``, ``kv_heads``,
``intermediate``).

Growing (``grow_from``): the student may instead start as a smaller trained draft
of the same widths. Its layers and final norm are copied in, and the student's
extra layers (initialised as above) get zero output projections, so before
training the grown student computes exactly the smaller draft's function.

Data: the given texts cut into chunks, plus with ``generations=G`` the target's own continuations of G
prompts drawn from them (self-distillation, as the Medusa trainer does: half greedy, half sampled),
because in a stack the draft drafts for what the target writes.

Training: knowledge distillation on those chunks. The target runs (in
bfloat16, for speed) over fresh chunks and its top-k log-probabilities are
kept in a replay buffer; the student minimises the cross-entropy to the
renormalised top-k teacher distribution (temperature 1), optionally plus a
small next-token cross-entropy term. The learning-rate schedule is driven by
wall-clock time, so ``minutes`` fixes the training budget. The checkpoint with
the best held-out greedy agreement is kept.

Command line (:mod:`specstack_training.command`)::

    specstack train draft --target DIR --text a.txt --text emma \\
        --eval-text held_out.txt --out OUT_DIR --minutes 60 [--set key=value ...]
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specstack import SpecstackError

from .shared import check_counts_at_least_one, check_names, encode, lr_factor, self_distillation, text_chunks

if TYPE_CHECKING:  # imported where they run: `specstack train`'s parser (and `specstack --help`) need no transformers
    from transformers import LlamaConfig, LlamaForCausalLM

DEFAULTS = dict(
    hidden=576,  # student residual width d (576 = the target's: embedding copied exactly)
    layers=(0,),  # target layers copied into the student, in order
    heads=9,  # query heads (head_dim is the target's)
    kv_heads=3,  # key/value heads
    intermediate=448,  # MLP width (kept target channels with the largest output norms)
    seq_len=256,  # tokens per training chunk
    batch=4,  # chunks per optimiser step
    top_k=64,  # teacher log-probs kept per position
    replay=3,  # student steps per freshly labelled teacher batch
    lr=3e-3,  # peak learning rate for decoder layers and norms
    emb_lr=0.0,  # learning rate for the tied embedding (0 = frozen)
    ce_weight=0.0,  # weight of the next-token cross-entropy term
    teacher_temperature=1.0,  # divides the teacher's top-k log-probs (< 1 sharpens them toward its argmax, which greedy agreement counts)
    warmup=0.03,  # fraction of the budget spent warming up the LR
    weight_decay=0.0,
    eval_positions=20480,  # held-out positions for greedy agreement
    eval_every=5.0,  # minutes between held-out evaluations
    teacher_bf16=True,  # label with a bfloat16 copy of the target (2x faster on CPU)
    autocast=True,  # bfloat16 autocast for the student's forward/backward
    threads=1,  # torch intra-op threads
    grow_from="",  # a draft directory (same widths) whose layers and final norm start the student; "" = none
    shared=0,  # the target's first layers the student runs unchanged (frozen, full width; copied in at load, not saved)
    scored=0,  # positions per chunk whose logits enter the loss, drawn at random each step (0 = all)
    generations=0,  # self-distillation: continuations of prompts from the texts the target writes (half greedy, half sampled)
    prompt_len=64,  # tokens of text each continuation starts from (it adds seq_len - prompt_len)
    gen_temperature=0.7,  # temperature of the sampled half
    gen_batch=32,  # continuations written at once
)

COUNTS = ("hidden", "heads", "kv_heads", "intermediate", "seq_len", "batch", "top_k", "replay", "eval_positions", "threads")  # each at least 1


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------


def chunk(token_arrays: list[np.ndarray], seq_len: int) -> torch.Tensor:
    """Cut every array into non-overlapping chunks of seq_len tokens -> [N, T]."""
    rows = [a[: len(a) // seq_len * seq_len].reshape(-1, seq_len) for a in token_arrays]
    return torch.from_numpy(np.concatenate(rows))  # [N, T]


def written_rows(teacher, token_arrays: list[np.ndarray], hp: dict, log) -> torch.Tensor:
    """``generations`` rows of ``seq_len`` tokens, each a prompt of ``prompt_len`` tokens from the texts
    and the teacher's continuation of it (half greedy, half sampled) -> [G, T]."""
    began = time.time()
    prompts = text_chunks(token_arrays, hp["prompt_len"], hp["generations"], np.random.default_rng(hp["seed"]))  # [G, P]
    rows = self_distillation(teacher, prompts, hp["seq_len"], hp["gen_temperature"], hp["gen_batch"])  # [G, T]
    log(f"the target wrote {rows.shape[0] * (hp['seq_len'] - hp['prompt_len']):,} tokens of continuations in {time.time() - began:.0f} s")
    return rows


# ----------------------------------------------------------------------------
# Student construction
# ----------------------------------------------------------------------------


def student_config(teacher_cfg: LlamaConfig, hp: dict) -> LlamaConfig:
    """Target config with the student's widths and depth."""
    cfg = copy.deepcopy(teacher_cfg)
    cfg.hidden_size = hp["hidden"]
    cfg.num_hidden_layers = hp["shared"] + len(hp["layers"])
    cfg.num_attention_heads = hp["heads"]
    cfg.num_key_value_heads = hp["kv_heads"]
    cfg.intermediate_size = hp["intermediate"]
    cfg.head_dim = teacher_cfg.head_dim
    cfg.tie_word_embeddings = True
    cfg.dtype = "bfloat16"
    cfg.architectures = ["LlamaForCausalLM"]
    # what the saved file leaves out, for specstack.models.copy_target_weights to copy from the target
    cfg.specstack_shared_layers = hp["shared"]
    cfg.specstack_target_embedding = hp["hidden"] == teacher_cfg.hidden_size and hp["emb_lr"] == 0  # frozen
    return cfg


def check_shareable(teacher_cfg: LlamaConfig, cfg: LlamaConfig, shared: int) -> None:
    """Sharing the target's first layers needs its widths and at least that many of its layers (one error line)."""
    if shared == 0:
        return
    if shared > teacher_cfg.num_hidden_layers:
        raise SpecstackError(f"shared={shared} is not allowed; the target has {teacher_cfg.num_hidden_layers} layers")
    widths = dict(hidden="hidden_size", heads="num_attention_heads", kv_heads="num_key_value_heads",
                  intermediate="intermediate_size")
    for key, attr in widths.items():
        if getattr(cfg, attr) != getattr(teacher_cfg, attr):
            needed = " ".join(f"{k}={getattr(teacher_cfg, a)}" for k, a in widths.items())
            raise SpecstackError(f"{key}={getattr(cfg, attr)} is not allowed with shared={shared}; "
                                 f"shared layers need the target's widths: {needed}")


def embedding_basis(emb: torch.Tensor, d: int) -> torch.Tensor:
    """Top-d right singular vectors of the target embedding -> [D, d] (identity if d == D)."""
    if d == emb.shape[1]:
        return torch.eye(d)
    _, _, vh = torch.linalg.svd(emb.double(), full_matrices=False)  # vh: [D, D]
    return vh[:d].T.float()  # [D, d]


def _select_heads(w: torch.Tensor, n: int, head_dim: int) -> torch.Tensor:
    """Keep the first n heads of a [H*hd, D] projection -> [n*hd, D]."""
    return w[: n * head_dim]


def project_layer(src, dst, P: torch.Tensor, head_dim: int) -> None:
    """Copy target decoder layer `src` into student layer `dst` through basis P [D, d]."""
    D, d = P.shape
    scale = math.sqrt(D / d)  # RMS over d dims vs D dims
    a_in = src.input_layernorm.weight[:, None] * P * scale  # [D, d]: fold norm gain + projection
    m_in = src.post_attention_layernorm.weight[:, None] * P * scale  # [D, d]
    sa, ta = src.self_attn, dst.self_attn
    nq, nkv = ta.config.num_attention_heads, ta.config.num_key_value_heads
    ta.q_proj.weight.copy_(_select_heads(sa.q_proj.weight, nq, head_dim) @ a_in)  # [nq*hd, d]
    ta.k_proj.weight.copy_(_select_heads(sa.k_proj.weight, nkv, head_dim) @ a_in)  # [nkv*hd, d]
    ta.v_proj.weight.copy_(_select_heads(sa.v_proj.weight, nkv, head_dim) @ a_in)  # [nkv*hd, d]
    ta.o_proj.weight.copy_(P.T @ sa.o_proj.weight[:, : nq * head_dim])  # [d, nq*hd]
    keep = src.mlp.down_proj.weight.norm(dim=0).argsort(descending=True)[: dst.mlp.up_proj.out_features]
    dst.mlp.gate_proj.weight.copy_(src.mlp.gate_proj.weight[keep] @ m_in)  # [I, d]
    dst.mlp.up_proj.weight.copy_(src.mlp.up_proj.weight[keep] @ m_in)  # [I, d]
    dst.mlp.down_proj.weight.copy_(P.T @ src.mlp.down_proj.weight[:, keep])  # [d, I]
    dst.input_layernorm.weight.fill_(1.0)
    dst.post_attention_layernorm.weight.fill_(1.0)


@torch.no_grad()
def build_student(teacher: LlamaForCausalLM, hp: dict) -> LlamaForCausalLM:
    """Projected copy of the target (see module docstring), fp32."""
    from transformers import LlamaForCausalLM

    cfg = student_config(teacher.config, hp)
    student = LlamaForCausalLM(cfg).float()
    E = teacher.model.embed_tokens.weight.float()  # [V, D]
    if hp["hidden"] == E.shape[1] and hp["emb_lr"] == 0:
        E = E.bfloat16().float()  # [V, D] what the loader copies in (models.copy_target_weights): train on it
    P = embedding_basis(E, hp["hidden"])  # [D, d]
    student.model.embed_tokens.weight.copy_(E @ P)  # [V, d]
    shared = hp["shared"]
    check_shareable(teacher.config, cfg, shared)
    for dst, src in zip(student.model.layers[:shared], teacher.model.layers):
        dst.load_state_dict(src.state_dict())
        dst.requires_grad_(False)
    for dst, i in zip(student.model.layers[shared:], hp["layers"]):
        project_layer(teacher.model.layers[i], dst, P, teacher.config.head_dim)
    g = teacher.model.norm.weight.float()  # [D]
    student.model.norm.weight.copy_((P * P * g[:, None]).sum(0) * math.sqrt(teacher.config.hidden_size / hp["hidden"]))
    student.tie_weights()
    if hp["grow_from"]:
        grow(student, hp["grow_from"])
    return student


@torch.no_grad()
def grow(student: LlamaForCausalLM, draft_dir: str) -> None:
    """Start the student as the smaller draft in ``draft_dir``: its layers and final norm are copied in,
    and the student's extra layers write nothing at first (zero output projections), so the grown
    student computes exactly the draft's function before training (progressive stacking)."""
    from safetensors.torch import load_file

    given = {k: v.float() for k, v in load_file(os.path.join(draft_dir, "model.safetensors")).items()
             if k != "model.embed_tokens.weight"}
    own = student.state_dict()
    for name, value in given.items():
        if name not in own or own[name].shape != value.shape:
            raise SpecstackError(f"grow_from {draft_dir!r} is not allowed; its {name} does not fit the student's widths and depth")
        own[name].copy_(value)
    depth = 1 + max(int(name.split(".")[2]) for name in given if name.startswith("model.layers."))  # shared layers are not in the file
    for layer in student.model.layers[depth:]:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


# ----------------------------------------------------------------------------
# Teacher labels and losses
# ----------------------------------------------------------------------------


@torch.no_grad()
def teacher_topk(teacher, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k teacher log-probs and token ids -> ([B, T, k] fp16, [B, T, k] int32)."""
    logits = teacher(input_ids=ids).logits.float()  # [B, T, V]
    logp = torch.log_softmax(logits, dim=-1)  # [B, T, V]
    vals, idx = logp.topk(k, dim=-1)  # [B, T, k]
    return vals.half(), idx.int()


def distill_loss(student_logits, next_ids, t_vals, t_idx, ce_weight: float, temperature: float = 1.0) -> torch.Tensor:
    """Soft cross-entropy to the renormalised top-k teacher distribution at ``temperature`` (+ CE to
    ``next_ids``, the tokens that follow each scored position; -100 where none does). A temperature
    below 1 moves the target toward the teacher's argmax: at 0 it would be the cross-entropy to it."""
    logp = torch.log_softmax(student_logits.float(), dim=-1)  # [B, S, V]
    q = torch.softmax(t_vals.float() / temperature, dim=-1)  # [B, S, k] renormalised teacher probs
    soft = -(q * logp.gather(-1, t_idx.long())).sum(-1).mean()
    if ce_weight == 0:
        return soft
    ce = F.nll_loss(logp.reshape(-1, logp.size(-1)), next_ids.reshape(-1), ignore_index=-100)
    return soft + ce_weight * ce


def next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """The token after each position -> [B, T] (-100 after the last: nothing to predict)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)  # [B, T]


def scored_columns(length: int, scored: int, gen: torch.Generator) -> torch.Tensor:
    """The positions whose logits enter this step's loss -> [S] (all of them when ``scored`` is 0)."""
    if scored == 0 or scored >= length:
        return torch.arange(length)  # [T]
    return torch.randperm(length, generator=gen)[:scored].sort().values  # [S]


# ----------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------


@torch.no_grad()
def argmax_predictions(model, token_ids: torch.Tensor, positions: int, seq_len: int = 512, batch: int = 4):
    """Teacher-forced argmax over the first `positions` tokens -> [positions] int64."""
    n = positions // seq_len + (positions % seq_len > 0)
    rows = token_ids[: n * seq_len].reshape(n, seq_len)  # [N, T]
    preds = [model(input_ids=rows[i : i + batch]).logits.argmax(-1) for i in range(0, n, batch)]  # [b, T]
    return torch.cat(preds).reshape(-1)[:positions]


def greedy_agreement(student, teacher, token_ids, *, positions: int, teacher_preds=None) -> float:
    """Fraction of teacher-forced positions where student argmax == teacher argmax.

    `token_ids` is a 1-D sequence of held-out tokens (at least `positions` long),
    scored in independent 512-token windows. `teacher_preds` may carry cached
    teacher argmaxes (from `argmax_predictions`) to skip the teacher pass.
    """
    token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    if token_ids.numel() < positions:
        raise ValueError(f"need {positions} held-out tokens, got {token_ids.numel()}")
    if teacher_preds is None:
        teacher_preds = argmax_predictions(teacher, token_ids, positions)
    was_training = student.training
    student.eval()
    s = argmax_predictions(student, token_ids, positions)
    student.train(was_training)
    return (s == teacher_preds).float().mean().item()


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


@torch.no_grad()
def calibrate_final_norm(student, ids, t_vals, t_idx, scales=(1.0, 0.5, 0.35, 0.25, 0.18, 0.12)) -> float:
    """Rescale the copied final-norm gain to the value (from a grid) with the lowest distillation loss."""
    w = student.model.norm.weight.clone()  # [d]
    losses = []
    for s in scales:
        student.model.norm.weight.copy_(w * s)
        losses.append(distill_loss(student(input_ids=ids).logits, next_tokens(ids), t_vals, t_idx, 0.0).item())
    best = scales[int(np.argmin(losses))]
    student.model.norm.weight.copy_(w * best)
    return best


def make_optimizer(student, hp: dict) -> torch.optim.Optimizer:
    emb = student.model.embed_tokens.weight
    emb.requires_grad_(hp["emb_lr"] > 0)
    rest = [p for n, p in student.named_parameters() if p is not emb and p.requires_grad]  # shared layers are frozen
    groups = [dict(params=rest, lr=hp["lr"], base_lr=hp["lr"])]
    if hp["emb_lr"] > 0:
        groups.append(dict(params=[emb], lr=hp["emb_lr"], base_lr=hp["emb_lr"]))
    return torch.optim.AdamW(groups, betas=(0.9, 0.98), weight_decay=hp["weight_decay"])


def train_step(student, opt, ids, t_vals, t_idx, hp, gen: torch.Generator) -> float:
    cols = scored_columns(ids.shape[1], hp["scored"], gen)  # [S]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=hp["autocast"]):
        hidden = student.model(input_ids=ids).last_hidden_state  # [B, T, D]
        logits = student.lm_head(hidden[:, cols])  # [B, S, V]: the LM head only where the loss looks
    loss = distill_loss(logits, next_tokens(ids)[:, cols], t_vals[:, cols], t_idx[:, cols], hp["ce_weight"], hp["teacher_temperature"])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    opt.step()
    return loss.item()


class ReplayBuffer:
    """Teacher-labelled chunks: ids [N, T], top-k log-probs and token ids [N, T, k]."""

    def __init__(self):
        self.ids, self.vals, self.idx = [], [], []

    def add(self, ids, vals, idx):
        self.ids += list(ids)
        self.vals += list(vals)
        self.idx += list(idx)

    def sample(self, gen: torch.Generator, batch: int):
        pick = torch.randint(len(self.ids), (batch,), generator=gen).tolist()
        return tuple(torch.stack([xs[i] for i in pick]) for xs in (self.ids, self.vals, self.idx))


def train(student, teacher, chunks: torch.Tensor, hp: dict, seconds: float, evaluate, log) -> dict:
    """Interleave teacher labelling and student updates for `seconds` of wall clock."""
    gen = torch.Generator().manual_seed(hp["seed"])
    order = chunks[torch.randperm(len(chunks), generator=gen)]  # [N, T]
    opt, buf = make_optimizer(student, hp), ReplayBuffer()
    best = dict(agreement={}, score=-1.0, state=None, minute=0.0)
    start, next_eval, cursor, step, losses = time.time(), hp["eval_every"] * 60, 0, 0, []
    while (elapsed := time.time() - start) < seconds:
        if cursor < len(order):  # label a fresh batch, train on it first
            ids = order[cursor : cursor + hp["batch"]]  # [B, T]
            vals, idx = teacher_topk(teacher, ids, hp["top_k"])  # [B, T, k] x2
            if cursor == 0 and not hp["grow_from"]:
                log(f"final-norm scale {calibrate_final_norm(student, ids, vals, idx)}")
            buf.add(ids, vals, idx)
            cursor += len(ids)
            batches = [(ids, vals, idx)] + [buf.sample(gen, hp["batch"]) for _ in range(hp["replay"] - 1)]
        else:  # data exhausted: keep replaying
            batches = [buf.sample(gen, hp["batch"])]
        for b in batches:
            f = lr_factor(elapsed / seconds, hp["warmup"])
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * f
            losses.append(train_step(student, opt, *b, hp, gen))
            step += 1
        if time.time() - start >= next_eval or time.time() - start >= seconds:
            next_eval += hp["eval_every"] * 60
            agree = evaluate(student)  # held-out name -> agreement; their mean picks the checkpoint
            minute = (time.time() - start) / 60
            log(f"min {minute:6.1f} step {step:6d} labelled {cursor * chunks.shape[1]:8d} tok "
                f"loss {np.mean(losses[-50:]):.4f} agreement " + " ".join(f"{k} {v:.4f}" for k, v in agree.items()))
            score = float(np.mean(list(agree.values()))) if agree else float("nan")
            if score > best["score"]:
                best = dict(agreement=agree, score=score, state=copy.deepcopy(student.state_dict()), minute=minute)
    if best["state"] is not None:
        student.load_state_dict(best["state"])
    return dict(steps=step, labelled_tokens=cursor * chunks.shape[1], best_agreement=best["agreement"],
                best_minute=best["minute"], final_loss=float(np.mean(losses[-50:])) if losses else None)


# ----------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------


def save_student(student: LlamaForCausalLM, target_dir: str, out_dir: str) -> None:
    """Write config.json, bf16 model.safetensors and the target's tokenizer files. The file leaves out
    what ``specstack.models.load_draft`` copies from the target, as the config says: the shared layers,
    and the embedding where it is the target's, frozen."""
    os.makedirs(out_dir, exist_ok=True)
    student.config.dtype = "bfloat16"
    student.config.save_pretrained(out_dir)
    left_out = {f"model.layers.{i}." for i in range(getattr(student.config, "specstack_shared_layers", 0))}
    left_out |= {"lm_head.weight"} | ({"model.embed_tokens.weight"} if student.config.specstack_target_embedding else set())  # the LM head is tied to it
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in student.state_dict().items()
             if not any(k.startswith(prefix) for prefix in left_out)}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(target_dir):
        src, dst = os.path.join(target_dir, name), os.path.join(out_dir, name)
        if name == "tokenizer.json":  # same content, without indentation (~2 MB smaller)
            with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as g:
                json.dump(json.load(f), g, ensure_ascii=False, separators=(",", ":"))
        elif name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges", "generation_config")):
            shutil.copy(src, dst)


# ----------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------


def check_hyperparameters(hyperparams: dict) -> None:
    """Every key must be one of :data:`DEFAULTS`, and ``layers`` a list of target layers (one error line)."""
    check_names(hyperparams, DEFAULTS)
    if "layers" in hyperparams:
        hyperparams["layers"] = target_layers(hyperparams["layers"])
    check_counts(hyperparams)
    check_counts_at_least_one(hyperparams, COUNTS)
    check_generation(hyperparams)
    check_temperatures(hyperparams)
    grown = str(hyperparams.get("grow_from", ""))
    if grown and not os.path.isfile(os.path.join(grown, "model.safetensors")):
        raise SpecstackError(f"grow_from {grown!r} is not allowed; name a draft directory holding model.safetensors")


def check_counts(hyperparams: dict) -> None:
    """``shared`` and ``scored`` must be whole numbers >= 0 (one error line); the widths sharing needs
    are checked against the target in :func:`build_student`."""
    examples = dict(shared="shared=2 (target layers)", scored="scored=64 (positions per chunk)")
    for key, example in examples.items():
        if key not in hyperparams:
            continue
        value = hyperparams[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SpecstackError(f"{key} {value!r} is not allowed; use a whole number >= 0, e.g. {example}")


def check_generation(hyperparams: dict) -> None:
    """The self-distillation settings (one error line): whole counts and, when there are generations,
    prompts shorter than the rows they start."""
    for key in ("generations", "prompt_len", "gen_batch"):
        value = hyperparams.get(key, DEFAULTS[key])
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "generations" else 1):
            raise SpecstackError(f"{key} {value!r} is not allowed; use a whole number >= {0 if key == 'generations' else 1}")
    prompt, row = hyperparams.get("prompt_len", DEFAULTS["prompt_len"]), hyperparams.get("seq_len", DEFAULTS["seq_len"])
    if hyperparams.get("generations", DEFAULTS["generations"]) and prompt >= row:
        raise SpecstackError(f"prompt_len {prompt} is not allowed; use fewer than seq_len={row} tokens (a continuation adds seq_len - prompt_len)")


def check_temperatures(hyperparams: dict) -> None:
    """The sampling temperature of the continuations and the teacher's in the loss: numbers > 0 (one error line)."""
    for key, example in (("gen_temperature", "0.7"), ("teacher_temperature", "0.5")):
        temperature = hyperparams.get(key, DEFAULTS[key])
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise SpecstackError(f"{key} {temperature!r} is not allowed; use a number > 0, e.g. {example}")


def target_layers(value) -> tuple[int, ...]:
    """``layers`` as given on the command line (``0,10,20``, or one number) -> a tuple of layer indices."""
    items = value if isinstance(value, (tuple, list)) else str(value).split(",")
    try:
        layers = tuple(int(str(i).strip()) for i in items)
    except ValueError:
        layers = ()
    if not layers or min(layers) < 0:
        raise SpecstackError(f"layers {value!r} is not allowed; use target layer numbers separated by commas, e.g. 0,10,20")
    return layers


def held_out_agreement(teacher, tokenizer, eval_texts: dict[str, str], positions: int):
    """A function of the student giving its greedy agreement on each held-out text (name -> fraction),
    against the fp32 teacher's argmaxes, computed once here."""
    held_out = {}
    for name, text in eval_texts.items():
        ids = torch.from_numpy(encode(tokenizer, [text])[0])  # [L]
        n = min(positions, ids.numel())
        held_out[name] = (ids, n, argmax_predictions(teacher, ids, n))
    return lambda s: {name: greedy_agreement(s, None, ids, positions=n, teacher_preds=preds)
                      for name, (ids, n, preds) in held_out.items()}


def distill(*, target_dir: str, texts: list[str], out_dir: str, minutes: float, seed: int = 0,
            eval_texts: dict[str, str] | None = None, log=print, **hyperparams) -> dict:
    """Build, train (for `minutes` of wall clock) and save a draft model; return metrics. The
    ``eval_texts`` (name -> held-out text) give a greedy agreement each; the checkpoint with the best mean is kept."""
    check_hyperparameters(hyperparams)
    hp = {**DEFAULTS, **hyperparams, "seed": seed}
    torch.set_num_threads(hp["threads"])
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    teacher = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    student = build_student(teacher, hp).train()
    token_arrays = encode(tokenizer, texts)
    chunks = chunk(token_arrays, hp["seq_len"])  # [N, T]
    evaluate = held_out_agreement(teacher, tokenizer, eval_texts or {}, hp["eval_positions"])
    if hp["teacher_bf16"]:
        teacher = teacher.to(torch.bfloat16)
    if hp["generations"]:
        chunks = torch.cat([chunks, written_rows(teacher, token_arrays, hp, log)])  # [N + G, T]
    t0 = time.time()
    metrics = train(student, teacher, chunks, hp, minutes * 60, evaluate, log)
    metrics.update(train_minutes=(time.time() - t0) / 60, train_tokens=int(chunks.numel()),
                   params=sum(p.numel() for p in student.parameters()),
                   hyperparams={k: (list(v) if isinstance(v, tuple) else v) for k, v in hp.items()})
    save_student(student, target_dir, out_dir)
    metrics["eval_positions"] = hp["eval_positions"]
    with open(os.path.join(out_dir, "distill_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    return metrics
