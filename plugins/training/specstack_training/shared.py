"""What every trainer of this package uses: tokenising texts, chunks of them, the target's own
continuations of prompts drawn from them (self-distillation data), the learning-rate schedule over a
wall-clock budget, and the check of hyperparameter names."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from specstack import SpecstackError


def encode(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Tokenise each text without special tokens -> list of int64 arrays."""
    return [np.asarray(tokenizer(t, add_special_tokens=False)["input_ids"], dtype=np.int64) for t in texts]


def text_chunks(token_arrays: list[np.ndarray], seq_len: int, count: int, generator: np.random.Generator) -> torch.Tensor:
    """``count`` chunks of ``seq_len`` tokens at random non-overlapping places in the texts -> [N, T]."""
    pieces = [a[i : i + seq_len] for a in token_arrays for i in range(0, len(a) - seq_len + 1, seq_len)]
    if not pieces:
        raise SpecstackError(f"the texts hold fewer than seq_len={seq_len} tokens; give longer texts or a smaller seq_len")
    order = generator.permutation(len(pieces))[:count]
    return torch.from_numpy(np.stack([pieces[i] for i in order]))  # [N, T]


@torch.inference_mode()
def continuations(target, prompts: torch.Tensor, gen_len: int, temperature: float | None, batch: int) -> torch.Tensor:
    """The target's continuations of ``prompts`` [N, P]: greedy when ``temperature`` is None -> [N, P + gen_len]."""
    out = []
    for first in range(0, prompts.shape[0], batch):
        ids = prompts[first : first + batch]
        sampling = {"do_sample": False} if temperature is None else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        written = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len, min_new_tokens=gen_len,
                                   pad_token_id=0, **sampling)  # [b, P + gen_len]
        out.append(written[:, : prompts.shape[1] + gen_len])
    return torch.cat(out)


def self_distillation(target, prompts: torch.Tensor, seq_len: int, temperature: float, batch: int) -> torch.Tensor:
    """Rows of ``seq_len`` tokens: each of ``prompts`` [G, P] and the target's continuation of it, the
    first half greedy, the second sampled at ``temperature`` -> [G, T]."""
    half, written = prompts.shape[0] // 2, seq_len - prompts.shape[1]
    return torch.cat([continuations(target, prompts[:half], written, None, batch),
                      continuations(target, prompts[half:], written, temperature, batch)])  # [G, T]


def lr_factor(frac: float, warmup: float) -> float:
    """Linear warm-up then cosine decay to 5%, as a function of elapsed budget fraction."""
    if frac < warmup:
        return frac / warmup
    p = min(1.0, (frac - warmup) / max(1e-9, 1 - warmup))
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p))


def fit(model: torch.nn.Module, hp: dict, seconds: float, evaluate, log, seed: int, loss) -> dict:
    """Train ``model`` for ``seconds`` of wall-clock time, one optimiser step on each ``loss(generator)`` (a batch
    drawn with the seeded ``generator``): AdamW at ``lr`` (warm-up then cosine decay), gradients clipped at 1.
    ``evaluate()`` scores it at the start, every ``eval_every`` minutes and at the end; the best state is kept."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
    generator = torch.Generator().manual_seed(seed)

    def snapshot() -> dict:  # a copy of the weights, which training goes on changing
        return {k: v.clone() for k, v in model.state_dict().items()}

    best = {"score": evaluate(), "state": snapshot(), "step": 0}
    log(f"step 0: held-out score {best['score']:.4f}")
    began, steps, last_eval, losses = time.time(), 0, time.time(), []
    while (elapsed := time.time() - began) < seconds:
        for group in optimizer.param_groups:
            group["lr"] = hp["lr"] * lr_factor(elapsed / seconds, hp["warmup"])
        value = loss(generator)
        optimizer.zero_grad()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        steps += 1
        losses.append(float(value.detach()))
        if time.time() - last_eval > 60 * hp["eval_every"]:
            score = evaluate()
            log(f"step {steps} ({(time.time() - began) / 60:.1f} min): loss {np.mean(losses[-50:]):.3f}, held-out score {score:.4f}")
            if score > best["score"]:
                best = {"score": score, "state": snapshot(), "step": steps}
            last_eval = time.time()
    score = evaluate()
    log(f"step {steps} (end): loss {np.mean(losses[-50:]) if losses else float('nan'):.3f}, held-out score {score:.4f}")
    if score >= best["score"]:
        best = {"score": score, "state": model.state_dict(), "step": steps}
    model.load_state_dict(best["state"])
    return {"steps": steps, "best_step": best["step"], "best_score": best["score"], "final_loss": float(np.mean(losses[-50:])) if losses else None}


def check_counts_at_least_one(hyperparams: dict, keys: tuple[str, ...]) -> None:
    """Each of ``keys`` that is given must be a whole number >= 1 (threads, batches, widths): one error line
    naming the first that is not."""
    for key in keys:
        value = hyperparams.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecstackError(f"hyperparameter {key}={value!r} is not allowed; use a whole number >= 1")


def check_names(hyperparams: dict, defaults: dict) -> None:
    """Every key must be one of ``defaults`` (one error line naming the first, in sorted order, that is not)."""
    unknown = sorted(set(hyperparams) - set(defaults))
    if unknown:
        raise SpecstackError(f"hyperparameter {unknown[0]!r} is not allowed; use {', '.join(defaults)}")
