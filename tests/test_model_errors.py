"""Bad model inputs: one-line errors, exit code 2 from the CLI, no traceback."""

from __future__ import annotations

import pytest

from specstack import Level, SpecstackError, SpeculationStack
from specstack.cli import main
from specstack.hf import load_model

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def target_dir():
    from specstack.models import prepare_target

    return prepare_target()


def _tiny_llama(path, tokenizer, vocab_size: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _other_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "a": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")


def test_a_draft_with_another_tokenizer_is_refused(tmp_path, target_dir) -> None:
    target, _ = load_model(target_dir)
    _tiny_llama(tmp_path / "draft", _other_tokenizer(), target.vocab_size)
    draft, _ = load_model(tmp_path / "draft")
    with pytest.raises(SpecstackError, match=r"level 0 \(draft\) uses tokenizer '\w+' but the target \(smollm2-135m-instruct\) uses"):
        SpeculationStack.build([Level(model=draft), Level(model=target, gamma=2)])


def test_a_draft_with_the_same_tokenizer_is_accepted(tmp_path, target_dir) -> None:
    target, tokenizer = load_model(target_dir)
    _tiny_llama(tmp_path / "draft", tokenizer, target.vocab_size)
    draft, _ = load_model(tmp_path / "draft")
    result = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=2)]).generate(tokenizer("Hello there").input_ids, 4)
    assert len(result.tokens) == 4


def test_an_unsupported_architecture_is_named(tmp_path, target_dir) -> None:
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "gpt2")
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(SpecstackError, match="model architecture 'gpt2' is not supported by the KV store; supported: llama, mistral, qwen2"):
        load_model(tmp_path / "gpt2")


def test_a_corrupt_gguf_file_is_named(tmp_path) -> None:
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(SpecstackError, match=r"cannot load model '.*broken.gguf'") as error:
        load_model(corrupt)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--target", "/nonexistent/model.gguf", "--prompt", "hi"], "model file '/nonexistent/model.gguf' does not exist"),
        (["generate", "--stack", "tri-force", "--prompt", "hi"], "unknown stack 'tri-force'; available: autoregressive"),
        (["generate", "--temperature", "-1", "--prompt", "hi"], "temperature -1.0 is not allowed"),
        (["generate", "--stack", "triforce", "-o", "gamma2=0", "--prompt", "hi"], "gamma 0 is not allowed at the top level 2"),
        (["generate", "--stack", "triforce", "-o", "gamma1=-1", "--prompt", "hi"], "gamma -1 is not allowed"),
        (["generate", "--stack", "triforce", "-o", "budget=100", "--prompt", "hi"], "retrieval budget 100 is not allowed with chunk_size 8"),
        (["generate", "--stack", "triforce", "-o", "budgit=64", "--prompt", "hi"], "stack 'triforce' has no option 'budgit'"),
        (["generate", "--stack", "triforce", "-o", "gamma=3", "--prompt", "hi"],
         "stack 'triforce' has no option 'gamma'; options: gamma1, gamma2, budget, chunk_size, stride, draft_window, sinks, draft_vocab "
         "(gamma=auto or gamma=adaptive tunes every level's γ)"),
        (["generate", "--threads", "-3", "--prompt", "hi"], "--threads -3 is not allowed; use an integer >= 1"),
        (["generate", "--threads", "0", "--prompt", "hi"], "--threads 0 is not allowed; use an integer >= 1"),
        (["generate", "--prompt-tokens", "0", "--prompt", "hi"], "--prompt-tokens 0 is not allowed; use an integer >= 1"),
        (["generate", "--prompt-tokens", "-4", "--prompt", "hi there, how are you today?"], "--prompt-tokens -4 is not allowed"),
        (["demo", "--threads", "-1", "--synthetic"], "--threads -1 is not allowed; use an integer >= 1"),
        (["demo", "--prompt-tokens", "0", "--max-new-tokens", "2"], "--prompt-tokens 0 is not allowed; use an integer >= 1"),
    ],
)
def test_cli_reports_bad_input_in_one_line_with_exit_code_2(capsys, argv, message) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]
    assert not any("Traceback" in line for line in err)


def test_the_target_is_converted_again_by_another_transformers_version(tmp_path, monkeypatch) -> None:
    """A conversion keeps what the converting transformers read (5.0-5.5 read the tokenizer wrongly),
    so a cache stamped by another version is converted again, and one stamped by this version is not."""
    from specstack import models

    out = tmp_path / models.TARGET_NAME
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))

    def converting():
        raise RuntimeError("converting")

    monkeypatch.setattr(models, "find_gguf", converting)
    (out / "converted-by-transformers").write_text(models.transformers_version())
    assert models.prepare_target() == out
    (out / "converted-by-transformers").write_text("5.5.4")
    with pytest.raises(RuntimeError, match="converting"):
        models.prepare_target()


def test_a_process_that_waits_for_another_conversion_takes_it_instead_of_converting_again(tmp_path, monkeypatch) -> None:
    """Two processes that find no conversion (two test workers) must not both convert: the second waits
    on the lock, then finds the first one's conversion. Without the lock both rewrite the directory, and
    one's removal of it fails under the other."""
    import fcntl
    import threading

    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  imported here, so the wait below is the lock's

    from specstack import models

    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "find_gguf", lambda: pytest.fail("converted although another process had just converted"))
    out = tmp_path / models.TARGET_NAME
    result = {}
    with open(tmp_path / f"{models.TARGET_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other process, converting
        waiting = threading.Thread(target=lambda: result.update(path=models.prepare_target()))
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive(), "prepare_target did not wait for the converting process"
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"")
        (out / "converted-by-transformers").write_text(models.transformers_version())
    waiting.join(10)
    assert result == {"path": out}
