"""The EAGLE drafter (specstack_medusa.eagle, .eagle_drafter): its feature cache, its trees, and the eagle stacks.

The layer here is random (synthetic models have no text to learn): it drafts badly but must never change the
output. What it drafts is checked node by node against a recomputation from scratch, from the target's own hidden
state of each prefix; losslessness as for the Medusa heads (greedy output equals the target's greedy decoding;
sampled output passes a chi-square test against the exact distribution of 3-token continuations).
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from specstack import Level, Registry, SamplingConfig, SpecstackError, SpeculationStack
from specstack.channels import HiddenLog
from specstack.synthetic import SyntheticLM, greedy_decode
from specstack.testing import ALPHA, stack_pvalue
from specstack_medusa import plugin
from specstack_medusa.eagle import EagleInfo, EagleLayer, FeatureCache, attend, load_layer, save_layer, synthetic_layer
from specstack_medusa.eagle_drafter import EagleDrafter

SMALL = {"budget": 16, "chunk_size": 4, "stride": 8}  # retrieval sized for prompts of a few dozen tokens


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.create(entry_points=False, plugins=[plugin])


def _layer(vocab: int, window: int = 16) -> EagleLayer:
    """A random layer whose attention is sharp enough that a row at the wrong position changes what it drafts."""
    info = attrs.evolve(synthetic_layer(vocab).info, window=window, accuracy=[[0.5, 0.4], [0.5, 0.4], [0.5, 0.4]])
    return EagleLayer.random(info, scale=0.6)


# -- the feature cache -----------------------------------------------------------------------------


def test_the_feature_cache_keeps_the_last_window_rows_in_order() -> None:
    """Rows appended one to three at a time past twice the window: the view is always the last ``window`` rows
    appended, in order (a compaction that drops or reorders rows fails), and ``truncate`` forgets the latest."""
    cache, written = FeatureCache(window=5), []
    for n in [1, 3, 2, 3, 1, 2, 3, 3, 1]:
        rows = torch.arange(len(written), len(written) + n, dtype=torch.float32)[:, None, None]  # [n, 1, 1]: each row's position
        cache.append(rows, -rows, np.arange(len(written), len(written) + n) + 1)
        written += rows.flatten().tolist()
        keys, values = cache.view()
        assert keys.flatten().tolist() == written[-5:] and values.flatten().tolist() == [-x for x in written[-5:]]
        assert cache.next == len(written)
    cache.truncate(len(written) - 2)
    assert cache.view()[0].flatten().tolist() == written[-7:-2][-cache.view()[0].shape[0]:] and cache.next == len(written) - 2
    before = cache.first - 3
    cache.truncate(before)  # before the first row held: nothing held, and the next row goes there
    assert cache.view()[0].shape[0] == 0 and cache.next == before


def test_the_feature_cache_finds_where_its_rows_read_another_text() -> None:
    cache = FeatureCache(window=8)
    cache.clear(10)
    cache.append(torch.zeros(4, 1, 1), torch.zeros(4, 1, 1), np.array([5, 6, 7, 8]))
    assert cache.first == 10 and cache.agreeing(np.array([5, 6, 7, 8])) == 4
    assert cache.agreeing(np.array([5, 6, 9, 8])) == 2 and cache.agreeing(np.array([5])) == 1


def test_the_hidden_log_hands_the_longest_run_of_held_positions() -> None:
    log = HiddenLog(room=8)
    log.record(torch.arange(3, 12), torch.arange(3, 12, dtype=torch.float32)[:, None])  # the ring keeps 4 … 11
    first, states = log.run(0, 12)
    assert first == 4 and states.flatten().tolist() == list(range(4, 12))
    log.forget_from(9)
    assert log.run(6, 12) == (12, None)  # 11 is not held
    first, states = log.run(6, 9)
    assert first == 6 and states.flatten().tolist() == [6, 7, 8]


# -- the tree --------------------------------------------------------------------------------------


def _reference_tree(layer: EagleLayer, target: SyntheticLM, prefix: list[int], earliest: int, q: int, draft) -> None:
    """Check ``draft`` node by node against the layer recomputed from scratch: the committed rows of positions
    q - window + 1 … q, from ``earliest`` on, from the target's hidden state of each prefix (``hidden_for``) and the
    token after it, then
    each node's row from its parent's predicted feature and its own token, at its depth's position, attending over
    the committed rows, its ancestors' rows and itself."""
    window = layer.info.window
    positions = list(range(max(earliest, q - window + 1), q + 1))
    features = torch.stack([target.hidden_for(prefix[: j + 1]) for j in positions])  # [w, H]
    embed = lambda tokens: target.input_embeddings(torch.tensor(tokens))  # noqa: E731
    with torch.no_grad():
        u, qs, keys, values = layer.rows(features, embed([prefix[j + 1] for j in positions]), torch.tensor(positions))
        allowed = torch.ones(len(positions), len(positions), dtype=torch.bool).tril()
        states = {-1: layer.finish(u, attend(qs, keys, values, allowed))[-1]}  # node -> the feature its children are drafted from
        rows = {}  # node -> (key, value) of its row
        for node in range(len(draft)):
            parent = int(draft.parents[node])
            logits = target.output_logits(states[parent][None])[0]  # [V]
            assert torch.allclose(draft.probs[node], torch.softmax(logits, -1), atol=1e-5), node
            depth, up = 0, parent
            while up != -1:
                depth, up = depth + 1, int(draft.parents[up])
            u, qn, kn, vn = layer.rows(states[parent][None], embed([int(draft.tokens[node])]), torch.tensor([q + 1 + depth]))
            rows[node] = (kn, vn)
            line, up = [node], parent
            while up != -1:
                line, up = [up, *line], int(draft.parents[up])
            k = torch.cat([keys, *(rows[n][0] for n in line)])
            v = torch.cat([values, *(rows[n][1] for n in line)])
            states[node] = layer.finish(u, attend(qn, k, v, torch.ones(1, k.shape[0], dtype=torch.bool)))[0]


@pytest.mark.parametrize("new_tokens", [5, 40])  # within the window, and past twice it (the cache compacts)
def test_eagle_drafts_each_node_from_the_committed_rows_and_its_ancestors(new_tokens: int) -> None:
    """A drafter that reads a stale or misplaced committed row, rotates a row to the wrong position, or lets a node
    see a row off its path fails."""
    target = SyntheticLM(vocab_size=10, seed=1, sharpness=2.0)
    layer = _layer(10)
    drafter = EagleDrafter(vocab=10, heads=layer, tree_size=9, top_k=2, min_prob=0.0)
    prompt = list(range(10)) * 2
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)])
    prefix = prompt + list(stack.generate(prompt, new_tokens).tokens)
    draft = drafter.propose(prefix, drafter.step)
    q, _ = drafter._channel.latest(prefix)
    assert q == len(prefix) - 2 and len(draft) == 9 and int(draft.parents.max()) >= 2  # three depths, branching
    _reference_tree(layer, target, prefix, 0, q, draft)  # the prompt's positions too: the level logs its prefill's last rows
    again = drafter.propose(prefix, drafter.step)  # the same prefix again: q's row is not added twice
    assert torch.equal(again.tokens, draft.tokens) and torch.allclose(again.probs, draft.probs)


def test_eagle_drafts_from_the_rows_of_the_text_the_level_kept() -> None:
    """Under a middle level whose tokens the target rejects, committed rows of rejected tokens are dropped: the
    next tree is the one recomputed from scratch on the text kept. (Such a level feeds some tokens without scoring
    them, so it holds no state there, and the drafter's rows start after the last such hole: the reference starts
    where the drafter's rows do, and recomputes their values.)"""
    target = SyntheticLM(vocab_size=10, seed=21, sharpness=1.5)
    middle = SyntheticLM(vocab_size=10, seed=22, base=target, noise=2.0)
    layer = _layer(10)
    drafter = EagleDrafter(vocab=10, heads=layer, tree_size=6, top_k=2, min_prob=0.0)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=middle, gamma=drafter.step), Level(model=target, gamma=4)])
    prompt = list(range(10)) * 2
    result = stack.generate(prompt, 30)
    assert result.levels[2].rejected > 0  # the target rejected some of what the middle level emitted
    prefix = prompt + list(result.tokens)
    draft = drafter.propose(prefix, drafter.step)
    found = drafter._channel.latest(prefix)
    if found is None:  # the middle level has not scored this text: nothing drafted
        assert len(draft) == 0
        return
    assert found[0] - drafter._cache.first >= 2
    _reference_tree(layer, middle, prefix, drafter._cache.first, found[0], draft)


def test_eagle_drops_the_rows_of_tokens_the_prefix_no_longer_holds() -> None:
    """The level scores another text of the same length from ten tokens back (as a level below the top does when
    the top rejects its tokens): the rows the drafter holds past that point read the old tokens, and the next tree
    is the one recomputed from scratch on the new text."""
    target = SyntheticLM(vocab_size=10, seed=1, sharpness=2.0)
    layer = _layer(10)
    drafter = EagleDrafter(vocab=10, heads=layer, tree_size=6, top_k=2, min_prob=0.0)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)])
    prompt = list(range(10)) * 2
    prefix = prompt + list(stack.generate(prompt, 30).tokens)
    drafter.propose(prefix, drafter.step)
    held = drafter._cache.next
    other = prefix[:-10] + [(t + 1) % 10 for t in prefix[-10:]] + [3]
    stack.top.lm.logits(other[:-1], 12)  # the level scores the new text's last 12 positions
    draft = drafter.propose(other, drafter.step)
    q, _ = drafter._channel.latest(other)
    assert q == len(other) - 2 and q >= held  # no row is past q: only the tokens tell the old rows from the new
    _reference_tree(layer, target, other, 0, q, draft)


# -- losslessness and the stacks ---------------------------------------------------------------------


@pytest.mark.parametrize("tree_size", [1, 4, 12])
def test_eagle_greedy_equals_the_target_greedy(tree_size: int) -> None:
    target = SyntheticLM(vocab_size=16, seed=1, sharpness=2.0)
    drafter = EagleDrafter(vocab=16, heads=_layer(16), tree_size=tree_size)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)])
    prompt = list(range(8)) * 3
    assert list(stack.generate(prompt, 40).tokens) == greedy_decode(target, prompt, 40)


def test_the_eagle_recipes_are_greedy_lossless(registry) -> None:
    target = SyntheticLM(vocab_size=16, seed=2, sharpness=2.0)
    prompt = list(range(8)) * 5
    for name, options, level0 in [("eagle", {}, "eagle"), ("eagle-lookup", {}, "prompt-lookup+eagle"),
                                  ("triforce-eagle-lookup", SMALL, "prompt-lookup+eagle")]:
        stack = registry.stack(name, target=target, tree_size=10, heads=_layer(16), **options)
        result = stack.generate(prompt, 30)
        assert list(result.tokens) == greedy_decode(target, prompt, 30), name
        assert result.levels[0].name == level0 and result.levels[1].drafted > result.levels[1].rounds  # trees, not single tokens


@pytest.mark.parametrize("draft_temperature", [0, 1.0], ids=["ranks", "drawn"])
def test_sampled_eagle_keeps_the_target_distribution(draft_temperature: float) -> None:
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    drafter = EagleDrafter(vocab=4, heads=synthetic_layer(4), tree_size=6, draft_temperature=draft_temperature)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)], sampling=sampling, seed=3)
    assert stack_pvalue(stack, target, sampling, [1, 2]) > ALPHA


def test_sampled_triforce_eagle_lookup_keeps_the_target_distribution(registry) -> None:
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    stack = registry.stack("triforce-eagle-lookup", target=target, heads=synthetic_layer(4), tree_size=6, sampling=sampling, seed=3,
                           first_only=False, min_ngram=1, gamma2=3, **SMALL)
    assert stack_pvalue(stack, target, sampling, [1, 2, 3, 1, 2, 0] * 4) > ALPHA


# -- files and errors ------------------------------------------------------------------------------


def test_a_layer_round_trips_through_a_file_and_bad_files_are_one_line(tmp_path) -> None:
    layer = _layer(10)
    layer.token_rank = torch.randperm(10)
    save_layer(tmp_path / "layer.safetensors", layer)
    loaded = load_layer(tmp_path / "layer.safetensors")
    assert loaded.info == layer.info and torch.equal(loaded.token_rank, layer.token_rank)
    assert all(torch.equal(a, b.bfloat16().float()) for a, b in zip(loaded.state_dict().values(), layer.state_dict().values()))  # stored as bf16
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    for path, said in [(tmp_path / "bad.safetensors", "is not an eagle layer file"), (tmp_path / "none.safetensors", "does not exist")]:
        with pytest.raises(SpecstackError, match=said) as error:
            load_layer(path)
        assert "\n" not in str(error.value)


def test_a_layer_for_another_model_is_refused_in_one_line() -> None:
    layer = EagleLayer.random(EagleInfo(hidden_size=12, attention_heads=2, intermediate_size=8, heads=2, vocab_size=16))
    drafter = EagleDrafter(vocab=16, heads=layer)
    with pytest.raises(SpecstackError, match="hidden states of size 12"):
        SpeculationStack.build([Level(drafter=drafter), Level(model=SyntheticLM(vocab_size=16), gamma=3)])
    with pytest.raises(SpecstackError, match="attention_heads 5 is not allowed"):
        EagleInfo(hidden_size=12, attention_heads=5, intermediate_size=8, heads=2, vocab_size=16)
