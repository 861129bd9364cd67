"""How well the embedded target drafts for itself with some of its layers skipped (self-speculative layer skipping).

Draft & Verify (Zhang et al., 2023), LayerSkip and SWIFT (2024) draft with the target itself, some decoder layers
left out, and verify with all of them. Would such a draft serve as a cheaper middle level here? This script
measures, teacher-forced on held-out text, how often the target without a set of layers picks the full target's
greedy token, and the acceptance a speculative sampler would see at temperature T (the mean of sum_x min(p, q)
over positions), first for each single layer left out, then for a set grown greedily from the least harmful.

    python examples/layer_skip_agreement.py --book emma --tokens 1200 --grow 8

The layers are removed from transformers' module (fp32, no cache: a whole-text forward each), so nothing in the
package changes. Measured on 2026-11-30: docs/benchmarks.md, "Layers skipped as a draft".
"""

from __future__ import annotations

import argparse

import torch

from specstack.data import BOOKS, load_book
from specstack.models import load_target


def use_layers(module, layers: list) -> None:
    """Make ``layers`` the module's decoder layers, in order (each told its new index)."""
    module.model.layers = torch.nn.ModuleList(layers)
    module.config.num_hidden_layers = len(layers)
    for index, layer in enumerate(layers):
        layer.self_attn.layer_idx = index


def logits_without(module, layers: list, keep: list[int], ids: torch.Tensor) -> torch.Tensor:
    """[n, V] float32 logits of the module over ``ids`` [1, n] with only the decoder layers ``keep`` (in order)."""
    use_layers(module, [layers[i] for i in keep])
    try:
        with torch.inference_mode():
            return module(input_ids=ids, use_cache=False).logits[0].float()  # [n, V]
    finally:
        use_layers(module, layers)


def agreement(full: torch.Tensor, other: torch.Tensor, temperature: float) -> tuple[float, float]:
    """(greedy agreement, mean acceptance sum_x min(p, q) at ``temperature``) of ``other`` [n, V] against ``full``."""
    greedy = (other.argmax(-1) == full.argmax(-1)).float().mean().item()
    p, q = torch.softmax(full / temperature, -1), torch.softmax(other / temperature, -1)  # [n, V] each
    return greedy, torch.minimum(p, q).sum(-1).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--book", default="emma", choices=BOOKS, help="a packaged text (specstack/data)")
    parser.add_argument("--start", type=int, default=200_000, help="the character of the book the text starts at")
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--grow", type=int, default=8, help="layers to leave out together, greedily (0: single layers only)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.tokens < 2 or args.temperature <= 0 or args.grow < 0:
        parser.error(f"--tokens {args.tokens}, --temperature {args.temperature}, --grow {args.grow}: use at least 2 tokens, T > 0, grow >= 0")
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(dtype=torch.float32)
    module = target.module
    text = load_book(args.book)[args.start : args.start + 20 * args.tokens]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]  # [1, n]
    layers = list(module.model.layers)
    everything = list(range(len(layers)))
    full = logits_without(module, layers, everything, ids)
    print(f"{args.book}, {ids.shape[1]} tokens, {len(layers)} layers; greedy agreement and acceptance at T = {args.temperature}")
    singles = []
    for left in everything:
        greedy, accept = agreement(full, logits_without(module, layers, [i for i in everything if i != left], ids), args.temperature)
        singles.append((greedy, left))
        print(f"without layer {left:2d}: greedy {greedy:.3f}  acceptance {accept:.3f}", flush=True)
    left_out: list[int] = []
    for _, layer in sorted(singles, reverse=True)[: args.grow]:
        left_out.append(layer)
        greedy, accept = agreement(full, logits_without(module, layers, [i for i in everything if i not in left_out], ids), args.temperature)
        print(f"without {len(left_out):2d} layers {sorted(left_out)}: greedy {greedy:.3f}  acceptance {accept:.3f}", flush=True)


if __name__ == "__main__":
    main()
