"""The ``specstack`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .errors import SpecstackError
from .registry import Kind, Registry


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 0
    try:
        return args.run(args) or 0
    except SpecstackError as error:
        print(f"specstack {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specstack", description="Lossless hierarchical speculative decoding (TriForce and friends).")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    plugins = commands.add_parser("plugins", help="list every registered component by kind")
    plugins.set_defaults(run=_plugins)
    demo = commands.add_parser("demo", help="run a speculation stack against autoregressive decoding")
    demo.add_argument("--synthetic", action="store_true", help="use synthetic models (no weights needed)")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    return parser


def _plugins(args: argparse.Namespace) -> int:
    registry = Registry.create()
    for kind in Kind:
        print(f"{kind.value}:")
        for name in registry.names(kind):
            entry = registry.entry(kind, name)
            needs = f"  needs: {', '.join(entry.capabilities)}" if entry.capabilities else ""
            print(f"  {name:<20} from {entry.distribution or entry.plugin}{needs}")
    for problem in registry.problems:
        print(f"problem: plugin '{problem.plugin}' {problem.problem}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import synthetic_demo

    synthetic_demo(max_new_tokens=args.max_new_tokens, seed=args.seed)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
