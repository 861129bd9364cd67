"""``specstack train``: the training plugin (plugins/training), registered through the entry points.

Bad input is one error line and exit code 2, found before any weights are read; smoke
configurations of ``train draft`` and ``train medusa`` train for seconds on the embedded default,
and what they train runs in a lossless stack.
"""

from __future__ import annotations

import json

import pytest

from specstack.cli import main


def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["train"], "specstack train: error: name what to train; allowed: draft, medusa, eagle"),
    (["train", "eagle", "--text", "emma", "--out", "l.safetensors", "--set", "window=250"],
     "specstack train: error: hyperparameter window=250 is not allowed with steps=5; use at most 188 (a held-out continuation's positions less the steps)"),
    (["train", "eagle", "--text", "emma", "--out", "l.safetensors", "--set", "heads=3"],
     "specstack train: error: hyperparameter 'heads' is not allowed; use seq_len, chunks, generations, prompt_len, gen_temperature, teacher_bf16, "
     "gen_batch, label_batch, eval_chunks, eval_every, top_k, threads, lr, warmup, weight_decay, autocast, steps, window, windows, "
     "intermediate_size, attention_heads, feature_weight, draft_vocab"),
    (["train", "medusa", "--text", "emma", "--out", "heads.bin"],
     "specstack train: error: --out 'heads.bin' is not allowed; name a .safetensors file"),
    (["train", "medusa", "--text", "emma", "--out", "h.safetensors", "--set", "heads=0"],
     "specstack train: error: hyperparameter heads=0 is not allowed; use a whole number >= 1"),
    (["train", "medusa", "--text", "emma", "--out", "h.safetensors", "--set", "threads=0"],
     "specstack train: error: hyperparameter threads=0 is not allowed; use a whole number >= 1"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--set", "threads=0"],
     "specstack train: error: hyperparameter threads=0 is not allowed; use a whole number >= 1"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--set", "batch=0"],
     "specstack train: error: hyperparameter batch=0 is not allowed; use a whole number >= 1"),
    (["train", "medusa", "--text", "emma", "--out", "h.safetensors", "--set", "lr=fast"],
     "specstack train: error: hyperparameter lr='fast' is not allowed; use a non-negative number"),
    (["train", "medusa", "--text", "emma", "--out", "h.safetensors", "--set", "token_input=2"],
     "specstack train: error: hyperparameter token_input=2 is not allowed; use true or false"),
    (["train", "medusa", "--text", "/nonexistent-dir/", "--out", "h.safetensors"],
     "specstack train: error: text '/nonexistent-dir/' is neither a file, a directory nor a shipped book; books: "
     "prideprejudice, sensesensibility, mansfieldpark, emma, northangerabbey, persuasion, kjv"),
    (["train", "draft", "--text", "no-such-file", "--out", "unused"],
     "specstack train: error: text 'no-such-file' is neither a file, a directory nor a shipped book; books: "
     "prideprejudice, sensesensibility, mansfieldpark, emma, northangerabbey, persuasion, kjv"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--minutes", "0"],
     "specstack train: error: --minutes 0 is not allowed; use a positive finite number"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--minutes", "nan"],
     "specstack train: error: --minutes nan is not allowed; use a positive finite number"),
    (["train", "medusa", "--text", "emma", "--out", "h.safetensors", "--minutes", "inf"],
     "specstack train: error: --minutes inf is not allowed; use a positive finite number"),
    (["train", "eagle", "--text", "emma", "--out", "/etc/passwd/x.safetensors"],
     "specstack train: error: --out '/etc/passwd/x.safetensors' cannot be written: '/etc/passwd' is not a writable folder"),
    (["train", "medusa", "--text", "emma", "--out", "h.safetensors", "--data", "/etc/passwd/labels.pt"],
     "specstack train: error: --data '/etc/passwd/labels.pt' cannot be written: '/etc/passwd' is not a writable folder"),
    (["train", "draft", "--text", "emma", "--out", "/etc/passwd/draft"],
     "specstack train: error: --out '/etc/passwd/draft' cannot be written: '/etc/passwd' is not a writable folder"),
    (["train", "draft", "--text", "emma", "--out", "/etc/passwd"],
     "specstack train: error: --out '/etc/passwd' cannot be written: '/etc/passwd' is not a writable folder"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--set", "layers=0,first"],
     "specstack train: error: layers '0,first' is not allowed; use target layer numbers separated by commas, e.g. 0,10,20"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--set", "grow_from=/nonexistent-draft"],
     "specstack train: error: grow_from '/nonexistent-draft' is not allowed; name a draft directory holding model.safetensors"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--set", "learning_rate=1"],
     "specstack train: error: hyperparameter 'learning_rate' is not allowed; use hidden, layers, heads, kv_heads, intermediate, "
     "seq_len, batch, top_k, replay, lr, emb_lr, ce_weight, teacher_temperature, warmup, weight_decay, eval_positions, eval_every, teacher_bf16, autocast, threads, "
     "grow_from, shared, scored, generations, prompt_len, gen_temperature, gen_batch"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--set", "generations=-1"],
     "specstack train: error: generations -1 is not allowed; use a whole number >= 0"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--set", "gen_temperature=0"],
     "specstack train: error: gen_temperature 0 is not allowed; use a number > 0, e.g. 0.7"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--set", "teacher_temperature=-0.5"],
     "specstack train: error: teacher_temperature -0.5 is not allowed; use a number > 0, e.g. 0.5"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--set", "prompt_len=256", "--set", "generations=8"],
     "specstack train: error: prompt_len 256 is not allowed; use fewer than seq_len=256 tokens (a continuation adds seq_len - prompt_len)"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--set", "shared=-1"],
     "specstack train: error: shared -1 is not allowed; use a whole number >= 0, e.g. shared=2 (target layers)"),
    (["train", "draft", "--text", "emma", "--out", "unused", "--set", "scored=half"],
     "specstack train: error: scored 'half' is not allowed; use a whole number >= 0, e.g. scored=64 (positions per chunk)"),
])
def test_bad_training_input_is_one_line_and_exit_code_2(capsys, argv, message) -> None:
    assert main(argv) == 2
    assert error_line(capsys) == message


def test_a_target_that_is_not_a_model_directory_is_one_line(capsys, tmp_path) -> None:
    assert main(["train", "draft", "--text", "emma", "--out", str(tmp_path / "out"), "--target", str(tmp_path)]) == 2
    assert error_line(capsys) == f"specstack train: error: --target {str(tmp_path)!r} is not a model directory (no config.json)"


@pytest.mark.real_model
def test_a_smoke_distillation_trains_a_draft_that_a_lossless_stack_runs(tmp_path, capsys, threads) -> None:
    from specstack import Registry
    from specstack.data import book_tokens
    from specstack.models import load_default, load_draft

    out = tmp_path / "draft"
    argv = ["train", "draft", "--text", "emma", "--eval-text", "persuasion", "--eval-text", "kjv", "--out", str(out),
            "--minutes", "0.05", "--set", "layers=0,29", "--set", "seq_len=64", "--set", "batch=1", "--set", "top_k=8", "--set", "eval_positions=128", "--set", f"threads={threads}",
            "--set", "teacher_bf16=false", "--set", "autocast=false"]  # fp32: a CPU without bf16 instructions runs it several times faster
    assert main(argv) == 0
    metrics = json.loads((out / "distill_metrics.json").read_text())
    assert metrics["eval_positions"] == 128 and set(metrics["best_agreement"]) == {"persuasion", "kjv"}
    assert all(0.0 <= a <= 1.0 for a in metrics["best_agreement"].values())
    assert metrics["hyperparams"]["layers"] == [0, 29]
    target, _, tokenizer = load_default(with_draft=False)
    draft = load_draft(target, out)
    prompt = book_tokens(tokenizer, 300, name="kjv")
    registry = Registry.create()
    reference = registry.stack("autoregressive", target=target).generate(prompt, 12)
    assert registry.stack("speculative", target=target, draft=draft).generate(prompt, 12).tokens == reference.tokens


@pytest.mark.real_model
def test_self_distillation_rows_are_text_prompts_and_the_targets_own_continuations() -> None:
    """``generations``: each row is a prompt cut from the texts and the target's continuation of it, the
    first half greedy (each written token is the target's argmax after the row's prefix), the second
    sampled (not all argmaxes)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specstack.data import book_tokens
    from specstack.models import prepare_target
    from specstack_training.distill import DEFAULTS, written_rows

    teacher = AutoModelForCausalLM.from_pretrained(str(prepare_target()), dtype=torch.float32).eval()
    text = np.asarray(book_tokens(AutoTokenizer.from_pretrained(str(prepare_target())), 640, name="emma"))  # [L]
    torch.manual_seed(0)
    hyperparams = {**DEFAULTS, "generations": 4, "prompt_len": 16, "seq_len": 40, "gen_batch": 2, "seed": 0}
    rows = written_rows(teacher, [text], hyperparams, log=lambda line: None)  # [4, 40]
    assert rows.shape == (4, 40)
    pieces = {tuple(text[i : i + 16].tolist()) for i in range(0, len(text) - 15, 16)}
    assert all(tuple(row[:16].tolist()) in pieces for row in rows)
    with torch.no_grad():
        argmaxes = teacher(input_ids=rows).logits[:, 15:-1].argmax(-1)  # [4, 24]: the target's choice for tokens 16..39
    assert torch.equal(argmaxes[:2], rows[:2, 16:])
    assert not torch.equal(argmaxes[2:], rows[2:, 16:])


@pytest.mark.real_model
def test_a_grown_student_computes_the_smaller_draft_before_training() -> None:
    """``grow_from``: the shipped draft's layers are copied in and the new layers write nothing, so the
    grown student's logits are the shipped draft's, bit for bit; a layer copied wrongly breaks this."""
    import torch
    from transformers import AutoModelForCausalLM

    from specstack.data import book_tokens
    from specstack.models import draft_dir, load_default, prepare_target
    from specstack.packed_linear import pack_linears
    from specstack_training.distill import DEFAULTS, build_student

    target, draft, tokenizer = load_default()
    teacher = AutoModelForCausalLM.from_pretrained(str(prepare_target()), dtype=torch.float32)
    config = draft.module.config
    depth, shared = config.num_hidden_layers, config.specstack_shared_layers
    hyperparams = {**DEFAULTS, "layers": tuple(range(shared, depth + 2)), "shared": shared,
                   "intermediate": config.intermediate_size, "grow_from": str(draft_dir())}
    student = build_student(teacher, hyperparams).eval()
    assert len(student.model.layers) == depth + 2
    pack_linears(student)  # the kernel the loaded draft's linears use, so that equal weights give equal bits
    ids = torch.tensor([book_tokens(tokenizer, 64, name="kjv")])  # [1, 64]
    with torch.no_grad():
        assert torch.equal(student(input_ids=ids).logits, draft.module(input_ids=ids).logits)


def test_the_loss_scores_a_subset_of_positions_as_it_scores_all() -> None:
    """``scored``: the LM head and the loss run on some positions only. The soft term and the next-token
    term over a subset are those of the full loss restricted to it; a shifted next token breaks this."""
    import torch
    import torch.nn.functional as F

    from specstack_training.distill import distill_loss, next_tokens, scored_columns

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2, 9), generator=gen)  # [B, T]
    logits = torch.randn(2, 9, 50, generator=gen)  # [B, T, V]
    vals, idx = torch.randn(2, 9, 4, generator=gen), torch.randint(0, 50, (2, 9, 4), generator=gen)  # [B, T, k]
    assert torch.equal(scored_columns(9, 0, gen), torch.arange(9)) and torch.equal(scored_columns(9, 20, gen), torch.arange(9))
    cols = scored_columns(9, 4, gen)  # [4]
    assert len(set(cols.tolist())) == 4 and cols.tolist() == sorted(cols.tolist())
    logp = torch.log_softmax(logits, -1)  # [B, T, V]
    every = F.nll_loss(logp[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))  # next-token CE over all positions
    assert torch.allclose(distill_loss(logits, next_tokens(ids), vals, idx, 1.0) - distill_loss(logits, next_tokens(ids), vals, idx, 0.0), every)
    picked = next_tokens(ids)[:, cols]  # [B, 4]
    valid = picked != -100
    expected = -(logp[:, cols].gather(-1, picked.clamp(min=0)[..., None])[..., 0][valid]).mean()
    soft = -(torch.softmax(vals[:, cols], -1) * logp[:, cols].gather(-1, idx[:, cols])).sum(-1).mean()
    assert torch.allclose(distill_loss(logits[:, cols], picked, vals[:, cols], idx[:, cols], 1.0), soft + expected)


def test_a_cold_teacher_temperature_makes_the_loss_the_cross_entropy_to_the_teachers_argmax() -> None:
    """At temperature 1 the soft target is the renormalised top-k; as it falls the loss tends to the
    cross-entropy to the teacher's top token, and at 0.5 it equals the loss with doubled log-probs."""
    import torch
    import torch.nn.functional as F

    from specstack_training.distill import distill_loss, next_tokens

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (2, 9), generator=gen)  # [B, T]
    logits = torch.randn(2, 9, 50, generator=gen)  # [B, T, V]
    vals, idx = torch.randn(2, 9, 4, generator=gen), torch.randperm(50, generator=gen)[:4].expand(2, 9, 4)  # [B, T, k]
    half = distill_loss(logits, next_tokens(ids), vals, idx, 0.0, 0.5)
    assert torch.allclose(half, distill_loss(logits, next_tokens(ids), 2 * vals, idx, 0.0))
    assert not torch.allclose(half, distill_loss(logits, next_tokens(ids), vals, idx, 0.0))
    top = idx.gather(-1, vals.argmax(-1, keepdim=True))[..., 0]  # [B, T]: the teacher's argmax
    argmax_ce = F.cross_entropy(logits.reshape(-1, 50), top.reshape(-1))
    assert torch.allclose(distill_loss(logits, next_tokens(ids), vals, idx, 0.0, 1e-4), argmax_ce, atol=1e-4)


@pytest.mark.real_model
def test_a_student_sharing_the_targets_first_layers_saves_only_its_own(tmp_path) -> None:
    """``shared=2``: the student runs the target's layers 0 and 1 unchanged and trains the rest. Its file
    holds neither those layers nor the embedding, and ``load_draft`` gives back the student (its own
    weights rounded to bf16) bit for bit; a loader that skips the shared layers breaks this."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from specstack.data import book_tokens
    from specstack.models import load_default, load_draft, prepare_target
    from specstack.packed_linear import pack_linears
    from specstack_training.distill import DEFAULTS, build_student, save_student

    target, _, tokenizer = load_default(with_draft=False)
    teacher = AutoModelForCausalLM.from_pretrained(str(prepare_target()), dtype=torch.float32)
    student = build_student(teacher, {**DEFAULTS, "shared": 2, "layers": (2,), "intermediate": 1536}).eval()
    assert [p.requires_grad for p in student.model.layers[1].parameters()] == [False] * 9
    with torch.no_grad():
        for p in student.model.layers[2].parameters():  # trained weights: not the target's, and what bf16 holds
            p.add_(0.01 * torch.randn_like(p)).copy_(p.bfloat16().float())
    save_student(student, str(prepare_target()), str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        assert {name.split(".")[2] for name in saved.keys() if name.startswith("model.layers.")} == {"2"}
        assert "model.embed_tokens.weight" not in saved.keys()
    draft = load_draft(target, tmp_path)
    with torch.no_grad():
        student.model.embed_tokens.weight.copy_(student.model.embed_tokens.weight.bfloat16().float())  # as the loader copies it
    pack_linears(student)  # the kernel the loaded draft's linears use, so that equal weights give equal bits
    ids = torch.tensor([book_tokens(tokenizer, 64, name="kjv")])  # [1, 64]
    with torch.no_grad():
        assert torch.equal(student(input_ids=ids).logits, draft.module(input_ids=ids).logits)


def test_sharing_needs_the_targets_widths() -> None:
    from transformers import LlamaConfig

    from specstack import SpecstackError
    from specstack_training.distill import check_shareable

    target = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    student = LlamaConfig(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    check_shareable(target, student, 0)
    with pytest.raises(SpecstackError, match=r"^intermediate=32 is not allowed with shared=1; shared layers need the target's widths: "
                                             r"hidden=64 heads=4 kv_heads=2 intermediate=96$"):
        check_shareable(target, student, 1)
    with pytest.raises(SpecstackError, match=r"^shared=4 is not allowed; the target has 3 layers$"):
        check_shareable(target, student, 4)


@pytest.mark.real_model
def test_a_smoke_medusa_training_gives_heads_that_a_lossless_stack_runs(tmp_path, capsys, threads) -> None:
    from specstack import Registry
    from specstack.data import book_tokens
    from specstack.models import load_default
    from specstack_medusa import load_heads

    out = tmp_path / "heads.safetensors"
    argv = ["train", "medusa", "--text", "emma", "--eval-text", "persuasion", "--out", str(out), "--minutes", "0.05",
            "--set", "seq_len=48", "--set", "prompt_len=16", "--set", "chunks=4", "--set", "generations=2", "--set", "gen_batch=2",
            "--set", "eval_chunks=2", "--set", "positions=32", "--set", "heads=2", "--set", f"threads={threads}"]
    assert main(argv + ["--data", str(tmp_path / "data.pt")]) == 0
    assert "labelled" in capsys.readouterr().out
    chained = tmp_path / "chained.safetensors"
    chain_argv = [str(chained) if arg == str(out) else arg for arg in argv]
    assert main(chain_argv + ["--data", str(tmp_path / "data.pt"), "--set", "chained=true", "--set", "draft_vocab=64",
                              "--set", "soft_temperature=0.6"]) == 0
    assert "labelled data read from" in capsys.readouterr().out  # the same data, read back: the target writes nothing
    soft = json.loads(chained.with_suffix(".json").read_text())["held_out"]["persuasion:greedy"]["first_candidate_mass"]
    assert len(soft) == 2 and all(0.0 < m < 1.0 for m in soft)  # soft labels: the top candidates' p at T = 0.6, per step
    metrics = json.loads(out.with_suffix(".json").read_text())
    assert metrics["steps"] >= 1 and set(metrics["held_out"]) == {"persuasion:text", "persuasion:greedy"}
    assert all(0.0 <= a <= 1.0 for a in metrics["held_out"]["persuasion:greedy"]["top1"])
    assert 0.0 < metrics["held_out"]["persuasion:greedy"]["draft_vocab_coverage"]["4096"] <= 1.0
    heads = load_heads(out)
    assert heads.info.heads == 2 and heads.info.token_input and len(heads.info.accuracy) == 2 and len(heads.info.accuracy[0]) == 8
    assert heads.info.draft_vocab == 8192 and sorted(heads.token_rank.tolist()) == list(range(heads.info.vocab_size))
    chain = load_heads(chained)
    assert chain.info.chained and chain.info.draft_vocab == 64 and len(list(chain.blocks)) == 1
    target, _, tokenizer = load_default(with_draft=False)
    prompt = book_tokens(tokenizer, 300, name="kjv")
    registry = Registry.create()
    reference = registry.stack("autoregressive", target=target).generate(prompt, 12)
    assert registry.stack("medusa", target=target, heads=str(out)).generate(prompt, 12).tokens == reference.tokens
    assert registry.stack("medusa-chain", target=target, heads=str(chained)).generate(prompt, 12).tokens == reference.tokens


def test_a_smoke_eagle_training_gives_a_layer_that_a_lossless_stack_runs(tmp_path, capsys, threads) -> None:
    from specstack import Registry
    from specstack.data import book_tokens
    from specstack.models import load_default
    from specstack_medusa.eagle import load_layer

    out = tmp_path / "layer.safetensors"
    argv = ["train", "eagle", "--text", "emma", "--eval-text", "persuasion", "--out", str(out), "--minutes", "0.05",
            "--set", "seq_len=48", "--set", "prompt_len=16", "--set", "chunks=4", "--set", "generations=2", "--set", "gen_batch=2",
            "--set", "eval_chunks=2", "--set", "window=16", "--set", "steps=2", "--set", "windows=2", "--set", "intermediate_size=64",
            "--set", "draft_vocab=512", "--set", f"threads={threads}"]
    assert main(argv) == 0
    metrics = json.loads(out.with_suffix(".json").read_text())
    assert metrics["steps"] >= 1 and set(metrics["held_out"]) == {"persuasion:text", "persuasion:greedy"}
    assert all(0.0 <= a <= 1.0 for a in metrics["held_out"]["persuasion:greedy"]["top1"])
    layer = load_layer(out)
    assert layer.info.heads == 2 and layer.info.window == 16 and layer.info.draft_vocab == 512 and len(layer.info.accuracy[0]) == 8
    target, _, tokenizer = load_default(with_draft=False)
    prompt = book_tokens(tokenizer, 300, name="kjv")
    registry = Registry.create()
    reference = registry.stack("autoregressive", target=target).generate(prompt, 12)
    assert registry.stack("eagle-lookup", target=target, heads=str(out)).generate(prompt, 12).tokens == reference.tokens


def test_the_eagle_trainers_unrolled_passes_are_the_drafters_rows() -> None:
    """Training unrolls the layer over its passes on whole windows at once; drafting adds one row at a time. Pass
    p at base i must be what drafting computes p tokens after the true feature at i: the row of i over the true
    rows up to it, then each drafted row over those and the drafted rows before it (a pass that sees a later base's
    rows, or misses its own, fails)."""
    import torch

    from specstack_medusa.eagle import EagleInfo, EagleLayer, attend
    from specstack_training.eagle import unrolled

    torch.manual_seed(0)
    layer = EagleLayer.random(EagleInfo(hidden_size=8, attention_heads=2, intermediate_size=16, heads=3, window=16, vocab_size=50), scale=0.6)
    embedding, width, steps = torch.randn(50, 8), 12, 3
    tokens, features = torch.randint(50, (2, width + steps)), torch.randn(2, width, 8)
    with torch.no_grad():
        passes = unrolled(layer, embedding, tokens, features, steps)  # steps x [2, W, H]
        for b, i in [(0, 0), (1, 5), (1, width - 1)]:
            u, q, keys, values = layer.rows(features[b, : i + 1], embedding[tokens[b, 1 : i + 2]], torch.arange(i + 1))
            state = layer.finish(u, attend(q, keys, values, torch.ones(i + 1, i + 1, dtype=torch.bool).tril()))[i]
            assert torch.allclose(state, passes[0][b, i], atol=1e-5)
            for p in range(2, steps + 1):
                u, q, k, v = layer.rows(state[None], embedding[tokens[b, i + p]][None], torch.tensor([i + p - 1]))
                keys, values = torch.cat([keys, k]), torch.cat([values, v])
                state = layer.finish(u, attend(q, keys, values, torch.ones(1, keys.shape[0], dtype=torch.bool)))[0]
                assert torch.allclose(state, passes[p - 1][b, i], atol=1e-5), (b, i, p)


@pytest.mark.real_model
def test_the_shipped_shared_draft_loads_with_the_targets_layers_and_agrees_with_it() -> None:
    """``specstack/assets/smollm2-draft-shared`` holds only its trained layer: loaded, its first two layers
    are the target's, and it agrees with the target's argmax on held-out text about as TRAINING.md says
    (49.7% on 20,480 positions; random or missing shared layers give a few percent)."""
    import torch

    from specstack.data import book_tokens
    from specstack.models import draft_dir, load_draft, load_target

    target, tokenizer = load_target()
    draft = load_draft(target, draft_dir().parent / "smollm2-draft-shared")
    for mine, theirs in zip(draft.module.model.layers[:2], target.module.model.layers):
        assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), theirs.parameters()))
    ids = torch.tensor(book_tokens(tokenizer, 1024, name="prideprejudice")).reshape(2, 512)  # [2, 512]
    with torch.no_grad():
        agree = (draft.module(input_ids=ids).logits.argmax(-1) == target.module(input_ids=ids).logits.argmax(-1)).float().mean().item()
    assert agree > 0.35


def _soft_label_data(seed: int = 3):
    """Random states [N, T, H], an LM head [V, H] and the greedy tokens it gives: what labelling stores."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    states, lm_head = torch.randn(3, 10, 8, generator=gen), torch.randn(40, 8, generator=gen)  # [N, T, H], [V, H]
    return states, lm_head, (states @ lm_head.T).argmax(-1)  # ..., [N, T]


def test_soft_labels_are_the_targets_distribution_where_each_hard_label_is_its_argmax() -> None:
    """Head k on the state at (row, col) learns p_T(. | h_{col+k}); its argmax is the hard label a_{col+k}.
    A teacher read one position off (h_{col+k-1}) gives other argmaxes and fails this."""
    import torch

    from specstack_training.medusa import targets, teacher_probs

    states, lm_head, greedy = _soft_label_data()
    rows, cols = torch.tensor([0, 1, 2, 2, 0]), torch.tensor([0, 3, 5, 8, 9])  # [n]: the last two run past the row's end
    labels = targets(greedy, 3, rows, cols)  # [n, K]
    probs = teacher_probs(lm_head, states, rows, cols, 3, 0.6)  # [K, n, V]
    assert probs.shape == (3, 5, 40) and torch.allclose(probs.sum(-1), torch.ones(3, 5))
    inside = labels.T >= 0  # [K, n]
    assert int(inside.sum()) == 10  # three positions with all 3 heads; (row 2, col 8) with one; (row 0, col 9) with none
    assert torch.equal(probs.argmax(-1)[inside], labels.T[inside])
    sharper = teacher_probs(lm_head, states, rows, cols, 3, 0.3)  # [K, n, V]
    assert torch.all(sharper.max(-1).values > probs.max(-1).values)  # a teacher that ignores the temperature fails this


def test_the_precomputed_soft_labels_are_the_targets_top_tokens_renormalised() -> None:
    """All V tokens kept: exactly the target's distribution at each position; fewer: its most likely ones,
    renormalised, in its order. A label computed at another temperature than asked fails this."""
    import torch

    from specstack_training.medusa import soft_labels, teacher_probs

    states, lm_head, greedy = _soft_label_data()
    rows, cols = torch.arange(3).repeat_interleave(10), torch.arange(10).repeat(3)  # every position
    exact = teacher_probs(lm_head, states, rows, cols - 1, 1, 0.6)[0]  # [30, V]: head 1 at col - 1 reads position col
    probs, ids = soft_labels(lm_head, states, 0.6, 40)  # [N, T, V] each
    assert torch.allclose(torch.zeros(30, 40).scatter(1, ids.flatten(0, 1).long(), probs.flatten(0, 1)), exact, atol=1e-6)
    top_probs, top_ids = soft_labels(lm_head, states, 0.6, 4)  # [N, T, 4] each
    assert torch.equal(top_ids[..., 0], greedy)
    assert torch.allclose(top_probs, probs[..., :4] / probs[..., :4].sum(-1, keepdim=True), atol=1e-6)


def test_the_soft_label_loss_tends_to_the_hard_one_as_the_temperature_falls_and_skips_positions_past_the_row() -> None:
    """As T -> 0 the soft label is one-hot on a_{t+k}, so the loss is the hard cross-entropy; positions
    without a label weigh nothing, whatever their logits."""
    import torch

    from specstack_training.medusa import loss_of, soft_labels

    states, lm_head, greedy = _soft_label_data()
    rows, cols = torch.tensor([0, 1, 2, 2, 0]), torch.tensor([0, 3, 5, 8, 9])  # [n]
    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(4))  # [K, n, V]
    hard = loss_of(logits, greedy, None, rows, cols)
    assert torch.allclose(loss_of(logits, greedy, soft_labels(lm_head, states, 1e-4, 8), rows, cols), hard, atol=1e-4)
    soft = soft_labels(lm_head, states, 0.6, 8)
    warm = loss_of(logits, greedy, soft, rows, cols)
    assert not torch.allclose(warm, hard, atol=1e-2)
    moved = logits.clone()
    moved[:, 4] += 5 * torch.randn(3, 40)  # (row 0, col 9): no head has a label there
    moved[1:, 3] -= 7 * torch.randn(2, 40)  # (row 2, col 8): heads 2 and 3 run past the row
    assert torch.allclose(loss_of(moved, greedy, soft, rows, cols), warm)
