"""``specstack quality``: perplexity by position bucket and passkey retrieval (specstack/bench/quality.py).

The fast tests use a tiny random-weight Llama (trained window 64, from tests/test_long_context.py)
against a direct transformers forward of the whole sequence; the last one runs the command on the
embedded default.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from specstack import SpecstackError
from specstack.bench.quality import perplexity_by_position, total
from tests.test_long_context import tiny_dir, tiny_model  # noqa: F401 (tiny_dir is a fixture)


def text(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))]


def direct_nll(model, tokens: list[int]) -> torch.Tensor:
    """[n] float64: -log p(token t | tokens before t) from one plain transformers forward (eager
    attention, no KV store), 0 at t = 0."""
    module = copy.deepcopy(model.module)
    module.set_attn_implementation("eager")
    ids = torch.tensor([tokens])  # [1, n]
    with torch.no_grad():
        logits = module(input_ids=ids).logits[0]  # [n, V]
    nll = F.cross_entropy(logits[:-1].double(), ids[0, 1:], reduction="none")  # [n-1]
    return torch.cat([torch.zeros(1, dtype=torch.float64), nll])  # [n]


@pytest.mark.parametrize("context, scaling, n, edges", [
    (None, None, 64, (10, 33, 64)),  # the trained window
    (256, "yarn", 200, (16, 64, 128, 200)),  # beyond it, YaRN-scaled
    (256, "extrapolate", 200, (64, 200)),
])
def test_perplexity_is_exp_of_the_mean_nll_of_a_direct_forward(tiny_dir, context, scaling, n, edges) -> None:
    model = tiny_model(tiny_dir, context=context, rope_scaling=scaling)
    tokens = text(n)
    buckets = perplexity_by_position(model, tokens, edges, chunk=48)
    nll = direct_nll(model, tokens)
    for bucket, start, end in zip(buckets, (0, *edges[:-1]), edges):
        assert (bucket.start, bucket.end) == (start, end)
        expected = nll[start:end].sum().item()
        assert bucket.nll == pytest.approx(expected, rel=1e-5)
        assert bucket.perplexity == pytest.approx(math.exp(expected / bucket.tokens), rel=1e-5)
    assert total(buckets).perplexity == pytest.approx(math.exp(nll.sum().item() / (n - 1)), rel=1e-5)


def test_the_chunk_size_does_not_change_the_result(tiny_dir) -> None:
    model = tiny_model(tiny_dir, context=256, rope_scaling="yarn")
    tokens, edges = text(200, seed=1), (50, 100, 150, 200)
    whole = perplexity_by_position(model, tokens, edges, chunk=256)
    for chunk in (1, 7, 16, 48, 100):
        chunked = perplexity_by_position(model, tokens, edges, chunk=chunk)
        assert [b.nll for b in chunked] == pytest.approx([b.nll for b in whole], rel=1e-5)


def test_only_the_text_up_to_the_last_edge_is_scored_and_progress_is_per_chunk(tiny_dir) -> None:
    model = tiny_model(tiny_dir)
    tokens = text(64, seed=2)
    calls = []
    buckets = perplexity_by_position(model, tokens, (20, 40), chunk=16, progress=lambda done, n: calls.append((done, n)))
    assert calls == [(16, 40), (32, 40), (40, 40)]
    assert total(buckets).nll == pytest.approx(direct_nll(model, tokens[:40]).sum().item(), rel=1e-5)


def test_bucket_token_counts_add_up(tiny_dir) -> None:
    model = tiny_model(tiny_dir)
    edges = (2, 3, 17, 40, 64)
    buckets = perplexity_by_position(model, text(64, seed=3), edges, chunk=16)
    assert [(b.start, b.end, b.tokens) for b in buckets] == [(0, 2, 1), (2, 3, 1), (3, 17, 14), (17, 40, 23), (40, 64, 24)]
    assert sum(b.tokens for b in buckets) == total(buckets).tokens == 63  # every token but the first is predicted once


@pytest.mark.parametrize("edges, message", [
    ((), r"^no bucket edges given; give increasing token positions, e.g. 1024 2048$"),
    ((10, 10), r"^bucket edges \[10, 10\] are not increasing$"),
    ((20, 10), r"^bucket edges \[20, 10\] are not increasing$"),
    ((1, 10), r"^bucket edge 1 is too small; the first bucket must end at position 2 or later$"),
    ((10, 65), r"^bucket edge 65 is beyond the 64 tokens given$"),
    ((10, 20.5), r"^bucket edges \[10, 20.5\] are not all integers$"),
])
def test_bad_edges_are_one_line_errors(tiny_dir, edges, message) -> None:
    model = tiny_model(tiny_dir)
    with pytest.raises(SpecstackError, match=message):
        perplexity_by_position(model, text(64), edges)


def test_a_text_beyond_the_window_is_a_one_line_error(tiny_dir) -> None:
    model = tiny_model(tiny_dir)  # window 64
    with pytest.raises(SpecstackError, match=r"^100 tokens do not fit the model's window of 64; use a larger --context$"):
        perplexity_by_position(model, text(100), (50, 100))


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "4096", "--edges", "2048", "1024"], "bucket edges [2048, 1024] are not increasing"),
    (["--tokens", "1024", "--edges", "512", "2048"], "bucket edge 2048 is beyond the 1024 tokens given"),
    (["--tokens", "many"], "--tokens 'many' is not allowed; use an integer >= 0"),
    (["--tokens", "0"], "nothing to measure; give --tokens N >= 2 or --passkey LENGTH"),
    (["--book", "ulysses"], "unknown book 'ulysses'; available: prideprejudice, sensesensibility, mansfieldpark, emma, "
                            "northangerabbey, persuasion, kjv"),
    (["--context", "0"], "--context '0' is not allowed; use an integer >= 1"),
    (["--passkey", "8000", "--depths", "1.5"], "--depths '1.5' is not allowed; use a number in [0, 1]"),
    (["--dtype", "float16"], "unknown dtype 'float16'; available: bfloat16, float32"),
])
def test_bad_command_lines_exit_2_with_one_line_before_loading_weights(monkeypatch, capsys, argv, message) -> None:
    import specstack.models
    from specstack.cli import main

    def no_weights(**kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(specstack.models, "load_default", no_weights)
    assert main(["quality", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"specstack quality: error: {message}"]


@pytest.mark.real_model
def test_the_command_on_the_embedded_default(capsys) -> None:
    """512 tokens of KJV and a 300-token passkey prompt in the trained window, fp32."""
    from specstack.cli import main

    assert main(["quality", "--tokens", "512", "--edges", "128", "512", "--passkey", "300", "--depths", "0.5", "--threads", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    buckets = record["perplexity"]["buckets"]
    assert [(b["start"], b["end"], b["tokens"]) for b in buckets] == [(0, 128, 127), (128, 512, 384)]
    assert all(1 < b["perplexity"] < 100 for b in buckets)  # a trained model on English prose, not noise (vocab 49152)
    [answer] = record["passkey"]
    assert (answer["length"], answer["depth"], answer["found"]) == (300, 0.5, True)
    assert str(answer["key"]) in answer["answer"]
