"""gamma=auto: the γ chosen from measured costs and acceptance (specstack.autotune)."""

from __future__ import annotations

import pytest

from specstack import Level, SpeculationStack
from specstack import autotune
from specstack.errors import SpecstackError
from specstack.policies import StreamingLLM
from specstack.synthetic import SyntheticLM, greedy_decode


def test_best_gamma_of_one_level_matches_the_hand_computed_optimum() -> None:
    # t_d = 0.1, every forward costs 1, α = 0.5: t(γ) = (0.1γ + 1) / (2(1 − 0.5^(γ+1)))
    # γ=1: 1.1/1.5 = 0.733, γ=2: 1.2/1.75 = 0.686, γ=3: 1.3/1.875 = 0.693 -> γ = 2, speedup 1/0.686
    costs = {t: 1.0 for t in range(1, 10)}
    gammas, speedup = autotune.best_gammas(0.1, [costs], [0.5], 1.0, max_gamma=8)
    assert gammas == (2,)
    assert speedup == pytest.approx(1.75 / 1.2)


def test_a_round_of_gamma_tokens_is_priced_as_a_forward_of_gamma_plus_one() -> None:
    # forwards of up to 3 tokens are cheap, wider ones are not: the longest affordable draft is γ = 2
    costs = {t: 1.0 if t <= 3 else 100.0 for t in range(1, 10)}
    assert autotune.best_gammas(0.001, [costs], [0.9], 1.0, max_gamma=8)[0] == (2,)


def test_expensive_wide_forwards_and_poor_acceptance_choose_short_drafts() -> None:
    steep = {t: float(t) for t in range(1, 10)}  # a T-token forward costs T single steps
    assert autotune.best_gammas(0.01, [steep], [0.3], 1.0, max_gamma=8)[0] == (1,)
    flat = {t: 1.0 for t in range(1, 10)}
    assert autotune.best_gammas(0.01, [flat], [0.95], 1.0, max_gamma=8)[0] == (8,)


def test_two_levels_are_tuned_jointly() -> None:
    # a cheap middle level with good acceptance deserves a longer γ1 than an expensive one
    top = {t: 1.0 + 0.05 * t for t in range(1, 10)}
    cheap_middle = {t: 0.1 for t in range(1, 10)}
    dear_middle = {t: 0.9 * t for t in range(1, 10)}
    cheap = autotune.best_gammas(0.01, [cheap_middle, top], [0.8, 0.9], 1.05, max_gamma=8)[0]
    dear = autotune.best_gammas(0.01, [dear_middle, top], [0.8, 0.9], 1.05, max_gamma=8)[0]
    assert cheap[0] > dear[0]


def _three_levels(device: str = "cpu") -> tuple[SpeculationStack, SyntheticLM]:
    target = SyntheticLM(vocab_size=16, seed=1, sharpness=3.0, device=device)
    middle = SyntheticLM(vocab_size=16, seed=2, base=target, noise=0.3, device=device)
    small = SyntheticLM(vocab_size=16, seed=3, base=target, noise=0.8, device=device)
    stack = SpeculationStack.build([
        Level(model=small, policy=StreamingLLM(sinks=2, window=8), name="draft"),
        Level(model=middle, gamma=2, name="middle"),
        Level(model=target, gamma=6, name="target"),
    ])
    return stack, target


def test_tune_sets_the_chosen_gammas_on_the_levels_and_stays_lossless(monkeypatch) -> None:
    stack, target = _three_levels()
    seen = []

    def fake_costs(level, context, most, repeats, seed):
        seen.append((level.lm.stats.name, context, most))
        return {t: (0.1 if level.lm.stats.name == "middle" else 1.0) for t in range(1, most + 1)}

    monkeypatch.setattr(autotune, "_verify_costs", fake_costs)
    prompt = list(range(1, 12))
    tuning = autotune.tune(stack, prompt, calibration_tokens=24, max_gamma=5)
    levels = autotune.verifying_levels(stack)
    assert [level.lm.stats.name for level in levels] == ["middle", "target"]
    assert seen == [("middle", len(prompt), 6), ("target", len(prompt), 6)]
    assert tuning.before == (2, 6)
    assert tuning.gammas == tuple(level.gamma for level in levels)
    assert all(1 <= g <= 5 for g in tuning.gammas)
    assert 0 < tuning.acceptances[0] <= 1 and 0 < tuning.acceptances[1] <= 1
    expected, speedup = autotune.best_gammas(tuning.draft_cost, tuning.verify_costs, tuning.acceptances, 1.0, 5)
    assert tuning.gammas == expected and tuning.predicted_speedup == pytest.approx(speedup)
    assert "gamma=auto chose" in tuning.describe()
    result = stack.generate(prompt, 30)
    assert list(result.tokens) == greedy_decode(target, prompt, 30)


def test_tune_measures_real_forward_costs_for_each_level() -> None:
    stack, _ = _three_levels()
    tuning = autotune.tune(stack, list(range(1, 12)), calibration_tokens=8, max_gamma=3, repeats=1)
    assert [sorted(costs) for costs in tuning.verify_costs] == [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert all(seconds > 0 for costs in tuning.verify_costs for seconds in costs.values())
    assert tuning.draft_cost > autotune.MODEL_FREE_DRAFT_COST


def test_autoregressive_stack_cannot_be_tuned() -> None:
    target = SyntheticLM(vocab_size=8, seed=1)
    stack = SpeculationStack.build([Level(model=target)])
    with pytest.raises(SpecstackError, match="gamma=auto needs a stack with at least one verifying level"):
        autotune.tune(stack, [1, 2, 3])


def test_a_level_verifying_a_tree_keeps_its_depth() -> None:
    """A tree's nodes are not a chain's tokens: tuning its depth by a chain's per-token acceptance cut
    Medusa's trees to depth 1 (the demo measured it). Its level keeps γ; the chain levels are tuned."""
    from specstack import Registry
    from specstack_medusa.heads import synthetic_heads

    target = SyntheticLM(vocab_size=16, seed=2, sharpness=2.0)
    stack = Registry.create().stack("medusa", target=target, heads=synthetic_heads(16, token_input=True))
    depth = autotune.verifying_levels(stack)[0].gamma
    tuning = autotune.tune(stack, list(range(1, 12)), calibration_tokens=8, max_gamma=2, repeats=1)
    assert tuning.gammas == (depth,) == tuple(level.gamma for level in autotune.verifying_levels(stack)) and depth > 2
    assert autotune.best_gammas(1e-6, [{t: 1.0 for t in range(1, 8)}] * 2, (0.9, 0.9), 1.0, 3, fixed=(None, 6))[0][1] == 6
