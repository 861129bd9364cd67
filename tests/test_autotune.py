"""gamma=auto: the γ chosen from measured costs and acceptance (specstack.autotune)."""

from __future__ import annotations

import itertools

import attrs
import pytest

from specstack import Level, SpeculationStack
from specstack import autotune
from specstack.errors import SpecstackError
from specstack.speedup import LevelCost, StackCost
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


def test_a_lower_gamma_never_exceeds_the_one_it_drafts_for() -> None:
    """A middle level as cheap at any width (a model-free draft below it), a full cache dear from three tokens
    (ms, as measured at 32K): the middle level is asked for γ2 tokens a round, so a γ1 above γ2 is never drafted
    as such and is priced as γ1 = γ2 (the old per-token formula priced it as if every token it emitted were used,
    and preferred a long γ1 under γ2 = 1); the choice keeps the shorter."""
    middle = {t: 10.7 for t in range(1, 10)}
    top = {1: 37.4, 2: 43.7, 3: 67.3, 4: 76.5, 5: 87.0, 6: 97.4, 7: 107.2, 8: 109.6, 9: 117.4}
    gammas, speedup = autotune.best_gammas(0.01, [middle, top], [0.46, 0.83], 37.4, max_gamma=8)
    assert gammas[0] <= gammas[1]

    def predicted(g1: int, g2: int) -> float:
        return StackCost(draft_cost=0.01, autoregressive_cost=37.4, levels=[
            LevelCost(acceptance=a, gamma=g, verify_cost=c[g + 1], forward_costs=c) for a, g, c in zip([0.46, 0.83], (g1, g2), [middle, top])]).speedup

    for g1, g2 in itertools.product(range(1, 9), repeat=2):
        assert predicted(g1, g2) == pytest.approx(predicted(min(g1, g2), g2), rel=1e-12)


def test_a_middle_level_under_gamma_one_supplies_one_token_a_round_whatever_its_acceptance() -> None:
    """Under a top level with γ2 = 1 each middle round drafts one token and hands up one, so its acceptance
    buys nothing: the prediction is the same at β = 0 and β = 1 (per emitted token it would differ 2x)."""
    def predicted(beta: float) -> float:
        return StackCost(draft_cost=1.0, autoregressive_cost=20.0, levels=[LevelCost(acceptance=beta, gamma=3, verify_cost=5.0),
                                                                           LevelCost(acceptance=0.8, gamma=1, verify_cost=22.0)]).speedup
    assert predicted(0.0) == pytest.approx(predicted(1.0))
    assert predicted(1.0) == pytest.approx(20.0 / ((1.0 + 5.0 + 22.0) / 1.8))  # one draft, one middle forward, the top's forward; E(0.8, 1) = 1.8


def test_a_middle_levels_supply_by_hand() -> None:
    """S(2) for γ = 2, β = 0.5, t_0 = 1, forwards of 10: a round of two drafts (12) emits one token with
    chance 0.5, after which a round of one draft (11) supplies the other: 12 + 0.5 · 11 = 17.5."""
    from specstack.speedup import drafted_at

    level = LevelCost(acceptance=0.5, gamma=2, verify_cost=10.0)
    assert level.supply(2, drafted_at(1.0)) == pytest.approx(17.5)
    assert level.supply(1, drafted_at(1.0)) == pytest.approx(11.0)  # one token wanted: one draft, whatever is accepted
    assert LevelCost(acceptance=0.5, gamma=2, verify_cost=10.0, forward_costs={2: 4.0}).supply(1, drafted_at(1.0)) == pytest.approx(5.0)


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

    def fake_costs(level, context, widths, repeats, seed):
        seen.append((level.lm.stats.name, context, widths))
        return {t: (0.1 if level.lm.stats.name == "middle" else 1.0) for t in widths}

    monkeypatch.setattr(autotune, "_verify_costs", fake_costs)
    prompt = list(range(1, 12))
    tuning = autotune.tune(stack, prompt, calibration_tokens=24, max_gamma=5)
    levels = autotune.verifying_levels(stack)
    assert [level.lm.stats.name for level in levels] == ["middle", "target"]
    assert seen == [("middle", len(prompt), (1, 2, 3, 4, 5, 6)), ("target", len(prompt), (1, 2, 3, 4, 5, 6))]
    assert tuning.before == (2, 6)
    assert tuning.gammas == tuple(level.gamma for level in levels)
    assert all(1 <= g <= 5 for g in tuning.gammas)
    assert 0 < tuning.acceptances[0] <= 1 and 0 < tuning.acceptances[1] <= 1
    assert len(tuning.overheads) == 2 and all(o > 0 for o in tuning.overheads)  # each round's sampling and verification, measured
    assert tuning.autoregressive_overhead > 0 and tuning.autoregressive_cost == 1.0 + tuning.autoregressive_overhead  # its forward, and its step's sampling
    expected, speedup = autotune.best_gammas(tuning.draft_cost, tuning.verify_costs, tuning.acceptances, tuning.autoregressive_cost, 5, overheads=tuning.overheads)
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


def _medusa(tree_size: int = 4, **options):
    from specstack import Registry
    from specstack_medusa.heads import synthetic_heads

    target = SyntheticLM(vocab_size=16, seed=2, sharpness=2.0)
    return Registry.create().stack("medusa", target=target, heads=synthetic_heads(16, token_input=True), tree_size=tree_size, **options)


def test_a_level_verifying_a_tree_keeps_its_depth() -> None:
    """A tree's nodes are not a chain's tokens: tuning its depth by a chain's per-token acceptance cut
    Medusa's trees to depth 1 (the demo measured it). Its level keeps γ; the chain levels are tuned."""
    stack = _medusa()
    depth = autotune.verifying_levels(stack)[0].gamma
    tuning = autotune.tune(stack, list(range(1, 12)), calibration_tokens=8, max_gamma=2, repeats=1)
    assert tuning.gammas == (depth,) == tuple(level.gamma for level in autotune.verifying_levels(stack)) and depth > 2
    tree = autotune.TreeRound(depth=6, emitted=2.0, width=9)
    assert autotune.best_gammas(1e-6, [{t: 1.0 for t in range(1, 10)}] * 2, (0.9, 0.9), 1.0, 3, fixed=(None, tree))[0][1] == 6


def test_a_tree_level_is_priced_by_what_its_calibration_rounds_emitted_and_fed(monkeypatch) -> None:
    """The tree level's round: the tokens its calibration rounds emitted on average, over one forward as
    wide as its forwards fed on average, timed as a tree (a chain of its depth priced Medusa's trees at
    0.50-0.71x where they ran 1.11-2.09x)."""
    stack = _medusa(tree_size=8, min_prob=0.0)  # every node kept: a tree wider than a chain of its depth
    timed = []

    def fake_costs(level, context, widths, repeats, seed):
        timed.append(widths)
        return {t: 1.0 + 0.1 * t for t in widths}

    calibrations = []
    generate = SpeculationStack.generate
    monkeypatch.setattr(SpeculationStack, "generate", lambda *args, **kw: calibrations.append(generate(*args, **kw)) or calibrations[-1])
    monkeypatch.setattr(autotune, "_verify_costs", fake_costs)
    tuning = autotune.tune(stack, list(range(1, 12)), calibration_tokens=24, max_gamma=2)
    stats = calibrations[0].levels[-1]  # the target level's counters over the calibration's decoding
    (tree,) = tuning.fixed
    assert tree.emitted == pytest.approx(stats.emitted / stats.rounds) and tree.emitted > 1
    assert tree.width == round(stats.forward_tokens / stats.forward_calls) > tree.depth + 1  # its nodes and the token before them
    assert timed == [tuple(sorted({1, 2, 3, tree.width}))]  # 1 … max_gamma + 1 tokens for the drafter's prices, and the tree's width
    (overhead,) = tuning.overheads
    assert 0 < overhead < 3 * stats.bookkeeping_seconds / stats.rounds
    round_seconds = tree.depth * tuning.draft_cost + (1.0 + 0.1 * tree.width) + overhead
    assert tuning.predicted_speedup == pytest.approx((1.1 + tuning.autoregressive_overhead) / (round_seconds / tree.emitted))


def test_measured_level_cost_prices_a_round_from_its_measured_output() -> None:
    from specstack.speedup import MeasuredLevelCost, StackCost, drafted_at

    level = MeasuredLevelCost(emitted=2.5, drafts=3, verify_cost=2.0)
    assert level.time_per_token(drafted_at(0.5)) == pytest.approx((3 * 0.5 + 2.0) / 2.5)
    assert level.supply(5, drafted_at(0.5)) == pytest.approx(2 * (3 * 0.5 + 2.0))  # five tokens: two rounds of 2.5
    assert level.supply(1, drafted_at(0.5)) == pytest.approx(3 * 0.5 + 2.0)  # one token still takes a whole round
    assert StackCost(draft_cost=0.5, levels=[level], autoregressive_cost=1.0).speedup == pytest.approx(2.5 / 3.5)
    with pytest.raises(SpecstackError, match="emitted 0.5 is not allowed; a round emits at least 1 token"):
        MeasuredLevelCost(emitted=0.5, drafts=3, verify_cost=2.0)


def test_the_description_says_when_no_gamma_is_predicted_to_win() -> None:
    """A choice predicted slower than autoregressive decoding is still the best one, and the line says so; where a
    level verifies a tree, the line says what its rounds emitted and how wide its forwards were."""
    winning, losing = _tuning(1, acceptances=(0.9,)), attrs.evolve(_tuning(1, acceptances=(0.1,)), predicted_speedup=0.42)
    assert "predicted 1.00x" in winning.describe() and "no γ" not in winning.describe()
    assert losing.describe().endswith("predicted 0.42x); no γ up to 6 is predicted to beat autoregressive decoding at this acceptance and these forward costs")
    tree = attrs.evolve(winning, fixed=(autotune.TreeRound(depth=6, emitted=3.25, width=9),))
    assert tree.describe().endswith("calibration tokens; γ1 kept: a tree emitting 3.25 tokens a round, forwards of 9 tokens; predicted 1.00x)")
    assert "over 8 calibration tokens, a round's bookkeeping 1.5 ms; predicted" in attrs.evolve(winning, overheads=(0.0015,)).describe()


def _tuning(levels: int, *, acceptances: tuple[float, ...], max_gamma: int = 6) -> autotune.Tuning:
    """Costs that make γ follow acceptance: every forward costs 1, whatever its width, and drafting is cheap."""
    flat = {t: 1.0 for t in range(1, max_gamma + 2)}
    return autotune.Tuning(gammas=(1,) * levels, before=(1,) * levels, acceptances=acceptances, draft_cost=0.01,
                           verify_costs=(flat,) * levels, predicted_speedup=1.0, calibration_tokens=8, max_gamma=max_gamma,
                           fixed=(None,) * levels)


def _two_levels(sampling=None, seed: int = 1) -> tuple[SpeculationStack, SyntheticLM]:
    from specstack import SamplingConfig

    target = SyntheticLM(vocab_size=4, seed=seed, sharpness=1.5)
    draft = SyntheticLM(vocab_size=4, seed=seed + 1, base=target, noise=1.0)
    stack = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=1)], sampling=sampling or SamplingConfig(), seed=seed)
    return stack, target


def test_the_retuner_follows_the_acceptance_of_the_last_rounds() -> None:
    """Counts written into the level's stats stand for rounds: a run of accepted tokens lengthens γ,
    a run of rejections shortens it, and the calibration's estimate weighs like ``every`` tokens."""
    stack, _ = _two_levels()
    retuner = autotune.Retuner.follow(stack, _tuning(1, acceptances=(0.3,)), every=4, memory=0.5)
    (level,) = autotune.verifying_levels(stack)
    stats = level.lm.stats
    retuner(3)  # before `every` tokens: nothing is chosen
    assert level.gamma == 1 and retuner.history == []
    stats.accepted += 40  # 40 tokens examined, all accepted: α = (0.5 · 1.2 + 40) / (0.5 · 4 + 40) = 0.97
    retuner(4)
    high = level.gamma
    assert high == autotune.best_gammas(0.01, [{t: 1.0 for t in range(1, 8)}], [40.6 / 42], 1.0, 6)[0][0] > 1
    assert retuner.history == [(4, (high,))]
    stats.rejected += 40  # 40 rejections: α falls to 20.3 / 61 = 0.33
    retuner(6)  # the next choice is due at 8 tokens
    assert level.gamma == high
    retuner(8)
    assert level.gamma < high and retuner.history[-1] == (8, (level.gamma,))


def test_a_tuning_sets_its_choice_again_on_a_stack_a_retuner_moved() -> None:
    """A generation after a retuned one (``specstack demo --repeats``) starts from the tuner's choice, not from where
    the retuner left γ."""
    stack, _ = _two_levels()
    tuning = attrs.evolve(_tuning(1, acceptances=(0.3,)), gammas=(2,))
    (level,) = autotune.verifying_levels(stack)
    level.gamma = 5  # where a retuner left it
    tuning.apply(stack)
    assert level.gamma == 2


def test_the_median_speedup_over_turns() -> None:
    from specstack.speedup import median_speedup

    assert median_speedup([1.3, 0.9, 1.1]) == 1.1 and median_speedup([1.0, 2.0]) == 1.5
    assert median_speedup([None, 1.2, None]) == 1.2 and median_speedup([None]) is None


def test_a_retuned_stack_decodes_greedily_as_the_target() -> None:
    """γ changes between the rounds of one generation (every round, no memory) and the output is
    still the target's greedy decoding, over three levels with a StreamingLLM draft."""
    stack, target = _three_levels()
    prompt = list(range(1, 12))
    retuner = autotune.Retuner.follow(stack, _tuning(2, acceptances=(0.5, 0.5)), every=1, memory=0.0)
    result = stack.generate(prompt, 40, after_round=retuner)
    assert len({gammas for _, gammas in retuner.history}) >= 2  # γ really moved
    assert list(result.tokens) == greedy_decode(target, prompt, 40)


def test_a_retuned_stack_samples_from_the_target() -> None:
    """Sampled at T = 1 with γ re-chosen after every round: chi-square against the exact distribution
    of 3-token continuations (the method of test_distribution.py)."""
    from specstack import SamplingConfig
    from specstack.synthetic import sequence_probabilities
    from specstack.testing import ALPHA, SAMPLES, chi_square_pvalue

    sampling = SamplingConfig(temperature=1.0)
    stack, target = _two_levels(sampling, seed=3)
    drawn, moved = [], set()
    for _ in range(SAMPLES):
        retuner = autotune.Retuner.follow(stack, _tuning(1, acceptances=(0.5,), max_gamma=3), every=1, memory=0.0)
        drawn.append(stack.generate([1, 2], 3, after_round=retuner).tokens)
        moved.update(gammas for _, gammas in retuner.history)
    assert len(moved) >= 2
    assert chi_square_pvalue(drawn, sequence_probabilities(target, [1, 2], 3, sampling)) > ALPHA


@pytest.mark.parametrize("bad, message", [({"every": 0}, "every 0 is not allowed"), ({"memory": 1.0}, "memory 1.0 is not allowed")])
def test_retuner_settings_are_checked(bad: dict, message: str) -> None:
    stack, _ = _two_levels()
    with pytest.raises(SpecstackError, match=message):
        autotune.Retuner.follow(stack, _tuning(1, acceptances=(0.5,)), **bad)
    with pytest.raises(SpecstackError, match="this tuning has 2 verifying levels but the stack has 1"):
        autotune.Retuner.follow(stack, _tuning(2, acceptances=(0.5, 0.5)))


@pytest.mark.parametrize("options, rest, mode", [
    (["budget=512", "gamma=auto"], ["budget=512"], "auto"),
    (["gamma1=adaptive", "gamma2=auto"], [], "adaptive"),
    (["gamma-2=adaptive", "gamma1=3"], ["gamma1=3"], "adaptive"),
    (["gamma=4"], ["gamma=4"], None),
])
def test_gamma_options_ask_for_a_tuning(options: list[str], rest: list[str], mode: str | None) -> None:
    assert autotune.auto_options(options) == (rest, mode)


def test_adaptive_tuning_hands_back_a_retuner_and_auto_does_not(monkeypatch) -> None:
    monkeypatch.setattr(autotune, "_verify_costs", lambda level, context, widths, repeats, seed: {t: 1.0 for t in widths})
    stack, _ = _three_levels()
    prompt = list(range(1, 12))
    assert autotune.tuned(stack, prompt, "auto", calibration_tokens=8)[1] is None
    tuning, retuner = autotune.tuned(stack, prompt, "adaptive", calibration_tokens=8)
    assert isinstance(retuner, autotune.Retuner) and retuner.tuning is tuning
    assert retuner.describe() == "gamma=adaptive kept them during decoding"
    with pytest.raises(SpecstackError, match="gamma='sometimes' is not allowed; use an integer >= 1, auto or adaptive"):
        autotune.tuned(stack, prompt, "sometimes")


def test_best_length_matches_the_hand_computed_optimum() -> None:
    """(1 + Σ Π a) / c_j: acceptance 0.9 then 0.5 at costs 1, 1.3, 2.0 -> one token (1.46 a second against 1.0 and
    1.175); every token where forwards cost the same and drafts are accepted; none where a second token costs much
    and is rarely accepted."""
    from specstack.speedup import best_length

    assert best_length([0.9, 0.5], [1.0, 1.3, 2.0]) == 1
    assert best_length([0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 1.0]) == 3
    assert best_length([0.2, 0.2], [1.0, 1.5, 2.0]) == 0
    assert best_length([0.9, 0.9, 0.9], [1.0, 1.1]) == 1  # no cost beyond a 2-token forward: no longer draft


def test_a_chains_ceiling_matches_the_hand_computed_optimum() -> None:
    """c_0 E(α, γ) / c_γ at its best γ: acceptance 0.9 at costs 1, 1.2, 1.5, 2.0 -> γ 2 (2.71 / 1.5 = 1.807x against
    1.583x at γ 1 and 1.7195x at γ 3); forwards that cost the same -> the longest chain, and all of it emitted at
    α = 1; forwards that cost a step a token -> no draft pays (1x)."""
    from specstack.speedup import chain_ceiling

    speedup, gamma = chain_ceiling(0.9, [1.0, 1.2, 1.5, 2.0])
    assert gamma == 2 and speedup == pytest.approx(2.71 / 1.5)
    assert chain_ceiling(1.0, [1.0, 1.0, 1.0, 1.0]) == (4.0, 3)
    assert chain_ceiling(0.5, [2.0, 2.0, 2.0, 2.0]) == (pytest.approx(1.875), 3)
    assert chain_ceiling(0.9, [1.0, 2.0, 3.0]) == (1.0, 0)


def test_best_count_takes_the_nodes_in_their_order_as_many_as_pay() -> None:
    """(1 + Σ_{i<m} r_i) / c_m over the nodes' own chances of acceptance: 0.9, 0.5, 0.1 at costs 1, 1.1, 1.5, 2.0 ->
    one node (1.73 a second against 1.0, 1.6 and 1.25); all where forwards cost the same; best_length is the same
    figure over a chain's running products."""
    from specstack.speedup import best_count, best_length

    assert best_count([0.9, 0.5, 0.1], [1.0, 1.1, 1.5, 2.0]) == 1
    assert best_count([0.9, 0.5, 0.1], [1.0, 1.0, 1.0, 1.0]) == 3
    assert best_count([0.9, 0.5, 0.1], [1.0, 2.0]) == 0
    assert best_count([0.9, 0.45], [1.0, 1.1, 1.3]) == best_length([0.9, 0.5], [1.0, 1.1, 1.3]) == 2


def follow(lookup, text: list[int], written: list[int]) -> int:
    """A round of a priced lookup: how many tokens it drafts after ``text``, the level above then writing ``written``
    (read at the next round, which is drafted after ``text + written``)."""
    drafted = len(lookup.propose(text, 3).tokens)
    lookup.propose(text + written, 3)
    return drafted


def test_a_priced_prompt_lookup_drafts_what_pays_for_each_match_length() -> None:
    """After rounds in which the text went on as every 3-token match had and left every 1-token match at once, at costs
    where a second token costs 0.3 of a step: it drafts every matched token after a 3-token match, none after a 1-token
    match; unpriced, it drafts all after both. Fails where the text written after a draft is not learnt from (the
    verdicts alone: none are given here), or where the length is not chosen per match length."""
    from specstack.drafters import PromptLookupDrafter

    long_match = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # suffix 1 2 3 occurred before: proposes 4 5 6 7 ...
    short_match = [9, 8, 7, 6, 5, 0, 11, 12, 13, 14, 9]  # suffix 9 occurred before (no longer suffix did): proposes 8 7 6
    lookup = PromptLookupDrafter(vocab=16)
    assert [len(lookup.propose(p, 3).tokens) for p in (long_match, short_match)] == [3, 3]
    assert lookup.price([1.0, 1.3, 1.6, 1.9])
    for _ in range(30):
        follow(lookup, long_match, [4, 5, 6, 7])
        follow(lookup, short_match, [15])
    assert len(lookup.propose(long_match, 3).tokens) == 3
    assert len(lookup.propose(short_match, 3).tokens) == 0


def test_a_priced_prompt_lookup_measures_a_priced_out_match_length_against_the_text() -> None:
    """At costs where the prior chance of 0.5 does not pay (a 2-token forward costing 1.6 steps), a match length whose
    matches the text leaves drafts nothing, round after round, yet goes on being measured against the text: once the
    text goes on as its matches did, it is drafted again, all three tokens. Fails where a priced-out length is retried
    blindly (its first position drifting up until it is drafted again, as before: within 50 rounds here), and where
    it learns only from the verdicts on its own drafts (then it never drafts again: seen in a greedy generation of the
    Bible at 7,500 tokens, 1.15 tokens a target forward against 1.9-2.2 in runs that escaped it)."""
    from specstack.drafters import PromptLookupDrafter

    match = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    lookup = PromptLookupDrafter(vocab=16)
    lookup.price([1.0, 1.6, 2.0, 2.4])
    left = [follow(lookup, match, [9]) for _ in range(50)]
    followed = [follow(lookup, match, [4, 5, 6, 7]) for _ in range(25)]
    assert max(left) == 0 and followed[0] == 0 and followed[-1] == 3


def test_a_shown_continuation_is_read_until_the_text_decides_it() -> None:
    """A lookup's continuation is folded into its key's chances once the text written after it, over as many rounds as
    it takes, leaves it (its positions up to the miss), runs its length (all hits), or is rolled back into it (what it
    had followed: hits); a continuation the text is still following waits. Fails where the first reading after a draft
    decides it (the three hits of 'a' below would be one), where a rolled-back continuation is kept waiting (they would
    pile up, one a round), and where one shown twice at the same text is read twice."""
    import numpy as np

    from specstack.drafters import ACCEPTANCE_PRIOR, ACCEPTANCE_WEIGHT, LookupChances

    def after(*folds: list[bool]) -> list[float]:  # the chances folding these outcomes (one list a continuation) into the prior gives
        rates = [ACCEPTANCE_PRIOR]
        for hits in folds:
            for i, hit in enumerate(hits):
                rates += [rates[-1]] if i == len(rates) else []
                rates[i] += ACCEPTANCE_WEIGHT * (hit - rates[i])
        return rates

    shown = LookupChances()
    rates = shown.rates  # key -> the chance at each position
    shown.show("a", [1, 2, 3], at=2)
    shown.read(np.array([9, 9, 1]), unchanged=2)
    assert rates == {}  # followed one token of three: undecided
    shown.show("b", [4, 5], at=3)
    shown.read(np.array([9, 9, 1, 2, 3, 4, 7]), unchanged=3)
    assert rates == {"a": after([True, True, True]), "b": after([False])}  # 'b' at 3 against 2: left at once
    shown.show("c", [6, 7, 8], at=7)
    shown.read(np.array([9, 9, 1, 2, 3, 4, 7, 6, 7]), unchanged=7)
    assert "c" not in rates
    shown.read(np.array([9, 9, 1, 2, 3, 4, 7]), unchanged=7)  # rolled back into 'c' (a rejection above)
    assert rates["c"] == after([True, True])
    for _ in range(3):  # the same again and again: each decided at its rollback, none left waiting
        shown.show("d", [6, 5], at=7)
        shown.read(np.array([9, 9, 1, 2, 3, 4, 7, 6]), unchanged=7)
        shown.read(np.array([9, 9, 1, 2, 3, 4, 7]), unchanged=7)
    assert rates["d"] == after([True], [True], [True]) and shown._pending == []
    shown.show("e", [5], at=7)
    shown.show("e", [5], at=7)  # asked twice at the same text: read once
    shown.read(np.array([9, 9, 1, 2, 3, 4, 7, 5]), unchanged=7)
    assert rates["e"] == after([True])


def test_gamma_auto_prices_a_prompt_lookup_and_stays_lossless(monkeypatch) -> None:
    """gamma=auto tells prompt lookup the target's forward costs: the level's γ becomes max_gamma (a cap), the
    description says who chooses the lengths, and the output is still the target's greedy decoding."""
    from specstack.drafters import PromptLookupDrafter

    target = SyntheticLM(vocab_size=8, seed=1)
    stack = SpeculationStack.build([Level(drafter=PromptLookupDrafter(vocab=8)), Level(model=target, gamma=4)])
    monkeypatch.setattr(autotune, "_verify_costs", lambda level, context, widths, repeats, seed: {t: 1.0 + 0.3 * (t - 1) for t in widths})
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    tuning = autotune.tune(stack, prompt, calibration_tokens=8, max_gamma=5)
    assert tuning.priced and tuning.gammas == (5,) and autotune.verifying_levels(stack)[0].gamma == 5
    assert "level 0 chooses each draft's length" in tuning.describe() and "no γ up to" not in tuning.describe()
    assert list(stack.generate(prompt, 30).tokens) == greedy_decode(target, prompt, 30)


def test_a_priced_prompt_lookup_samples_from_the_target() -> None:
    """Sampled at T = 1 with prompt lookup choosing each draft's length from what earlier rounds accepted: chi-square
    against the exact distribution of 3-token continuations of a prompt that repeats (so that it drafts)."""
    from specstack import SamplingConfig
    from specstack.drafters import PromptLookupDrafter
    from specstack.synthetic import sequence_probabilities
    from specstack.testing import ALPHA, SAMPLES, chi_square_pvalue

    sampling = SamplingConfig(temperature=1.0)
    target = SyntheticLM(vocab_size=4, seed=3)
    lookup = PromptLookupDrafter(vocab=4)
    stack = SpeculationStack.build([Level(drafter=lookup), Level(model=target, gamma=3)], sampling=sampling, seed=5)
    lookup.price([1.0, 1.2, 1.5, 1.9])
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    drawn = [stack.generate(prompt, 3, reuse_cache=True).tokens for _ in range(SAMPLES)]
    assert lookup.stats.drafted > 0
    assert chi_square_pvalue(drawn, sequence_probabilities(target, prompt, 3, sampling)) > ALPHA


def _idle_draft_stack(sampling=None, gamma1: int = 0) -> tuple[SpeculationStack, SyntheticLM]:
    """Three levels whose middle one drafts nothing (γ1 = 0, unless asked otherwise): it decodes alone."""
    from specstack import SamplingConfig

    target = SyntheticLM(vocab_size=5, seed=4, sharpness=1.5)
    middle = SyntheticLM(vocab_size=5, seed=5, base=target, noise=0.5)
    small = SyntheticLM(vocab_size=5, seed=6, base=target, noise=1.0)
    stack = SpeculationStack.build([Level(model=small, name="draft"), Level(model=middle, gamma=gamma1, name="middle"),
                                    Level(model=target, gamma=3, name="target")], sampling=sampling or SamplingConfig(), seed=2)
    return stack, target


def test_a_middle_level_with_gamma_zero_decodes_alone_and_the_stack_stays_greedy() -> None:
    stack, target = _idle_draft_stack()
    result = stack.generate([1, 2, 3], 30)
    assert list(result.tokens) == greedy_decode(target, [1, 2, 3], 30)
    draft, middle, top = result.levels
    assert draft.forward_calls == 0 and middle.drafted == 0  # the draft never ran, the middle level verified nothing
    assert middle.rounds == middle.emitted == middle.forward_calls  # one forward, one token a round
    assert top.drafted == middle.emitted  # rounds of one token leave no surplus: every token it emitted went up


def test_a_middle_level_with_gamma_zero_samples_from_the_target() -> None:
    """T = 1: chi-square against the exact distribution of 3-token continuations (test_distribution.py's method)."""
    from specstack import SamplingConfig
    from specstack.testing import ALPHA, stack_pvalue

    sampling = SamplingConfig(temperature=1.0)
    stack, target = _idle_draft_stack(sampling)
    assert stack_pvalue(stack, target, sampling, [1, 2], length=3) > ALPHA


def test_a_dear_draft_is_left_idle() -> None:
    """The middle level's one-token forward costs 10, the draft 6 a token and it is accepted 0.3: a round of one
    drafted token supplies one token for 6 + 10.5 = 16.5 against 10 alone, so γ1 = 0 (predicted by hand: a top
    round of γ2 = 1 is 10 + 22 over E(0.8, 1) = 1.8 tokens, 20 / 17.78 = 1.125). A cheap draft is used."""
    middle = {t: 10.0 + 0.5 * (t - 1) for t in range(1, 10)}
    top = {t: 20.0 + 2.0 * (t - 1) for t in range(1, 10)}
    gammas, speedup = autotune.best_gammas(6.0, [middle, top], [0.3, 0.8], 20.0, max_gamma=8)
    assert gammas == (0, 1) and speedup == pytest.approx(20.0 / ((10.0 + 22.0) / 1.8))
    assert autotune.best_gammas(0.1, [middle, top], [0.9, 0.8], 20.0, max_gamma=8)[0][0] >= 1
    assert "; γ1=0: level 1 decodes alone, level 0 idles; predicted" in attrs.evolve(_tuning(2, acceptances=(0.3, 0.8)), gammas=(0, 1)).describe()


def test_a_level_at_gamma_zero_is_calibrated_drafting(monkeypatch) -> None:
    """With γ1 = 0 the middle level drafts nothing, so the calibration runs it at γ1 = 1 to measure its acceptance."""
    stack, _ = _idle_draft_stack()
    monkeypatch.setattr(autotune, "_verify_costs", lambda level, context, widths, repeats, seed: {t: 1.0 + 0.1 * t for t in widths})
    tuning = autotune.tune(stack, [1, 2, 3], calibration_tokens=16, max_gamma=3)
    assert tuning.before == (0, 3) and tuning.acceptances[0] > 0


def _slowed(monkeypatch, obj, name: str, seconds: float) -> None:
    """Make ``obj.name`` (a method; ``obj``'s alone, though set on its class) sleep ``seconds`` before doing its work."""
    import time

    original = getattr(type(obj), name)

    def slowed(self, *args, **kw):
        if self is obj:
            time.sleep(seconds)
        return original(self, *args, **kw)

    monkeypatch.setattr(type(obj), name, slowed)


def test_each_level_counts_its_own_bookkeeping(monkeypatch) -> None:
    """A level's time outside forwards is its own: the middle level's slow verification shows in the middle level's
    bookkeeping, not the target's; the draft's slow sampling in the draft's bookkeeping, not the middle level's; the
    draft's slow forwards in its forward seconds, in no level's bookkeeping. Forwards and bookkeeping are disjoint
    parts of the generation's time. (Counting the level below as this level's bookkeeping, or a level's own
    forwards, fails it.)"""
    import time

    from specstack import drafters

    # seconds slept: long enough that each is well above the Python around it on a loaded host (with 2 ms of sampling,
    # four test workers on two cores once put 48 ms of the middle level's own work over the bound)
    verify, forward, sampling = 0.010, 0.008, 0.005
    stack, _ = _three_levels()
    middle, _ = autotune.verifying_levels(stack)
    draft = middle.drafter
    _slowed(monkeypatch, middle.verifier, "verify", verify)
    _slowed(monkeypatch, draft.lm.model, "forward", forward)
    argmax = drafters.first_argmax
    monkeypatch.setattr(drafters, "first_argmax", lambda *args, **kw: time.sleep(sampling) or argmax(*args, **kw))  # the draft's greedy sampling
    result = stack.generate(list(range(1, 12)), 24)
    low, mid, top = result.levels
    assert low.forward_seconds >= forward * low.forward_calls
    assert sampling * low.drafted <= low.bookkeeping_seconds < sampling * low.drafted + forward * low.forward_calls / 2
    assert verify * mid.rounds <= mid.bookkeeping_seconds < verify * mid.rounds + sampling * low.drafted / 2
    assert top.bookkeeping_seconds < verify * mid.rounds / 2  # the target's own sampling and verification only
    spent = sum(level.forward_seconds + level.bookkeeping_seconds for level in result.levels)
    assert spent <= result.seconds


def test_a_rounds_bookkeeping_is_priced_with_its_forward() -> None:
    """o is added to every round: by hand, t = (D(γ) + c(γ+1) + o) / E and S(1) = D(1) + c(2) + o + (1 − β) S(0)."""
    from specstack.speedup import drafted_at, expected_emitted

    top = LevelCost(acceptance=0.5, gamma=2, verify_cost=1.0, round_overhead=0.5)
    assert top.time_per_token(drafted_at(0.1)) == pytest.approx((0.2 + 1.0 + 0.5) / expected_emitted(0.5, 2))
    middle = LevelCost(acceptance=0.4, gamma=1, verify_cost=2.0, round_overhead=0.25)
    assert middle.supply(1, drafted_at(0.1)) == pytest.approx(0.1 + 2.0 + 0.25)
    with pytest.raises(SpecstackError, match=r"round_overhead -0.1 is not allowed; use a finite number of seconds >= 0"):
        LevelCost(acceptance=0.5, gamma=2, verify_cost=1.0, round_overhead=-0.1)


def test_a_dear_round_chooses_a_longer_draft() -> None:
    """Bookkeeping paid once a round makes rounds dear, so the tuner drafts more a round. By hand, forwards of
    1 + 0.3 T, α = 0.6, t_d = 0.05: with o = 0, t(1) = 1.65 / 1.6 = 1.031, t(2) = 2.0 / 1.96 = 1.020 (best),
    t(3) = 2.35 / 2.176 = 1.080; with o = 3, t(2) = 5.0 / 1.96 = 2.551, t(3) = 5.35 / 2.176 = 2.459 (best),
    t(4) = 5.7 / 2.3056 = 2.472."""
    costs = {t: 1.0 + 0.3 * t for t in range(1, 10)}
    assert autotune.best_gammas(0.05, [costs], [0.6], 1.3, max_gamma=8)[0] == (2,)
    gammas, speedup = autotune.best_gammas(0.05, [costs], [0.6], 1.3, max_gamma=8, overheads=[3.0])
    assert gammas == (3,) and speedup == pytest.approx(1.3 / (5.35 / 2.176))


def test_a_rounds_bookkeeping_is_measured_after_the_first_step(monkeypatch) -> None:
    """One-time work in the calibration's first step (a new stack's first gather computes every chunk's mean key)
    is not a round's cost: a verifier whose first call sleeps 0.2 s leaves the measured bookkeeping a round well
    below it (averaged over every round, 24 tokens in at most 24 rounds, it would be at least 8 ms)."""
    import time

    stack, _ = _two_levels()
    (level,) = autotune.verifying_levels(stack)
    calls = []
    original = type(level.verifier).verify

    def first_slow(self, *args, **kw):
        if self is level.verifier and not calls:
            time.sleep(0.2)
        calls.append(1)
        return original(self, *args, **kw)

    monkeypatch.setattr(type(level.verifier), "verify", first_slow)
    monkeypatch.setattr(autotune, "_verify_costs", lambda level, context, widths, repeats, seed: {t: 1.0 + 0.1 * t for t in widths})
    tuning = autotune.tune(stack, [1, 2, 3], calibration_tokens=24, max_gamma=3)
    assert len(calls) > 2 and level.lm.stats.bookkeeping_seconds >= 0.2
    assert 0 < tuning.overheads[0] < 0.004


def _retrieval_stack() -> tuple[SpeculationStack, SyntheticLM]:
    """TriForce's shape on synthetic models: a draft, the target over a retrieval view, the target over its full cache."""
    from specstack.retrieval import Retrieval

    target = SyntheticLM(vocab_size=16, seed=1, sharpness=3.0)
    small = SyntheticLM(vocab_size=16, seed=3, base=target, noise=0.8)
    stack = SpeculationStack.build([
        Level(model=small, policy=StreamingLLM(sinks=2, window=8), name="draft"),
        Level(model=target, policy=Retrieval(budget=32, chunk_size=8, stride=4, reserve=8), gamma=1, name="view"),
        Level(model=target, gamma=2, name="target"),
    ])
    return stack, target


def test_gathers_are_timed_apart_and_priced_per_token(monkeypatch) -> None:
    """A gathering level's re-gathers are timed as its own (``gather_seconds``), in no level's bookkeeping, and the
    tuner prices them per emitted token: they come every ``stride`` tokens whatever γ. With each gather slowed by
    150 ms, the calibration's gather cost a token is at least 150 ms over 8 tokens: a gather comes at the first
    full-cache round after ``stride`` (4) appended tokens, and a round of the calibration's γ2 = 2 emits at most 3.
    (Slowed by 30 ms, the two levels' own bookkeeping of 24 tokens, 0.12 s on a host running two test sessions at once,
    went over half the gathers' time.)"""
    from specstack.retrieval import Retrieval

    gather = 0.15  # seconds slept a gather: well above the levels' own Python on a loaded host
    stack, target = _retrieval_stack()
    _slowed(monkeypatch, stack.top.drafter.lm.policy, "gather_chunks", gather)
    prompt = list(range(1, 15)) * 4
    result = stack.generate(prompt, 24)
    _, view, top = result.levels
    assert view.gathers > 2 and view.gather_seconds >= gather * view.gathers
    assert view.bookkeeping_seconds + top.bookkeeping_seconds < gather * view.gathers / 2
    assert sum(level.forward_seconds + level.gather_seconds + level.bookkeeping_seconds for level in result.levels) <= result.seconds
    assert list(result.tokens) == greedy_decode(target, prompt, 24)
    monkeypatch.setattr(autotune, "_verify_costs", lambda level, context, widths, repeats, seed: {t: 0.01 for t in widths})
    tuning = autotune.tune(stack, prompt, calibration_tokens=24, max_gamma=3)
    assert gather / 8 <= tuning.gather_cost < gather * 2 and f"re-gathers {1e3 * tuning.gather_cost:.2f} ms a token" in tuning.describe()
    assert isinstance(stack.top.drafter.lm.policy, Retrieval)


def test_a_tokens_gathers_are_priced_by_hand() -> None:
    """t = t_n + g: one level, t_d = 0.1, forwards of 1, α = 0.5, γ = 2: t_n = 1.2 / 1.75; g = 0.25 a token."""
    from specstack.speedup import StackCost

    level = LevelCost(acceptance=0.5, gamma=2, verify_cost=1.0)
    cost = StackCost(draft_cost=0.1, levels=[level], autoregressive_cost=1.0, token_overhead=0.25)
    assert cost.speedup == pytest.approx(1.0 / (1.2 / 1.75 + 0.25))
    gammas, speedup = autotune.best_gammas(0.1, [{t: 1.0 for t in range(1, 10)}], [0.5], 1.0, max_gamma=8, gather_cost=0.25)
    assert gammas == (2,) and speedup == pytest.approx(cost.speedup)
    with pytest.raises(SpecstackError, match="token_overhead -1 is not allowed"):
        StackCost(draft_cost=0.1, levels=[level], autoregressive_cost=1.0, token_overhead=-1)


def test_an_autoregressive_steps_own_time_is_measured_in_place_and_priced(monkeypatch) -> None:
    """An autoregressive step costs its forward and its own work (sampling, the decoding loop): the tuner decodes a
    few tokens in place after the calibration and adds the time outside the forward to c_ar. With the target's
    logits() slowed by 20 ms outside its forward, that overhead is at least 20 ms and the prediction is
    (c(1) + o_ar) / t (fails when o_ar is left out of c_ar); the target's counters are left as the calibration
    left them (fails when those steps stay in them); the stack still decodes as the target."""
    stack, target = _two_levels()
    _slowed(monkeypatch, stack.top.lm, "logits", 0.02)
    monkeypatch.setattr(autotune, "_verify_costs", lambda level, context, widths, repeats, seed: {t: 0.05 + 0.01 * t for t in widths})
    after_calibration = []
    generate = SpeculationStack.generate
    monkeypatch.setattr(SpeculationStack, "generate",
                        lambda *args, **kw: (result := generate(*args, **kw), after_calibration.append(attrs.evolve(stack.top.lm.stats)))[0])
    prompt = [1, 2, 3, 0, 1]
    tuning = autotune.tune(stack, prompt, calibration_tokens=12, max_gamma=3)
    assert 0.02 <= tuning.autoregressive_overhead < 0.06
    assert stack.top.lm.stats == after_calibration[0]
    _, speedup = autotune.best_gammas(tuning.draft_cost, tuning.verify_costs, tuning.acceptances, 0.06 + tuning.autoregressive_overhead, 3,
                                      overheads=tuning.overheads, gather_cost=tuning.gather_cost)
    assert tuning.predicted_speedup == pytest.approx(speedup)
    assert f"an autoregressive step's own {1e3 * tuning.autoregressive_overhead:.2f} ms" in tuning.describe()
    assert list(stack.generate(prompt, 16).tokens) == greedy_decode(target, prompt, 16)


def test_a_drafting_models_sampling_is_priced_with_its_forward(monkeypatch) -> None:
    """t_d, a drafted token's cost, is the draft's forward and its own sampling (its bookkeeping a drafted token):
    with the draft's sampling slowed by 10 ms, t_d is at least that (its synthetic forward takes microseconds; fails
    when only the forward is priced)."""
    import time

    from specstack import drafters

    stack, _ = _two_levels()
    argmax = drafters.first_argmax
    monkeypatch.setattr(drafters, "first_argmax", lambda *args, **kw: time.sleep(0.01) or argmax(*args, **kw))
    monkeypatch.setattr(autotune, "_verify_costs", lambda level, context, widths, repeats, seed: {t: 0.05 + 0.01 * t for t in widths})
    tuning = autotune.tune(stack, [1, 2, 3, 0, 1], calibration_tokens=12, max_gamma=3)
    assert 0.01 <= tuning.draft_cost < 0.02


def test_the_autoregressive_steps_stay_inside_the_window(monkeypatch) -> None:
    """A calibration that ends at the target's window leaves no room for the in-place autoregressive steps: the tuner
    takes none (its overhead 0) instead of failing at the window; with three positions left it takes three."""
    from specstack import SamplingConfig

    monkeypatch.setattr(autotune, "_verify_costs", lambda level, context, widths, repeats, seed: {t: 0.05 + 0.01 * t for t in widths})
    for room, measured in ((0, False), (3, True)):
        target = SyntheticLM(vocab_size=4, seed=1, sharpness=1.5, max_length=40)
        draft = SyntheticLM(vocab_size=4, seed=2, base=target, noise=1.0, max_length=40)
        stack = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=1)], sampling=SamplingConfig(), seed=1)
        prompt = [1, 2, 3, 0] * 7  # 28 tokens
        tuning = autotune.tune(stack, prompt, calibration_tokens=40 - len(prompt) - room, max_gamma=2)
        assert (tuning.autoregressive_overhead > 0) == measured


def test_a_tunings_record_holds_what_its_prediction_is_priced_from() -> None:
    """``Tuning.as_dict`` (the demo's and bench's JSON) holds every measured term: the prediction recomputed from the
    record alone is the tuner's (fails when a term is left out of the record or the record's c_ar is not the one used)."""
    import json

    stack, _ = _three_levels()
    tuning = autotune.tune(stack, list(range(1, 12)), calibration_tokens=12, max_gamma=3, repeats=1)
    record = json.loads(json.dumps(tuning.as_dict()))
    costs = [{t: seconds for t, seconds in pairs} for pairs in record["forward_costs"]]
    assert record["autoregressive_cost"] == pytest.approx(costs[-1][1] + record["autoregressive_overhead"])
    gammas, speedup = autotune.best_gammas(record["draft_cost"], costs, record["acceptances"], record["autoregressive_cost"], 3,
                                           overheads=record["round_overheads"], gather_cost=record["gather_cost"])
    assert list(gammas) == record["gammas"] and speedup == pytest.approx(record["predicted_speedup"])
