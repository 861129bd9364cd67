"""llama.cpp's autoregressive decoding of a GGUF file: the engine a CPU user would pick instead.

``llama-cpp`` in ``specstack bench`` (``pip install specstack[llama-cpp]``, which compiles
llama.cpp: about 4 minutes on 2 cores) runs ``llama-cpp-python`` on the same prompt token ids as
every other stack of its group, timed like the recipes: the prefill (every prompt token but the
last) apart, then decoding, one ``llama_decode`` and one sample per new token. Its speedup is
against specstack's ``autoregressive`` run in the same process, so it reads on the same scale as
the stacks'.

It is a baseline for speed, not for exactness: llama.cpp computes with the GGUF's quantized weights
(the embedded default's are Q4_1, which specstack dequantizes once at load) and its own kernels, so
its greedy output may differ from the target's. It samples with llama.cpp's own sampler chain,
given the run's temperature, top-p and top-k and nothing else (no repetition penalty, min-p or
typical-p), seeded with the run's seed.

Each run is a child process (``python -m specstack.bench.llama_cpp``, a JSON request on stdin and a
JSON reply on stdout), so a fault inside llama.cpp becomes one failed record instead of ending the
bench: llama-cpp-python 0.3.36 built with ``-march=native`` on a CPU with AMX segfaults in its AMX
int8 kernel on any multi-token forward of this GGUF (docs/bench.md says how to build it without).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch

from ..errors import SpecstackError
from .stacks import Measurement, RunSetup, with_defaults

INSTALL = "pip install 'specstack[llama-cpp]' (it compiles llama.cpp: a few minutes)"


@attrs.frozen(kw_only=True)
class LlamaCpp:
    """The ``llama-cpp`` bench stack. Options: ``gguf`` (a file; ``None``: the embedded default's,
    allowed only when the target is the embedded default), ``threads`` (``None``: torch's intra-op
    threads), ``flash_attn`` (llama.cpp's fused attention), ``cache_type`` (of its KV cache)."""

    name: str = "llama-cpp"
    description: str = "llama.cpp (llama-cpp-python) autoregressive decoding of the target's GGUF file"
    baseline: str = "autoregressive"
    family: str = "llama-cpp"
    couples: bool = False  # llama.cpp's own sampler

    def options(self) -> dict[str, Any]:
        return {"gguf": None, "threads": None, "flash_attn": False, "cache_type": "f16"}

    def warm(self, run: RunSetup) -> None:
        pass  # every run is a fresh process: there is nothing to warm in this one

    def check(self, run: RunSetup, options: Mapping[str, Any]) -> None:
        _gguf(run, _checked(with_defaults(self.name, self.options(), options))["gguf"])

    def measure(self, run: RunSetup, options: Mapping[str, Any]) -> Measurement:
        options = _checked(with_defaults(self.name, self.options(), options))
        sampling = run.sampling
        request = {
            "gguf": str(_gguf(run, options["gguf"])), "threads": options["threads"] or torch.get_num_threads(),
            "flash_attn": bool(options["flash_attn"]), "cache_type": options["cache_type"], "prompt": list(run.prompt),
            "max_new_tokens": run.max_new_tokens, "stop_tokens": list(run.stop_tokens), "seed": run.seed,
            "temperature": 0.0 if sampling.greedy else sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or 0,
            "vocab_size": getattr(run.models.target, "vocab_size", None),
        }
        reply = _in_child(request)
        return Measurement(tokens=tuple(reply["tokens"]), levels=(), decode_seconds=reply["decode_seconds"],
                           prefill_seconds=reply["prefill_seconds"], total_seconds=reply["prefill_seconds"] + reply["decode_seconds"],
                           timing="decode", notes={"engine": f"llama.cpp (llama-cpp-python {reply['version']})", "threads": request["threads"]})


def _checked(merged: dict[str, Any]) -> dict[str, Any]:
    """``merged`` (the options over their defaults) once its values are checked."""
    if merged["cache_type"] not in CACHE_TYPES:
        raise SpecstackError(f"llama-cpp cache_type {merged['cache_type']!r} is not allowed; use one of {', '.join(CACHE_TYPES)}")
    threads = merged["threads"]
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise SpecstackError(f"llama-cpp threads {threads!r} is not allowed; use a positive integer or leave it out (torch's threads)")
    return merged


CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")  # llama.cpp's GGML_TYPE_* names of a KV cache


def _gguf(run: RunSetup, asked: Any) -> Path:
    if asked is not None:
        path = Path(str(asked))
        if not path.is_file():
            raise SpecstackError(f"llama-cpp gguf {str(asked)!r} is not a file; give the target's GGUF file")
        return path
    from ..models import TARGET_NAME, find_gguf

    name = str(getattr(run.models.target, "name", "") or "")
    if not name.startswith(TARGET_NAME):
        raise SpecstackError(f"llama-cpp needs the option gguf=FILE (llama-cpp:gguf=FILE) for target {name or type(run.models.target).__name__!r}; "
                             f"without it, only the embedded default ({TARGET_NAME}) is known")
    return find_gguf()


def _in_child(request: dict[str, Any]) -> dict[str, Any]:
    """Run one request in ``python -m specstack.bench.llama_cpp``; its last stdout line is the reply."""
    done = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(request), capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    reply = _json(lines[-1]) if lines else None
    if done.returncode < 0:
        raise RuntimeError(f"llama.cpp's process died of signal {-done.returncode}: a fault inside llama.cpp; {_last_line(done.stderr)}")
    if reply is None:
        raise RuntimeError(f"llama.cpp's process exited with status {done.returncode} and no reply: {_last_line(done.stderr)}")
    if "error" in reply:
        raise SpecstackError(reply["error"])
    return reply


def _json(line: str) -> dict[str, Any] | None:
    try:
        reply = json.loads(line)
    except json.JSONDecodeError:
        return None
    return reply if isinstance(reply, dict) else None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(nothing on stderr)"


# -- the child process --------------------------------------------------------------------------


def serve(request: dict[str, Any]) -> dict[str, Any]:
    """Load the GGUF, prefill and decode as asked: the reply's tokens and seconds."""
    try:
        import llama_cpp
    except ImportError:
        raise SpecstackError(f"stack 'llama-cpp' needs llama-cpp-python; {INSTALL}") from None
    cache = getattr(llama_cpp, f"GGML_TYPE_{request['cache_type'].upper()}")
    llm = llama_cpp.Llama(model_path=request["gguf"], n_ctx=len(request["prompt"]) + request["max_new_tokens"] + 1,
                          n_threads=request["threads"], n_threads_batch=request["threads"], seed=request["seed"],
                          flash_attn=request["flash_attn"], type_k=cache, type_v=cache, verbose=False)
    try:
        _check_fits(llm, request)
        return {**_timed_decode(llm, request), "version": str(getattr(llama_cpp, "__version__", "?"))}
    finally:
        llm.close()


def _check_fits(llm: Any, request: dict[str, Any]) -> None:
    vocab = request["vocab_size"]
    if vocab is not None and llm.n_vocab() != vocab:
        raise SpecstackError(f"llama-cpp's GGUF has a vocabulary of {llm.n_vocab()} tokens, the target {vocab}; give the target's own GGUF file")
    trained = llm._model.n_ctx_train()  # llama-cpp-python has no public accessor
    needed = len(request["prompt"]) + request["max_new_tokens"]
    if needed > trained:
        raise SpecstackError(f"llama-cpp runs the GGUF at its trained window of {trained} tokens; "
                             f"a {len(request['prompt'])}-token prompt plus {request['max_new_tokens']} new tokens needs {needed}")


def _timed_decode(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Prefill all but the last prompt token, then decode: each new token costs one forward, as in
    specstack's ``autoregressive`` (whose prefill also leaves the last prompt token to decoding)."""
    prompt, stops = request["prompt"], set(request["stop_tokens"])
    began = time.perf_counter()
    llm.eval(prompt[:-1])
    prefill_seconds = time.perf_counter() - began
    began = time.perf_counter()
    stream = llm.generate(prompt, temp=request["temperature"], top_p=request["top_p"], top_k=request["top_k"],
                          min_p=0.0, typical_p=1.0, repeat_penalty=1.0)  # reuses the prefilled prompt[:-1]
    tokens: list[int] = []
    for token in stream:
        tokens.append(int(token))
        if len(tokens) == request["max_new_tokens"] or token in stops:
            break
    decode_seconds = time.perf_counter() - began
    stream.close()
    return {"tokens": tokens, "prefill_seconds": prefill_seconds, "decode_seconds": decode_seconds}


def main() -> None:
    request = json.loads(sys.stdin.read())
    try:
        reply = serve(request)
    except SpecstackError as error:
        reply = {"error": str(error)}
    print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
