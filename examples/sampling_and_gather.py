"""Drawing a token and gathering a per-head retrieval view: specstack's ways against the ones they replaced.

In one process, alternated, best of three: ``sampling.draw`` and ``sampling.sample`` against
``torch.multinomial`` for one token of a softmax over ``--vocab`` tokens; ``KVStore.gather_from`` with
slots per layer and KV head against ``torch.gather`` along the slots with an index expanded over the head
width (its former body), for a view of ``--budget`` slots out of ``--cached`` in the default target's shape,
fp32. The two gathers are checked to copy the same entries.

    python examples/sampling_and_gather.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from specstack.kvstore import KVStore
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(args.vocab, generator=generator).softmax(0)  # [V]
    for name, function in (("torch.multinomial", lambda: int(torch.multinomial(probs, 1, generator=generator))),
                           ("sampling.sample", lambda: sample(probs, generator)), ("sampling.draw", lambda: draw(probs, generator))):
        print(f"{name}: {1e6 * best_of_three(function, 200):.0f} µs a token over {args.vocab}")

    layers, heads, dim = 30, 3, 64  # SmolLM2-135M's
    source = KVStore(layers=layers, kv_heads=heads, head_dim=dim, capacity=args.cached, dtype=torch.float32)
    source.begin(torch.arange(args.cached))
    source.keys.normal_(generator=generator), source.values.normal_(generator=generator)
    source.commit()
    view = KVStore(layers=layers, kv_heads=heads, head_dim=dim, capacity=args.budget, dtype=torch.float32)
    slots = torch.stack([torch.randperm(args.cached, generator=generator)[: args.budget].sort().values
                         for _ in range(layers * heads)]).view(layers, heads, args.budget)  # [L, H, K]
    expected = torch.empty(2, layers, heads, args.budget, dim)  # [keys and values, L, H, K, D]

    def along_slots() -> None:
        for layer in range(layers):
            index = slots[layer, :, :, None].expand(-1, -1, dim)  # [H, K, D]
            expected[0, layer] = source.keys[layer].gather(1, index)
            expected[1, layer] = source.values[layer].gather(1, index)

    def by_rows() -> None:
        view.gather_from(source, slots, args.cached)

    along_slots(), by_rows()
    assert torch.equal(view.keys, expected[0]) and torch.equal(view.values, expected[1]), "the two gathers differ"
    before, after = best_of_three(along_slots, 10), best_of_three(by_rows, 10)
    print(f"a {args.budget}-slot view of {args.cached}: torch.gather along the slots {1e3 * before:.2f} ms, "
          f"KVStore.gather_from {1e3 * after:.2f} ms, {before / after:.2f}x")


if __name__ == "__main__":
    main()
