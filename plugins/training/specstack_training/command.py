"""``specstack train KIND``: train a component for a target, one subcommand per kind.

``specstack train draft`` distils a small draft model (:mod:`specstack_training.distill`). Every
bad value is one ``SpecstackError`` line (exit code 2), found before any weights are read.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable

from specstack import SpecstackError

from .distill import DEFAULTS


class TrainCommand:
    """Registered through ``specstack_commands``: the ``train`` subcommand."""

    name = "train"
    help = "train a component for a target model: `specstack train draft` distils a draft"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        kinds = parser.add_subparsers(dest="kind", metavar="KIND")
        for kind, (help_text, add, _) in TRAINERS.items():
            add(kinds.add_parser(kind, help=help_text))

    def run(self, args: argparse.Namespace) -> int:
        if args.kind is None:
            raise SpecstackError(f"name what to train; allowed: {', '.join(TRAINERS)}")
        return TRAINERS[args.kind][2](args)


def _add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="target model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--text", action="append", required=True, help="training text file or shipped book name (repeatable)")
    parser.add_argument("--out", required=True, help="output directory for the draft model")
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-clock training budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-text", help="held-out text file or shipped book for greedy-agreement evaluation")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"a hyperparameter (repeatable); keys: {', '.join(DEFAULTS)}")


def _train_draft(args: argparse.Namespace) -> int:
    from specstack.run import parse_options

    from .distill import check_hyperparameters, distill

    if args.minutes <= 0:
        raise SpecstackError(f"--minutes {args.minutes:g} is not allowed; use a positive number")
    hyperparams = parse_options(args.set)
    check_hyperparameters(hyperparams)
    texts = [read_text(path) for path in args.text]
    eval_text = read_text(args.eval_text) if args.eval_text else None
    target = args.target or _default_target()
    if not os.path.isfile(os.path.join(target, "config.json")):
        raise SpecstackError(f"--target {target!r} is not a model directory (no config.json)")
    metrics = distill(target_dir=target, texts=texts, out_dir=args.out, minutes=args.minutes, seed=args.seed,
                      eval_text=eval_text, log=lambda line: print(line, flush=True), **hyperparams)
    print(json.dumps({k: v for k, v in metrics.items() if k != "hyperparams"}, indent=2))
    return 0


def _default_target() -> str:
    from specstack.models import prepare_target

    return str(prepare_target())


def read_text(path: str) -> str:
    """A text file, or the name of a book shipped in ``specstack.data`` (e.g. ``emma``)."""
    from specstack.data import BOOKS, load_book

    if path in BOOKS and not os.path.exists(path):
        return load_book(path)
    if not os.path.isfile(path):
        raise SpecstackError(f"text {path!r} is neither a file nor a shipped book; books: {', '.join(BOOKS)}")
    with open(path, encoding="utf-8") as file:
        return file.read()


# kind -> (help, add its arguments, run it)
TRAINERS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "draft": ("distil a small draft model from the target on text (knowledge distillation)", _add_draft_arguments, _train_draft),
}
