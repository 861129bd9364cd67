"""Drawing a token and gathering a per-head retrieval view: specstack's ways against the ones they replaced.

In one process, best of three: ``sampling.draw`` and ``sampling.sample`` against ``torch.multinomial`` for one
token of a softmax over ``--vocab`` tokens. Then a view of ``--budget`` slots out of ``--cached`` in the default
target's shape (``--dtype``), as retrieval chooses it (whole chunks of ``--chunk`` slots, each layer and KV head its
own): choosing the chunks from their scores (``torch.topk`` and a sort, against ``retrieval.best_sorted``), and
copying their keys and values into the view: ``torch.gather`` along the slots with an index expanded over the head
width (``KVStore.gather_from``'s first body), one row gather over the buffers seen as [L * H * C, D] (its second,
now ``gather_ops.TORCH_GATHER``), and the compiled copy (``gather_ops.load_gather_ops()``). The copies are checked to
give the same entries, and the two selections the same chunks.

    python examples/sampling_and_gather.py --threads 2
    python examples/sampling_and_gather.py --threads 2 --dtype bfloat16 --cached 32000 --budget 2048
"""

from __future__ import annotations

import argparse
import time

import torch

from specstack.gather_ops import TORCH_GATHER, load_gather_ops
from specstack.kvstore import KVStore
from specstack.retrieval import best_sorted
from specstack.sampling import draw, sample


def best_of_three(function, repeats: int) -> float:
    """Best mean seconds per call over three runs of ``repeats`` calls."""
    times = []
    for _ in range(3):
        began = time.perf_counter()
        for _ in range(repeats):
            function()
        times.append((time.perf_counter() - began) / repeats)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--cached", type=int, default=7500)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=8, help="slots a retrieval chunk (8: retrieval's default)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(args.vocab, generator=generator).softmax(0)  # [V]
    for name, function in (("torch.multinomial", lambda: int(torch.multinomial(probs, 1, generator=generator))),
                           ("sampling.sample", lambda: sample(probs, generator)), ("sampling.draw", lambda: draw(probs, generator))):
        print(f"{name}: {1e6 * best_of_three(function, 200):.0f} µs a token over {args.vocab}")

    layers, heads, dim, dtype = 30, 3, 64, getattr(torch, args.dtype)  # SmolLM2-135M's shape
    chunks = args.cached // args.chunk
    scores = torch.randn(layers, heads, chunks, generator=generator)  # [L, H, C]
    count = args.budget // args.chunk
    topk = lambda: scores.topk(count, dim=-1, sorted=False).indices.sort(dim=-1).values  # noqa: E731  [L, H, k]
    assert torch.equal(topk(), best_sorted(scores, count)), "the two selections differ"
    before, after = best_of_three(topk, 10), best_of_three(lambda: best_sorted(scores, count), 10)
    print(f"{count} of {chunks} chunks for {layers * heads} heads: topk and a sort {1e3 * before:.2f} ms, best_sorted {1e3 * after:.2f} ms, {before / after:.2f}x")

    source = KVStore(layers=layers, kv_heads=heads, head_dim=dim, capacity=args.cached, dtype=dtype)
    source.begin(torch.arange(args.cached))
    source.keys.copy_(torch.randn(source.keys.shape, generator=generator)), source.values.copy_(torch.randn(source.values.shape, generator=generator))
    source.commit()
    slots = (best_sorted(scores, count)[..., None] * args.chunk + torch.arange(args.chunk)).flatten(-2)  # [L, H, K]
    expected = torch.empty(2, layers, heads, slots.shape[-1], dim, dtype=dtype)  # [keys and values, L, H, K, D]

    def along_slots() -> None:
        for layer in range(layers):
            index = slots[layer, :, :, None].expand(-1, -1, dim)  # [H, K, D]
            expected[0, layer] = source.keys[layer].gather(1, index)
            expected[1, layer] = source.values[layer].gather(1, index)

    along_slots()
    print(f"a {slots.shape[-1]}-slot view of {args.cached} ({args.dtype}): torch.gather along the slots {1e3 * best_of_three(along_slots, 10):.2f} ms", end="")
    for name, gather in (("row gather", TORCH_GATHER), ("compiled", load_gather_ops())):
        view = KVStore(layers=layers, kv_heads=heads, head_dim=dim, capacity=args.budget + 40, dtype=dtype, gather_ops=gather)
        view.gather_from(source, slots, args.cached)
        assert torch.equal(view.keys[:, :, : len(view)], expected[0]) and torch.equal(view.values[:, :, : len(view)], expected[1]), f"the {name} copy differs"
        print(f", {name} ({type(gather).__name__}) {1e3 * best_of_three(lambda: view.gather_from(source, slots, args.cached), 10):.2f} ms", end="")
    print()

if __name__ == "__main__":
    main()
