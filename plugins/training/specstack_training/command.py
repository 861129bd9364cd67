"""``specstack train KIND``: train a component for a target, one subcommand per kind.

``specstack train draft`` distils a small draft model (:mod:`specstack_training.distill`);
``specstack train medusa`` trains Medusa heads (:mod:`specstack_training.medusa`); ``specstack train eagle``
trains EAGLE's draft layer (:mod:`specstack_training.eagle`). Every bad value
is one ``SpecstackError`` line (exit code 2), found before any weights are read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Callable

from specstack import SpecstackError

from .distill import DEFAULTS
from .eagle import DEFAULTS as EAGLE_DEFAULTS
from .medusa import DEFAULTS as MEDUSA_DEFAULTS


class TrainCommand:
    """Registered through ``specstack_commands``: the ``train`` subcommand."""

    name = "train"
    help = "train a component for a target model: `specstack train draft` distils a draft, `specstack train medusa` trains heads"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        kinds = parser.add_subparsers(dest="kind", metavar="KIND")
        for kind, (help_text, add, _) in TRAINERS.items():
            add(kinds.add_parser(kind, help=help_text))

    def run(self, args: argparse.Namespace) -> int:
        if args.kind is None:
            raise SpecstackError(f"name what to train; allowed: {', '.join(TRAINERS)}")
        return TRAINERS[args.kind][2](args)


def _add_common_arguments(parser: argparse.ArgumentParser, out_help: str, keys: dict) -> None:
    """The flags every kind takes: the target, the texts, the output, the budget, the seed and ``--set``."""
    parser.add_argument("--target", default=None, help="target model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--text", action="append", required=True,
                        help="training text: a file, a directory (its .py and .txt files) or a shipped book name (repeatable)")
    parser.add_argument("--out", required=True, help=out_help)
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-clock training budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"a hyperparameter (repeatable); keys: {', '.join(keys)}")


def _inputs(args: argparse.Namespace, check_hyperparameters: Callable[[dict], None]) -> tuple[dict, list[str]]:
    """The hyperparameters and training texts of ``args``, checked (one error line each) before any weights are read."""
    from specstack.run import parse_options

    if not (math.isfinite(args.minutes) and args.minutes > 0):
        raise SpecstackError(f"--minutes {args.minutes:g} is not allowed; use a positive finite number")
    hyperparams = parse_options(args.set)
    check_hyperparameters(hyperparams)
    return hyperparams, [read_text(path) for path in args.text]


def writable(flag: str, path: str, *, folder: bool = False) -> None:
    """One error line, before any weights are read, where the file (or, ``folder``, the folder) at ``path`` cannot be made:
    the nearest part of it that exists must be a writable folder (rather than failing after the training)."""
    existing = Path(path).absolute() if folder else Path(path).absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise SpecstackError(f"{flag} {path!r} cannot be written: {str(existing)!r} is not a writable folder")


def _print_metrics(metrics: dict) -> int:
    print(json.dumps({k: v for k, v in metrics.items() if k != "hyperparams"}, indent=2))
    return 0


def _log(line: str) -> None:
    print(line, flush=True)


def _add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common_arguments(parser, "output directory for the draft model", DEFAULTS)
    parser.add_argument("--eval-text", action="append", default=[],
                        help="held-out text file or shipped book (repeatable): greedy agreement; the best mean picks the checkpoint kept")


def _train_draft(args: argparse.Namespace) -> int:
    from .distill import check_hyperparameters, distill

    writable("--out", args.out, folder=True)
    hyperparams, texts = _inputs(args, check_hyperparameters)
    eval_texts = {Path(path).stem: read_text(path) for path in args.eval_text}
    metrics = distill(target_dir=_target_dir(args.target), texts=texts, out_dir=args.out, minutes=args.minutes, seed=args.seed,
                      eval_texts=eval_texts, log=_log, **hyperparams)
    return _print_metrics(metrics)


def _add_medusa_arguments(parser: argparse.ArgumentParser, keys: dict = MEDUSA_DEFAULTS) -> None:
    _add_common_arguments(parser, "output file (.safetensors); the metrics go beside it as .json", keys)
    parser.add_argument("--eval-text", action="append", default=[],
                        help="held-out text file or shipped book (repeatable): per-step top-k accuracy; the first picks the best weights and shapes the tree")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="keep the labelled training data in PATH: a later run with the same texts, seed and data settings reads it instead of running the target")


def _add_eagle_arguments(parser: argparse.ArgumentParser) -> None:
    _add_medusa_arguments(parser, EAGLE_DEFAULTS)


def _train_medusa(args: argparse.Namespace) -> int:
    from .medusa import check_hyperparameters, train_medusa

    return _train_on_states(args, check_hyperparameters, train_medusa)


def _train_eagle(args: argparse.Namespace) -> int:
    from .eagle import check_hyperparameters, train_eagle

    return _train_on_states(args, check_hyperparameters, train_eagle)


def _train_on_states(args: argparse.Namespace, check_hyperparameters: Callable[[dict], None], trainer: Callable[..., dict]) -> int:
    """Train a draft that reads the target's hidden states (Medusa heads, an EAGLE layer) into one .safetensors file."""
    if not args.out.endswith(".safetensors"):
        raise SpecstackError(f"--out {args.out!r} is not allowed; name a .safetensors file")
    writable("--out", args.out)
    if args.data is not None:
        writable("--data", args.data)
    hyperparams, texts = _inputs(args, check_hyperparameters)
    eval_texts = {Path(path).stem: read_text(path) for path in args.eval_text}
    metrics = trainer(target_dir=_target_dir(args.target), texts=texts, out=args.out, minutes=args.minutes, seed=args.seed,
                      eval_texts=eval_texts, log=_log, data=args.data, **hyperparams)
    return _print_metrics(metrics)


def _target_dir(given: str | None) -> str:
    target = given or _default_target()
    if not os.path.isfile(os.path.join(target, "config.json")):
        raise SpecstackError(f"--target {target!r} is not a model directory (no config.json)")
    return target


def _default_target() -> str:
    from specstack.models import prepare_target

    return str(prepare_target())


def read_text(path: str) -> str:
    """A text file, a directory (its ``.py`` and ``.txt`` files, sorted, joined), or the name of a book
    shipped in ``specstack.data`` (e.g. ``emma``)."""
    from specstack.data import BOOKS, load_book

    if path in BOOKS and not os.path.exists(path):
        return load_book(path)
    if os.path.isdir(path):
        files = sorted(f for f in Path(path).rglob("*") if f.suffix in (".py", ".txt") and f.is_file())
        if not files:
            raise SpecstackError(f"text directory {path!r} holds no .py or .txt files")
        return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    if not os.path.isfile(path):
        raise SpecstackError(f"text {path!r} is neither a file, a directory nor a shipped book; books: {', '.join(BOOKS)}")
    with open(path, encoding="utf-8") as file:
        return file.read()


# kind -> (help, add its arguments, run it)
TRAINERS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "draft": ("distil a small draft model from the target on text (knowledge distillation)", _add_draft_arguments, _train_draft),
    "medusa": ("train Medusa heads on the target's hidden states (self-distillation, frozen target)", _add_medusa_arguments, _train_medusa),
    "eagle": ("train EAGLE's draft layer on the target's hidden states (frozen target)", _add_eagle_arguments, _train_eagle),
}
