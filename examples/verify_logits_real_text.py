"""A verify's logits on real text through the bf16 attention kernels, against the widening path's.

The embedded target (bf16) reads ``--context`` tokens of Emma into its cache (the widening attention, bf16 products
widened), then verifies the next 16 tokens three ways over the same cache: with this checkout's attention kernel
(AMX tiles or bf16 dot products, as this CPU has them), with another version built from ``--source``, and with the
widening path. It prints each kernel's largest and mean logit difference from the widening path's, and how many of the
16 rows keep its top token. Random caches (``examples/forward_versions.py --other-order``) amplify any change of
rounding into logit differences of 10-30; real text shows the rounding's own size.

    mkdir -p /tmp/before && git show HEAD~1:specstack/csrc/decode_attention.cpp > /tmp/before/decode_attention.cpp
    cp specstack/csrc/*.h /tmp/before/
    python examples/verify_logits_real_text.py --source /tmp/before/decode_attention.cpp --context 7400
"""

from __future__ import annotations

import argparse
import lzma
from importlib.resources import files
from pathlib import Path

import attrs
import torch

from specstack.batch import TokenBatch
from specstack.decode_attention import load_decode_kernel
from specstack.models import load_target

VERIFY = 16  # tokens verified


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="another version of csrc/decode_attention.cpp")
    parser.add_argument("--context", type=int, default=7400, help="tokens of Emma in the cache before the verify")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_target(dtype=torch.bfloat16)[:2]
    text = lzma.open(files("specstack.data") / "emma.txt.xz", "rt").read()[200_000:]
    ids = tokenizer.encode(text[: 8 * (args.context + VERIFY)])[: args.context + VERIFY]
    this, other = load_decode_kernel(), load_decode_kernel(source=args.source)
    if this is None or other is None:
        raise SystemExit("a kernel did not build here")
    widening = attrs.evolve(this, amx=False, dot_products=False)
    store = model.new_cache(len(ids) + 8)
    cached = len(ids) - VERIFY
    with torch.no_grad():
        model.attention_kernel = widening
        for start in range(0, cached, 256):
            model.forward(TokenBatch.chain(ids[start : min(start + 256, cached)], start, 1), store)
        logits = {}
        for name, kernel in (("this", this), ("other", other), ("widening", widening)):
            model.attention_kernel = kernel
            logits[name] = model.forward(TokenBatch.chain(ids[cached:], cached, VERIFY), store).float()  # [16, V]
            store.truncate(cached)
    reference = logits["widening"]
    print(f"{cached} tokens cached, a verify of {VERIFY}; the largest logit {float(reference.abs().max()):.2f}")
    for name in ("this", "other"):
        difference = (logits[name] - reference).abs()
        same = int((logits[name].argmax(-1) == reference.argmax(-1)).sum())
        print(f"{name}: largest difference {float(difference.max()):.4g}, mean {float(difference.mean()):.4g}, top token kept in {same} / {VERIFY}")


if __name__ == "__main__":
    main()
