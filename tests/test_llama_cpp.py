"""The ``llama-cpp`` bench baseline: its child process, its timing, its errors.

Most tests give the child a stand-in ``llama_cpp`` module (on ``PYTHONPATH``) that records what it
was asked, so they run without llama.cpp; one runs the real one on the embedded default's GGUF when
llama-cpp-python is installed (``pip install 'specstack[llama-cpp]'``).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from specstack.bench import Grid, SyntheticModels, run_grid
from specstack.bench.llama_cpp import LlamaCpp, _timed_decode

SYNTHETIC = SyntheticModels(max_length=1024)

# A stand-in for llama-cpp-python: token i of the output is (last token + i + 1) % 256; it writes
# the calls it saw to $FAKE_LLAMA_LOG, and dies of SIGSEGV when the prompt holds $FAKE_LLAMA_CRASH.
FAKE = '''
import json, os, signal
__version__ = "fake"
GGML_TYPE_F16 = 1
GGML_TYPE_F32 = 0
GGML_TYPE_BF16 = 30
GGML_TYPE_Q8_0 = 8

class _Model:
    def n_ctx_train(self):
        return int(os.environ.get("FAKE_LLAMA_CTX", "1024"))

class Llama:
    def __init__(self, model_path, **kwargs):
        self.kwargs, self.calls, self.n_tokens, self._model = kwargs, [], 0, _Model()

    def n_vocab(self):
        return 256

    def eval(self, tokens):
        if os.environ.get("FAKE_LLAMA_CRASH") and int(os.environ["FAKE_LLAMA_CRASH"]) in tokens:
            os.kill(os.getpid(), signal.SIGSEGV)
        self.calls.append(["eval", len(tokens)])
        self.n_tokens += len(tokens)

    def generate(self, tokens, **sampling):
        self.calls.append(["generate", len(tokens) - self.n_tokens, sampling])
        token = tokens[-1]
        while True:
            token = (token + 1) % 256
            yield token

    def close(self):
        with open(os.environ["FAKE_LLAMA_LOG"], "w") as log:
            json.dump({"init": self.kwargs, "calls": self.calls}, log)
'''


@pytest.fixture
def fake_llama(tmp_path, monkeypatch) -> Path:
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "llama_cpp.py").write_text(textwrap.dedent(FAKE))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    log = tmp_path / "calls.json"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    return gguf


def _grid(gguf: Path, *extra: str, **kwargs) -> Grid:
    return Grid(stacks=["autoregressive", f"llama-cpp:gguf={gguf}", *extra], context_lengths=[256], max_new_tokens=12, **kwargs)


def test_the_child_prefills_all_but_the_last_token_then_decodes(tmp_path, fake_llama) -> None:
    table = run_grid(_grid(fake_llama, temperatures=[0.6], top_p=0.9), tmp_path / "out", models=SYNTHETIC, progress=False)
    (run,) = [r for r in table.ok if r["stack"] == "llama-cpp"]
    calls = json.loads((tmp_path / "calls.json").read_text())
    assert calls["calls"][0] == ["eval", 255]  # the prefill of a 256-token prompt, timed apart
    assert calls["calls"][1][:2] == ["generate", 1]  # decoding starts from the last prompt token
    assert calls["calls"][1][2] == {"temp": 0.6, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0}
    assert calls["init"]["n_threads"] == run["environment"]["threads"] and calls["init"]["seed"] == 0
    assert run["new_tokens"] == 12 and run["timing"] == "decode" and run["baseline"] == "autoregressive"
    assert run["speedup"] > 0 and run["decode_tokens_per_second"] > 0 and run["notes"]["engine"].startswith("llama.cpp")
    assert [(b - a) % 256 for a, b in zip(run["tokens"], run["tokens"][1:])] == [1] * 11


def test_greedy_runs_ask_for_temperature_zero(tmp_path, fake_llama) -> None:
    table = run_grid(_grid(fake_llama, temperatures=[0]), tmp_path / "out", models=SYNTHETIC, progress=False)
    (run,) = [r for r in table.ok if r["stack"] == "llama-cpp"]
    assert json.loads((tmp_path / "calls.json").read_text())["calls"][1][2]["temp"] == 0.0
    assert run["identical_to_baseline"] is False  # compared token for token, like every greedy run


class Counting:
    """An in-process stand-in: counts up from the last prompt token."""

    def eval(self, tokens):
        self.prefilled = len(tokens)

    def generate(self, tokens, **sampling):
        yield from range(tokens[-1] + 1, 10**6)


def test_decoding_stops_after_a_stop_token_or_the_budget() -> None:
    request = {"prompt": [3, 4, 5], "stop_tokens": [9], "max_new_tokens": 10, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    assert _timed_decode(Counting(), request)["tokens"] == [6, 7, 8, 9]
    assert _timed_decode(Counting(), {**request, "stop_tokens": []})["tokens"] == list(range(6, 16))


def test_a_crash_inside_llama_cpp_is_one_failed_record(tmp_path, fake_llama, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "32")  # a space: every prose prompt holds one
    table = run_grid(_grid(fake_llama, "naive"), tmp_path / "out", models=SYNTHETIC, progress=False)
    (failed,) = table.errors
    assert failed["stack"] == "llama-cpp" and failed["error_kind"] == "crash"
    assert failed["error"] == "RuntimeError: llama.cpp's process died of signal 11: a fault inside llama.cpp; (nothing on stderr)"
    assert {r["stack"] for r in table.ok} == {"autoregressive", "naive"}  # the bench went on


@pytest.mark.parametrize(("option", "message"), [
    ("cache_type=q4", "llama-cpp cache_type 'q4' is not allowed; use one of f32, f16, bf16, q8_0"),
    ("threads=0", "llama-cpp threads 0 is not allowed; use a positive integer or leave it out (torch's threads)"),
    ("budget=4", "stack 'llama-cpp' has no option 'budget'; options: gguf, threads, flash_attn, cache_type"),
    ("gguf=/no/such.gguf", "llama-cpp gguf '/no/such.gguf' is not a file; give the target's GGUF file"),
])
def test_bad_options_are_one_line_input_errors(tmp_path, option, message) -> None:
    grid = Grid(stacks=["autoregressive", f"llama-cpp:{option}"], context_lengths=[256], max_new_tokens=4)
    table = run_grid(grid, tmp_path, models=SYNTHETIC, progress=False)
    (failed,) = table.errors
    assert (failed["error_kind"], failed["error"]) == ("input", message)


def test_without_a_gguf_only_the_embedded_default_is_known(tmp_path) -> None:
    table = run_grid(Grid(stacks=["llama-cpp"], context_lengths=[256], max_new_tokens=4), tmp_path, models=SYNTHETIC, progress=False)
    (failed,) = table.errors
    assert failed["error"] == ("llama-cpp needs the option gguf=FILE (llama-cpp:gguf=FILE) for target 'SyntheticLM'; "
                               "without it, only the embedded default (smollm2-135m-instruct) is known")


def test_errors_found_in_the_child_come_back_as_input_errors(tmp_path, fake_llama, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_LLAMA_CTX", "200")
    table = run_grid(_grid(fake_llama), tmp_path / "out", models=SYNTHETIC, progress=False)
    (failed,) = table.errors
    assert failed["error_kind"] == "input"
    assert failed["error"].startswith("llama-cpp runs the GGUF at its trained window of 200 tokens; a ")


def test_without_llama_cpp_python_the_error_says_how_to_install_it(tmp_path, monkeypatch) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "llama_cpp.py").write_text("raise ImportError('not here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "empty"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    table = run_grid(_grid(gguf), tmp_path / "out", models=SYNTHETIC, progress=False)
    (failed,) = table.errors
    assert failed["error"] == "stack 'llama-cpp' needs llama-cpp-python; pip install 'specstack[llama-cpp]' (it compiles llama.cpp: a few minutes)"


def test_the_stack_is_listed_with_its_options() -> None:
    assert LlamaCpp().options() == {"gguf": None, "threads": None, "flash_attn": False, "cache_type": "f16"}


@pytest.mark.real_model
def test_llama_cpp_decodes_the_embedded_default_like_the_target(tmp_path) -> None:
    pytest.importorskip("llama_cpp")
    grid = Grid(stacks=["autoregressive", "llama-cpp"], context_lengths=[512], max_new_tokens=16)
    table = run_grid(grid, tmp_path, progress=False)
    assert not table.errors
    ours, theirs = (next(r for r in table.ok if r["stack"] == s) for s in ("autoregressive", "llama-cpp"))
    assert theirs["new_tokens"] == 16 and theirs["speedup"] > 0
    assert theirs["tokens"][:4] == ours["tokens"][:4]  # the same prompt ids reached the same model (Q4_1 weights, its kernels)
