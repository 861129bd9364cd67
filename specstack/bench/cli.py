"""``specstack bench``: the command line of the comparison harness. Flags override the keys of
``--grid FILE``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import SpecstackError
from ..run import WIDEN_BF16_HELP

# flag destination -> grid key; a flag left unset keeps the grid file's value (or the default)
GRID_FLAGS = {
    "stacks": "stacks", "budgets": "budgets", "chunk_sizes": "chunk_sizes", "gamma": "gammas", "gamma1": "gamma1s",
    "gamma2": "gamma2s", "trees": "trees", "policies": "policies", "temperatures": "temperatures", "context_lengths": "context_lengths", "tasks": "tasks",
    "max_new_tokens": "max_new_tokens", "seeds": "seeds", "repeats": "repeats", "dtype": "dtype", "threads": "threads", "top_p": "top_p", "top_k": "top_k", "coupled": "coupled",
    "device": "device", "draft_device": "draft_device", "cuda_graphs": "cuda_graphs", "widen_bf16": "widen_bf16", "context": "context", "rope_scaling": "rope_scaling",
}


def add_bench_parser(commands) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``commands`` (an argparse subparsers object)."""
    bench = commands.add_parser("bench", help="benchmark stacks and baselines over a grid; resumable (see docs/bench.md)",
                                description="Run a grid of stacks x options x tasks x context lengths x temperatures x seeds.")
    bench.add_argument("--grid", metavar="FILE", help="a TOML (or YAML) grid file; flags below override its keys")
    bench.add_argument("--stacks", nargs="+", metavar="NAME[:k=v,...]", help="stack recipes or hf-generate, hf-assisted, hf-prompt-lookup")
    bench.add_argument("--budgets", nargs="+", type=int, metavar="N", help="retrieval budgets (stacks with a budget option)")
    bench.add_argument("--chunk-sizes", nargs="+", type=int, metavar="N", help="retrieval chunk sizes")
    bench.add_argument("--gamma", nargs="+", type=int, metavar="N", help="γ of two-level stacks")
    bench.add_argument("--gamma1", nargs="+", type=int, metavar="N", help="γ1 of three-level stacks (middle level)")
    bench.add_argument("--gamma2", nargs="+", type=int, metavar="N", help="γ2 of three-level stacks (target level)")
    bench.add_argument("--trees", nargs="+", metavar="SPEC", help="token-tree shapes, e.g. binary:3 widths:4/2/1 (stacks with a tree option)")
    bench.add_argument("--policies", nargs="+", metavar="NAME",
                       help="registered cache policies, e.g. retrieval h2o topk-oracle (stacks with a policy option: hierarchical, self-speculative)")
    bench.add_argument("--temperatures", nargs="+", type=float, metavar="T")
    bench.add_argument("--context-lengths", nargs="+", type=int, metavar="N", help="prompt lengths in tokens")
    bench.add_argument("--tasks", nargs="+", metavar="NAME[:k=v,...]", help="prose, needle (e.g. needle:depth=0.25)")
    bench.add_argument("--max-new-tokens", type=int)
    bench.add_argument("--seeds", nargs="+", type=int)
    bench.add_argument("--repeats", type=int, metavar="N",
                       help="turns of each group, each its baselines then its stacks again; a speedup is the median of its turns, each "
                            "against its own turn's baseline (default: 1)")
    bench.add_argument("--top-p", type=float)
    bench.add_argument("--top-k", type=int)
    bench.add_argument("--coupled", action="store_const", const=True,
                       help="coupled sampling: each position's draw fixed by the seed, so every stack samples autoregressive decoding's text")
    bench.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--threads", type=int, help="torch intra-op threads per run process")
    bench.add_argument("--device", help="the target's device: cpu, cuda or cuda:N (default: cpu)")
    bench.add_argument("--draft-device", help="the draft model's device (default: --device)")
    bench.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False,
                       help="run transformers models without CUDA graphs (no effect on the CPU)")
    bench.add_argument("--widen-bf16", action="store_const", const=True, help=WIDEN_BF16_HELP)
    bench.add_argument("--context", type=int, metavar="N", help="the target's window (default: its trained one); beyond it, RoPE-scaled")
    bench.add_argument("--rope-scaling", choices=["yarn", "linear", "extrapolate", "none"], help="how --context stretches RoPE beyond the trained window (default: yarn)")
    bench.add_argument("--synthetic", action="store_true", help="synthetic models and a byte tokenizer (no weights; tries the harness out)")
    bench.add_argument("--executor", choices=["local", "ray"], default="local")
    bench.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")
    bench.add_argument("--num-cpus", type=int, help="CPUs of a local Ray cluster")
    bench.add_argument("--out", metavar="DIR", default="results/bench", help="output directory (default: results/bench)")
    bench.add_argument("--quiet", action="store_true", help="no progress lines")
    bench.set_defaults(run=run_bench)
    return bench


def grid_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, flag) for flag, key in GRID_FLAGS.items() if getattr(args, flag, None) is not None}


def run_bench(args: argparse.Namespace) -> int:
    from .grid import load_grid
    from .harness import run_grid
    from .models import SyntheticModels

    grid = load_grid(args.grid, grid_overrides(args))  # a bad grid fails here, before anything runs
    if args.executor == "local":
        check_stacks(grid)
    models = SyntheticModels(device=grid.device or "cpu", draft_device=grid.draft_device or grid.device or "cpu") if args.synthetic else None
    table = run_grid(grid, args.out, models=models, executor=args.executor, ray_address=args.ray_address, num_cpus=args.num_cpus,
                     progress=not args.quiet, check_first=True)
    print(table.to_markdown())
    print(f"\n{table.executed} runs executed; {len(table.ok)} ok and {len(table.errors)} failed in {table.out} "
          f"(results.jsonl, results.csv, report.md)")
    if table.errors:  # a script running the bench must see that some runs gave no figures
        first = table.errors[0]
        print(f"specstack bench: {len(table.errors)} run(s) failed, the first {first['label']!r}: {first['error']}", file=sys.stderr)
        return 2 if all(error.get("error_kind") == "input" for error in table.errors) else 1  # 2: bad input, as everywhere
    return 0


def check_stacks(grid) -> None:
    """A stack name that nothing installed here registers is a typo, and an option axis that none of the stacks
    takes (unfixed) would be dropped without a word: one error line each, before any model loads.
    (``run_grid`` itself records an unknown name as a failed run, as a Ray worker with other plugins would; the
    options' values are checked once the models are loaded, ``run_grid``'s ``check_first``.)"""
    from ..registry import Registry
    from .grid import OPTION_AXES, crossed_axes
    from .stacks import Catalog

    catalog = Catalog(registry=Registry.create())
    for spec in grid.stacks:
        catalog.get(spec.name)
    crossed = {axis for spec in grid.stacks for axis in crossed_axes(grid, spec, catalog)}
    for axis in OPTION_AXES:
        if getattr(grid, axis.field) is not None and axis not in crossed:
            raise SpecstackError(f"grid key '{axis.field}' sets option '{axis.option}', which none of the stacks "
                                 f"({', '.join(spec.text for spec in grid.stacks)}) takes unfixed; add a stack that has it "
                                 f"(`specstack plugins`, docs/bench.md) or drop the key")
