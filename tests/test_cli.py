from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specstack import SpecstackError
from specstack.cli import _parser, main
from specstack.run import check_device, use_cuda_graphs


def test_help_lists_the_commands(capsys) -> None:
    assert main([]) == 0
    assert "plugins" in capsys.readouterr().out


def test_console_script_help_works() -> None:
    out = subprocess.run([sys.executable, "-m", "specstack.cli", "--help"], capture_output=True, text=True, check=True).stdout
    assert "usage: specstack" in out


@pytest.mark.parametrize("argv", [["--help"], ["plugins"], ["bench", "--help"], ["train", "draft", "--help"]])
def test_listing_commands_and_help_import_no_transformers(argv) -> None:
    """`specstack --help`, `plugins` and a command's help build parsers and list registrations only: the
    harness and the trainers import transformers (about 1-2.5 s here) where they run, not at import."""
    script = ("import sys\nfrom specstack.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
              "print('heavy:', sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, check=True)
    assert "heavy: []" in done.stderr, done.stderr


def test_plugins_lists_builtins_by_kind(capsys) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for line in ("cache policy:", "  full ", "  streaming ", "verifier:", "  speculative ", "stack:", "  autoregressive "):
        assert line in out


def test_synthetic_demo_reports_a_lossless_run(capsys) -> None:
    assert main(["demo", "--synthetic", "--max-new-tokens", "48"]) == 0
    out = capsys.readouterr().out
    assert "output identical to autoregressive greedy: True" in out
    assert "acceptance" in out


# -- devices --------------------------------------------------------------------------------------

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
COMMANDS = {  # each runs nothing before its devices are checked; the bench's output directory must not appear
    "generate": ["generate", "--prompt", "hi"],
    "demo": ["demo"],
    "demo --synthetic": ["demo", "--synthetic"],
    "bench": ["bench", "--stacks", "autoregressive", "--out", "{out}"],
    "bench --synthetic": ["bench", "--synthetic", "--stacks", "autoregressive", "--out", "{out}"],
}


def run_cli(capsys, tmp_path, command: str, *flags: str) -> tuple[int, str]:
    argv = [arg.replace("{out}", str(tmp_path / "out")) for arg in COMMANDS[command]]
    code = main([*argv, *flags])
    captured = capsys.readouterr()
    assert not (tmp_path / "out").exists()
    return code, captured.err


def assert_one_line_error(code: int, err: str, message: str) -> None:
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert message in err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", ["--device", "--draft-device"])
def test_a_misspelled_device_exits_2_with_one_line(capsys, tmp_path, command, flag) -> None:
    assert_one_line_error(*run_cli(capsys, tmp_path, command, flag, "gpu0"), "device 'gpu0' is not allowed; use cpu, cuda or cuda:N")


@NO_CUDA
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", ["--device", "--draft-device"])
def test_cuda_on_a_machine_without_it_exits_2_with_one_line(capsys, tmp_path, command, flag) -> None:
    assert_one_line_error(*run_cli(capsys, tmp_path, command, flag, "cuda"), "device 'cuda' is not available: torch.cuda.is_available() is False on this machine")


@pytest.fixture
def two_gpus(monkeypatch):
    """What torch says on a machine with two CUDA devices."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_cuda_index_beyond_the_gpus_says_how_many_there_are(capsys, tmp_path, two_gpus, command) -> None:
    code, err = run_cli(capsys, tmp_path, command, "--device", "cuda:3")
    assert code == 2 and err.count("\n") == 1
    assert "device 'cuda:3' is not available: this machine has 2 CUDA devices; use cuda:0 to cuda:1" in err


def test_check_device_accepts_cpu_cuda_and_cuda_n(two_gpus) -> None:
    assert check_device("cpu") == torch.device("cpu")
    assert check_device("cuda") == torch.device("cuda")
    assert check_device(torch.device("cuda:1")) == torch.device("cuda:1")
    assert check_device("cuda:7", available=False) == torch.device("cuda:7")  # the spelling only (a Ray worker's device)
    for text in ("CPU", "cuda:", "cuda:-1", "mps", "cpu:0", " cpu"):
        with pytest.raises(SpecstackError, match=r"^device '.*' is not allowed; use cpu, cuda or cuda:N$"):
            check_device(text)


def test_load_default_checks_its_devices_before_reading_weights(monkeypatch) -> None:
    from specstack import models

    monkeypatch.setattr(models, "prepare_target", lambda: pytest.fail("weights were read before the devices were checked"))
    with pytest.raises(SpecstackError, match="device 'gpu0' is not allowed"):
        models.load_default(device="gpu0")
    with pytest.raises(SpecstackError, match="device 'cuda:0x' is not allowed"):
        models.load_default(device="cpu", draft_device="cuda:0x")


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--threads", "abc"], "specstack generate: error: argument --threads: invalid int value: 'abc' (see specstack generate --help)"),
    (["bench", "--seeds", "x"], "specstack bench: error: argument --seeds: invalid int value: 'x' (see specstack bench --help)"),
    (["demo", "--dtype", "int8"], "specstack demo: error: argument --dtype: invalid choice: 'int8' (choose from "),
    (["generate", "--prompt", "a", "--book", "emma"], "specstack generate: error: argument --book: not allowed with argument --prompt"),
])
def test_a_malformed_argument_is_one_line_without_the_usage_block(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and err.startswith(message), err


@pytest.mark.parametrize(("flags", "message"), [
    (["--repeats", "0"], "--repeats 0 is not taken with --synthetic"),
    (["--stacks", "nosuch", "triforce"], "--stacks nosuch triforce is not taken with --synthetic"),
    (["-o", "gamma=zz"], "-o gamma=zz is not taken with --synthetic"),
    (["--prompt-file", "/nonexistent"], "--prompt-file /nonexistent is not taken with --synthetic"),
    (["--json"], "--json is not taken with --synthetic"),
    (["--temperature", "0.6"], "--temperature 0.6 is not taken with --synthetic"),
])
def test_the_synthetic_demo_refuses_what_it_would_ignore(capsys, flags, message) -> None:
    """`demo --synthetic` runs a fixed stack on a fixed prompt, greedily: an option it would ignore (a bad one
    included) is one error line, not a run that looks like its answer."""
    assert main(["demo", "--synthetic", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"specstack demo: error: {message} (a fixed stack, prompt and sampling); drop one of the two\n"
    assert captured.out == ""


def test_a_stack_option_given_twice_is_an_error_where_a_demo_entry_overrides_a_shared_one() -> None:
    from specstack.demo import _spec
    from specstack.run import given_once, parse_options

    with pytest.raises(SpecstackError, match=r"stack option 'gamma' is given twice \('gamma=auto', 'gamma=2'\); give it once"):
        given_once(["gamma=auto", "budget=64", "gamma=2"])
    with pytest.raises(SpecstackError, match="stack option 'draft_window' is given twice"):
        parse_options(["draft-window=64", "draft_window=32"])
    # a --stacks entry's own option wins over the -o options every entry shares, without an error
    assert _spec("triforce:gamma1=2", ["gamma1=3", "budget=64"]) == ("triforce", ["budget=64", "gamma1=2"])
    with pytest.raises(SpecstackError, match="stack option 'gamma1' is given twice"):
        _spec("triforce:gamma1=2,gamma1=4", [])


def test_the_synthetic_demo_runs_on_an_explicit_cpu(capsys) -> None:
    assert main(["demo", "--synthetic", "--device", "cpu", "--draft-device", "cpu", "--no-cuda-graphs", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "greedy, on cpu\n" in out and "output identical to autoregressive greedy: True" in out


def test_a_small_bench_runs_on_an_explicit_cpu_and_says_so(capsys, tmp_path) -> None:
    assert main(["bench", "--synthetic", "--stacks", "naive", "--context-lengths", "256", "--max-new-tokens", "6", "--device", "cpu",
                 "--no-cuda-graphs", "--out", str(tmp_path), "--quiet"]) == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["ok", "ok"]
    for record in records:
        assert (record["device"], record["draft_device"], record["cuda_graphs"]) == ("cpu", "cpu", False)
        assert record["peak_cuda_mb"] is None
        assert (record["environment"]["device"], record["environment"]["draft_device"]) == ("cpu", "cpu")


def test_the_bench_names_an_unknown_stack_before_it_runs_anything(capsys, tmp_path) -> None:
    assert main(["bench", "--synthetic", "--stacks", "naive", "tri-force", "--context-lengths", "256", "--max-new-tokens", "6",
                 "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"specstack bench: error: unknown stack 'tri-force'; available: {err[0].split('available: ')[1]}"]
    assert "naive, " in err[0] and "hf-assisted" in err[0]
    assert not (tmp_path / "results.jsonl").exists()  # nothing ran


def test_no_cuda_graphs_switches_them_off_in_transformers_models() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from specstack.hf import HFCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64)
    model = HFCausalLM(module=LlamaForCausalLM(config), tokenizer_id=None)
    assert model.cuda_graphs is True
    use_cuda_graphs([model, None], False)
    assert model.cuda_graphs is False
    use_cuda_graphs([model], True)
    assert model.cuda_graphs is True


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--prompt", "hi", "--stack", "prompt-lookup", "--draft", "/some/draft"],
     "--draft /some/draft is for stacks with a draft model, and prompt-lookup has none"),
    (["demo", "--stacks", "medusa-lookup", "prompt-lookup:gamma=2", "--draft-device", "cpu"],
     "--draft-device cpu is for stacks with a draft model, and medusa-lookup, prompt-lookup has none"),
])
def test_a_draft_that_no_stack_takes_is_one_line(capsys, monkeypatch, argv, message) -> None:
    """--draft or --draft-device where none of the stacks has a draft model would be left unused without a word."""
    import specstack.models
    from specstack.testing.llama import random_llama

    monkeypatch.setattr(specstack.models, "load_target", lambda **kwargs: (random_llama(), None))
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"specstack {argv[0]}: error: {message}; drop it") and all(line.startswith("[specstack]") for line in err[:-1])


def test_a_draft_is_taken_where_one_stack_has_a_draft_model(monkeypatch) -> None:
    import specstack.models
    from specstack.run import Session
    from specstack.testing.llama import random_llama

    monkeypatch.setattr(specstack.models, "load_target", lambda **kwargs: (random_llama(), None))
    args = _parser(["demo"]).parse_args(["demo", "--draft", "/some/draft", "--draft-device", "cpu"])
    Session.open(args).check_draft_taken(["prompt-lookup", "triforce"], args)  # no error: triforce drafts with it


@pytest.mark.parametrize("command", ["generate", "demo", "bench", "bench --synthetic"])
def test_widen_bf16_without_bf16_is_one_line_before_anything_loads(capsys, tmp_path, command) -> None:
    """--widen-bf16 at --dtype float32 (the default) would widen nothing: one error line instead."""
    code, err = run_cli(capsys, tmp_path, command, "--widen-bf16")
    assert_one_line_error(code, err, f"specstack {command.split()[0]}: error: --widen-bf16 widens bf16 products, and --dtype float32 "
                                     "has none; add --dtype bfloat16 or drop --widen-bf16")


def test_widen_bf16_reaches_the_target_generate_and_demo_load(monkeypatch) -> None:
    """--widen-bf16 on the stack commands: the target the session loads has its products widened, and the session says
    so (the demo's exactness line reads it); unset, neither."""
    import specstack.models
    from specstack.cli import _parser
    from specstack.hf import HFCausalLM
    from specstack.run import Session
    from specstack.testing.llama import random_llama

    target = random_llama()
    widened = []
    monkeypatch.setattr(specstack.models, "load_target", lambda **kwargs: (target, None))
    monkeypatch.setattr(HFCausalLM, "widen_bf16_products", lambda self: widened.append(self))
    for command in ("generate", "demo"):
        for flags, expected in [(("--dtype", "bfloat16"), []), (("--dtype", "bfloat16", "--widen-bf16"), [target])]:
            widened.clear()
            session = Session.open(_parser([command]).parse_args([command, *flags]))
            assert session.target is target and widened == expected and session.widen_bf16 == bool(expected)
