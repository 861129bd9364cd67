"""The ``specstack`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from .bench.cli import add_bench_parser
from .bench.floor import add_floor_parser
from .bench.quality import add_quality_parser
from .errors import SpecstackError
from .registry import Kind, Registry
from .run import WIDEN_BF16_HELP, torch_threads

# What `specstack demo` (and `make demo`) compares: TriForce, and the fastest stack measured on this CPU
# (docs/results.md, "Medusa trees priced node by node": min_ngram=1 paid at 7K and lost at 32K)
DEMO_STACKS = ("triforce", "medusa-lookup")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(argv)
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 0
    try:
        with torch_threads():  # a command's --threads is its own
            return args.run(args) or 0
    except SpecstackError as error:
        print(f"specstack {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`specstack plugins | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors in one line, without the usage block: ``specstack bench: error:
    argument --seeds: invalid int value: 'x' (see specstack bench --help)``. Every subcommand's parser is one
    (``add_subparsers`` makes its parsers of the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = _Parser(prog="specstack", description="Lossless hierarchical speculative decoding (TriForce and friends).")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    plugins = commands.add_parser("plugins", help="list every registered component by kind")
    plugins.set_defaults(run=_plugins)

    prepare = commands.add_parser("prepare", help="convert the embedded default target (GGUF) into the local cache once, and build the CPU kernels")
    prepare.set_defaults(run=_prepare)

    generate = commands.add_parser("generate", help="generate text with a named stack")
    source = generate.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin, the default)")
    source.add_argument("--book", help="use a shipped public-domain book as the prompt (see --prompt-tokens)")
    generate.add_argument("--prompt-tokens", type=int, default=None, help="cut the prompt to exactly this many tokens")
    _add_stack_options(generate, default_stack="triforce")
    generate.add_argument("--json", action="store_true", help="print a JSON record instead of the text")
    generate.set_defaults(run=_generate)

    demo = commands.add_parser("demo", help="TriForce and the fastest stack vs autoregressive decoding on the embedded default, one process")
    demo.add_argument("--prompt-tokens", type=int, default=None,
                      help="tokens of Pride and Prejudice before the question (default: 7000, or what fills --context); "
                           "with --prompt-file, the file's last N tokens (default: all of them)")
    demo.add_argument("--prompt-file", help="use this file's text as the prompt instead ('-' for stdin)")
    demo.add_argument("--stacks", nargs="+", default=list(DEMO_STACKS), metavar="NAME",
                      help=f"stacks to compare, each NAME or NAME:key=value,... (default: {' '.join(DEMO_STACKS)})")
    demo.add_argument("--no-tune", dest="tune", action="store_false", help="keep each stack's default γ instead of tuning it (gamma=auto; -o gamma=adaptive also re-tunes it during decoding)")
    demo.add_argument("--repeats", default=1, metavar="N",
                      help="turns: after the first, N - 1 more of autoregressive decoding and every stack; each speedup is the median of "
                           "its turns, each against its own turn's autoregressive run (default: 1)")
    demo.add_argument("--json", action="store_true", help="print one JSON record instead of the table")
    demo.add_argument("--synthetic", action="store_true", help="use synthetic models (no weights needed)")
    _add_stack_options(demo, default_stack=None, max_new_tokens=128)
    demo.set_defaults(run=_demo)

    add_bench_parser(commands)
    add_floor_parser(commands)
    add_quality_parser(commands)

    if not argv or argv[0] not in commands.choices:  # a built-in command needs no plugins loaded
        _add_plugin_commands(commands)
    return parser


def _add_plugin_commands(commands) -> None:
    """One subcommand per registered ``specstack_commands`` object (see specstack.hookspecs); a
    broken plugin is reported by `specstack plugins`, not here."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        registry = Registry.create()
    for name in registry.names(Kind.COMMAND):
        if name in commands.choices:
            continue
        command = registry.command(name)
        parser = commands.add_parser(name, help=command.help)
        command.add_arguments(parser)
        parser.set_defaults(run=command.run)


def _add_stack_options(parser: argparse.ArgumentParser, *, default_stack: str | None, max_new_tokens: int = 64) -> None:
    if default_stack is not None:  # the demo compares several (--stacks)
        parser.add_argument("--stack", default=default_stack, help="a registered stack recipe (see `specstack plugins`)")
    parser.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE", help="a stack option, e.g. -o budget=1024")
    parser.add_argument("--target", help="target model: a transformers directory or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--draft", help="draft model for stacks that need one (default: the shipped distilled draft)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--coupled", action="store_true",
                        help="coupled sampling: each position's draw fixed by the seed, so every stack samples autoregressive decoding's text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and KV cache dtype")
    add_window_options(parser)
    parser.add_argument("--device", default="cpu", help="the target's device: cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--draft-device", default=None, help="the draft model's device (default: --device)")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="run transformers models without CUDA graphs (no effect on the CPU)")
    parser.add_argument("--widen-bf16", action="store_true", help=WIDEN_BF16_HELP)


def add_window_options(parser: argparse.ArgumentParser) -> None:
    """``--context`` and ``--rope-scaling``: the target's window (see specstack.hf.load_model)."""
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="the target's window in tokens (default: its trained one); beyond it, RoPE-scaled (--rope-scaling)")
    parser.add_argument("--rope-scaling", default="yarn", choices=["yarn", "linear", "extrapolate", "none"],
                        help="how a --context beyond the trained window stretches RoPE (default: yarn; none refuses such a context; "
                             "extrapolate keeps RoPE as trained, for measurements)")


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


def _prepare(args: argparse.Namespace) -> int:
    from .decode_attention import load_decode_kernel
    from .models import prepare_target
    from .packed_linear import load_rows_kernel

    print(f"default target ready at {prepare_target()}")
    for what, kernel, instead in (("decode-attention", load_decode_kernel(), "attention stays with SDPA"),
                                  ("few-row linear", load_rows_kernel(), "linears stay with oneDNN")):
        print(f"{what} kernel built at {kernel.path}" if kernel else f"no {what} kernel (no C++ compiler, or its build failed): {instead}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from . import run

    from .autotune import auto_options, tuned

    session = run.Session.open(args)
    session.check_draft_taken([args.stack], args)
    prompt = session.prompt_tokens(prompt=args.prompt, prompt_file=args.prompt_file, book=args.book, length=args.prompt_tokens)
    options, mode = auto_options(run.given_once(args.option))
    stack = session.stack(args.stack, options)
    retuner = None
    if mode:
        tuning, retuner = tuned(stack, prompt, mode, seed=args.seed, prefill_progress=run.progress_printer("prefill", long_only=True))
        run.status(tuning.describe())
    result = stack.generate(prompt, args.max_new_tokens, progress=run.progress_printer("decoding"), reuse_cache=mode is not None,
                            prefill_progress=run.progress_printer("prefill", long_only=True), after_round=retuner)
    if retuner is not None:
        run.status(retuner.describe())
    text = session.tokenizer.decode(list(result.tokens))
    if args.json:
        print(json.dumps({"stack": args.stack, "device": str(session.target.device), "text": text, **result.as_dict()}))
    else:
        print(text)
        print(run.summary(result), file=sys.stderr)
    return 0


# What `specstack demo --synthetic` takes; its stack, prompt and sampling are fixed (specstack.demo.synthetic_demo)
SYNTHETIC_DEMO_TAKES = frozenset({"synthetic", "max_new_tokens", "seed", "device", "draft_device", "threads", "cuda_graphs"})


def _demo(args: argparse.Namespace) -> int:
    if args.synthetic:
        from .demo import synthetic_demo

        _refuse_given(args, _command_parser("demo"), takes=SYNTHETIC_DEMO_TAKES, mode="--synthetic (a fixed stack, prompt and sampling)")
        with torch_threads(args.threads):
            synthetic_demo(max_new_tokens=args.max_new_tokens, seed=args.seed, device=args.device, draft_device=args.draft_device)
        return 0
    from .demo import triforce_demo

    return triforce_demo(args)


def _command_parser(command: str) -> argparse.ArgumentParser:
    """The parser of a built-in ``command``, built afresh."""
    commands = next(a for a in _parser([command])._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


def _refuse_given(args: argparse.Namespace, parser: argparse.ArgumentParser, *, takes: frozenset, mode: str) -> None:
    """One error line naming the first option of ``parser`` given a value other than its default that
    ``mode`` does not take (``takes``: the destinations it does), instead of ignoring it."""
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if action.dest not in takes | {"help"} and value != action.default:
            given = [action.option_strings[0]] + ([] if action.nargs == 0 else [str(v) for v in value] if isinstance(value, list) else [str(value)])
            raise SpecstackError(f"{' '.join(given)} is not taken with {mode}; drop one of the two")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
