"""Benchmark: TriForce against autoregressive decoding on the embedded default, in one process.

    python examples/benchmark_triforce.py --prompt-tokens 7500 --max-new-tokens 256 --temperatures 0 0.6

For each temperature, every stack decodes the same Pride and Prejudice prompt with the same seed,
right after the autoregressive baseline (same model, full cache, same engine). The speedup is the
ratio of decode seconds per token, measured in this process. Prefill is timed separately (it is
the same work for every stack). Results are printed and written as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from specstack import Registry, SamplingConfig
from specstack.data import book_tokens
from specstack.models import load_default
from specstack.run import parse_options


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--prompt-tokens", type=int, default=7500)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6])
    parser.add_argument("--stacks", nargs="+", default=["triforce"], help="NAME or NAME:key=value,key=value")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/benchmark_triforce.jsonl")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_default(dtype=getattr(torch, args.dtype))
    prompt = book_tokens(tokenizer, args.prompt_tokens)
    registry = Registry.create()
    records = []
    for temperature in args.temperatures:
        sampling = SamplingConfig(temperature=temperature)
        baseline = _run(registry, "autoregressive", {}, target, draft, sampling, prompt, args)
        records.append(baseline)
        for spec in args.stacks:
            name, _, opts = spec.partition(":")
            record = _run(registry, name, parse_options(opts.split(",") if opts else []), target, draft, sampling, prompt, args)
            record["speedup"] = baseline["decode_ms_per_token"] / record["decode_ms_per_token"]
            record["identical_to_baseline"] = record["tokens"] == baseline["tokens"]
            records.append(record)
            _print(record)
    _write(records, args)
    return 0


def _run(registry, name, options, target, draft, sampling, prompt, args) -> dict:
    needs_draft = registry.stack_recipe(name).needs_draft
    stack = registry.stack(name, target=target, draft=draft if needs_draft else None, sampling=sampling, seed=args.seed, **options)
    began = time.perf_counter()
    result = stack.generate(prompt, args.max_new_tokens)
    print(f"  ran {name} {options} at T={sampling.temperature} in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    n = len(result.tokens)
    return {
        "stack": name, "options": options, "temperature": sampling.temperature, "prompt_tokens": len(prompt),
        "new_tokens": n, "decode_seconds": result.seconds, "prefill_seconds": result.prefill_seconds,
        "decode_ms_per_token": 1000 * result.seconds / n, "tokens_per_second": result.tokens_per_second,
        "levels": [
            {**level.as_dict(), "ms_per_forward": 1000 * level.forward_seconds / max(level.forward_calls, 1)}
            for level in result.levels
        ],
        "tokens": list(result.tokens), "dtype": args.dtype, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
    }


def _print(record: dict) -> None:
    print(f"T={record['temperature']}: {record['stack']} {record['options']} speedup {record['speedup']:.2f}x "
          f"({record['decode_ms_per_token']:.1f} ms/token), identical to autoregressive: {record['identical_to_baseline']}")
    for level in record["levels"]:
        print(f"    {level['name']:<20} acceptance {level['acceptance_rate']:.3f} ({level['accepted']}/{level['drafted']}), "
              f"{level['forward_calls']} forwards, {level['ms_per_forward']:.1f} ms each")


def _write(records: list[dict], args) -> None:
    from pathlib import Path

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    print(f"wrote {len(records)} records to {out}")


if __name__ == "__main__":
    sys.exit(main())
