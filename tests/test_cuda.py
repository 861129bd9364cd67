"""The device path: levels on the CPU, on a GPU, or split between them, eager or with CUDA graphs.

Every test here runs on the CPU in CI; the CUDA placements run where a GPU is (``make gpu-check``).
Greedy output must equal the target's own greedy decoding by transformers (its SDPA attention and
its cache), on random-weight Llama models and on the shipped draft used as a target, in float32.
"""

from __future__ import annotations

import pytest
import torch

from specstack import Level, Retrieval, SpeculationStack, StreamingLLM
from specstack.graphs import ForwardGraphs, chain_view
from specstack.hf import transformers_attention
from specstack.model import CachedModel
from specstack.types import LevelStats
from specstack.testing.llama import perturbed, random_llama, shipped_draft_as_target

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PLACEMENTS = [  # (draft device, target device)
    pytest.param(("cpu", "cpu"), id="cpu"),
    pytest.param(("cuda", "cuda"), id="cuda", marks=CUDA),
    pytest.param(("cpu", "cuda"), id="cpu-draft-cuda-target", marks=CUDA),
]
NEW_TOKENS = 40


def _prompt(length: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator(device="cpu").manual_seed(seed), device="cpu").tolist()


def _transformers_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decoding: transformers' generate with its SDPA attention."""
    ids = torch.tensor([prompt], device=model.device)  # [1, P]
    with transformers_attention([model.module], "sdpa"), torch.inference_mode():
        out = model.module.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _triforce(draft, target, **build) -> SpeculationStack:
    """TriForce's shape: a StreamingLLM draft, the target over a retrieval view, the target over its full cache."""
    return SpeculationStack.build([
        Level(model=draft, policy=StreamingLLM(sinks=4, window=60)),
        Level(model=target, policy=Retrieval(budget=64, chunk_size=8, stride=16, reserve=16), gamma=2),
        Level(model=target, gamma=4),
    ], **build)


@pytest.fixture(scope="module")
def llamas():
    target = random_llama(seed=0, name="target")
    return target, perturbed(target, noise=0.3, seed=1, name="draft")


def _placed(llamas, placement: tuple[str, str], graphs: bool):
    target, draft = (model.module for model in llamas)
    draft_device, target_device = placement
    from specstack.hf import HFCausalLM

    placed_target = HFCausalLM(module=target.to(target_device), tokenizer_id=llamas[0].tokenizer_id, name="target", cuda_graphs=graphs)
    placed_draft = HFCausalLM(module=draft.to(draft_device), tokenizer_id=llamas[1].tokenizer_id, name="draft", cuda_graphs=graphs)
    return placed_target, placed_draft


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_greedy_triforce_equals_transformers_greedy(llamas, placement, graphs) -> None:
    target, draft = _placed(llamas, placement, graphs)
    prompt = _prompt(300, target.vocab_size)
    result = _triforce(draft, target).generate(prompt, NEW_TOKENS)
    assert list(result.tokens) == _transformers_greedy(target, prompt, NEW_TOKENS)
    draft_level, retrieval, full = result.levels
    assert 0 < full.accepted < full.drafted and retrieval.gathers > 0  # rounds accepted and rejected, the view was re-gathered
    on_gpu = [m for m in (draft, target) if m.device.type == "cuda"]
    for model in on_gpu:  # every CUDA model replayed graphs when they were on, and none otherwise
        assert (model.graphs.replays > 0) == graphs


@pytest.mark.parametrize("placement", PLACEMENTS[:2])
def test_the_shipped_draft_as_a_target(placement) -> None:
    """A real checkpoint with grouped-query attention (9 query heads over 3 KV heads) as the target,
    drafted for by a small random model of its vocabulary."""
    draft_device, target_device = placement
    target = shipped_draft_as_target(seed=3, device=target_device)
    draft = random_llama(seed=4, vocab_size=target.vocab_size, device=draft_device, logit_scale=1.0, name="draft")
    prompt = _prompt(200, target.vocab_size, seed=5)
    result = _triforce(draft, target).generate(prompt, 24)
    assert list(result.tokens) == _transformers_greedy(target, prompt, 24)


@CUDA
def test_a_graphed_forward_equals_the_eager_forward(llamas) -> None:
    """The same draft steps, replayed from CUDA graphs and run eagerly, give the same logits."""
    target, _ = _placed(llamas, ("cuda", "cuda"), graphs=True)
    prompt = _prompt(120, target.vocab_size, seed=7)
    rows = {}
    for graphs in (True, False):
        target.cuda_graphs = graphs
        stack = SpeculationStack.build([Level(model=target, policy=StreamingLLM(sinks=4, window=60))])
        lm = stack.top.lm
        rows[graphs] = torch.cat([lm.logits(prompt[: n + 1], 1) for n in range(60, 120)])  # [60, V]; past the window: evictions too
    assert target.graphs.replays == 59  # the 61-token prompt runs eagerly, each later token from a graph
    torch.testing.assert_close(rows[True], rows[False], rtol=1e-4, atol=1e-4)


def test_graphs_apply_only_to_short_chains_over_bounded_cuda_stores() -> None:
    from specstack.batch import TokenBatch
    from specstack.kvstore import KVStore

    store = KVStore(layers=1, kv_heads=1, head_dim=4, capacity=64, dtype=torch.float32)
    assert not ForwardGraphs.applies(TokenBatch.chain([1, 2], 0, 1), store)  # a CPU store is never graphed
    if torch.cuda.is_available():
        gpu = KVStore(layers=1, kv_heads=1, head_dim=4, capacity=64, dtype=torch.float32, device="cuda")
        assert ForwardGraphs.applies(TokenBatch.chain([1, 2], 0, 1), gpu)
        assert not ForwardGraphs.applies(TokenBatch.chain(list(range(40)), 0, 1), gpu)


@pytest.mark.parametrize("relative", [True, False], ids=["streaming-relative", "absolute"])
def test_what_a_graph_captures_equals_the_eager_forward_on_the_cpu(llamas, relative) -> None:
    """The computation a CUDA graph records (writes at device-side slots, attention over the whole
    store under the device-built mask), run uncaptured on the CPU, gives the eager forward's logits."""
    from specstack.batch import TokenBatch

    target, _ = llamas
    target.module.to("cpu")
    lm = CachedModel(target, StreamingLLM(sinks=4, window=60, relative_positions=relative), LevelStats(name="view"))
    prompt, new = _prompt(50, target.vocab_size, seed=8), [5, 6, 7]
    eager = lm.logits([*prompt, *new], 3)  # [3, V]
    store = lm.cache
    store.truncate(len(prompt))  # roll back the three tokens: they are written again below
    batch = TokenBatch.chain(new, len(prompt), 3)
    store.begin(batch.positions)
    rope = store.rope_positions(batch.positions)  # [T]
    view = chain_view(torch.tensor([store.length]), torch.arange(3), torch.arange(store.capacity), target.graphs.group)
    with torch.inference_mode():
        static = target._static_forward(store, batch.tokens[None], rope[None], view, 3)  # [3, V]
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)


def test_a_graphed_forward_that_wants_no_logits_returns_none(llamas) -> None:
    """A prompt chunk may want no logits; transformers reads logits_to_keep=0 as "all of them"."""
    target, _ = llamas
    target.module.to("cpu")
    lm = CachedModel(target, StreamingLLM(sinks=4, window=60), LevelStats(name="view"))
    lm.logits(_prompt(20, target.vocab_size, seed=9), 1)
    store = lm.cache
    view = chain_view(torch.tensor([store.length]), torch.arange(2), torch.arange(store.capacity), target.graphs.group)
    with torch.inference_mode():
        logits = target._static_forward(store, torch.tensor([[5, 6]]), torch.tensor([[20, 21]]), view, 0)
    assert logits.shape == (0, target.vocab_size)
