"""`specstack demo` on the embedded default: TriForce and the fastest stack against autoregressive
decoding, γ tuned, with the exactness result of each (a short prompt, so that it runs in CI)."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from specstack.cli import main
from specstack.demo import DemoRow, _spec
from specstack.run import parse_options

pytestmark = pytest.mark.real_model


def _demo_json(capsys, threads: str, *extra: str) -> dict:
    assert main(["demo", "--prompt-tokens", "500", "--max-new-tokens", "12", "--threads", threads, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_demo_compares_triforce_and_the_fastest_stack_with_tuned_gammas(capsys, threads) -> None:
    record = _demo_json(capsys, threads)
    assert record["dtype"] == "float32" and record["prompt_tokens"] > 500
    again = record["baseline_again"]  # autoregressive decoding measured again after the stacks
    assert again["ms_per_token"] > 0 and again["drift"] == pytest.approx(record["autoregressive_ms_per_token"] / again["ms_per_token"])
    assert [row["stack"] for row in record["stacks"]] == ["triforce", "medusa-lookup"]
    for row in record["stacks"]:
        assert row["identical"] is True, row
        assert row["exactness"] == "identical to autoregressive decoding, token for token"
        assert row["speedup"] > 0 and row["tokens_per_target_forward"] >= 1
    triforce, merged = record["stacks"]
    assert set(triforce["acceptance"]) == {"target+retrieval", "target"}
    gamma1, gamma2 = triforce["tuning"]["gammas"]
    assert 0 <= gamma1 <= 8 and 1 <= gamma2 <= 8  # γ1 = 0: the retrieval level decodes alone
    assert (triforce["acceptance"]["target+retrieval"] is None) == (gamma1 == 0)  # it drafted nothing: no acceptance
    assert set(merged["acceptance"]) == {"target"}
    assert merged["tuning"]["gammas"] == [8]  # priced, the tree's depth is capped at γ_max (the chained head's five steps and the LM head: 6 deep)
    assert record["text"].strip()


def test_a_demo_stack_takes_its_own_options_after_the_shared_ones(capsys, tmp_path, threads) -> None:
    """``NAME:key=value`` gives one stack options the others do not take (triforce has no min_ngram), its own winning
    over ``-o``; a bad entry is a one-line error."""
    path = tmp_path / "prompt.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 60, encoding="utf-8")
    record = _demo_json(capsys, threads, "--prompt-file", str(path), "--stacks", "prompt-lookup:min_ngram=2,gamma=3", "prompt-lookup",
                        "--no-tune", "-o", "gamma=5")
    own, shared = record["stacks"]
    assert own["stack"] == "prompt-lookup:min_ngram=2,gamma=3" and shared["stack"] == "prompt-lookup"
    name, options = _spec("prompt-lookup:min_ngram=2,gamma=3", ["gamma=5"])
    assert name == "prompt-lookup" and parse_options(options) == {"gamma": 3, "min_ngram": 2}
    assert _spec("prompt-lookup", ["gamma=5"]) == ("prompt-lookup", ["gamma=5"])
    assert own["identical"] is True and shared["identical"] is True
    assert main(["demo", "--prompt-file", str(path), "--max-new-tokens", "4", "--stacks", "prompt-lookup:min_ngram", "--no-tune"]) == 2
    assert "min_ngram" in capsys.readouterr().err.strip().splitlines()[-1]


def test_demo_reads_a_prompt_file_and_keeps_default_gammas_without_tuning(capsys, tmp_path, threads) -> None:
    """The file's last --prompt-tokens tokens are the prompt; more than the file holds is a one-line error."""
    path = tmp_path / "prompt.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 60, encoding="utf-8")
    record = _demo_json(capsys, threads, "--prompt-file", str(path), "--stacks", "prompt-lookup", "--no-tune")
    assert record["prompt"] == str(path) and record["prompt_tokens"] == 500
    (row,) = record["stacks"]
    assert row["stack"] == "prompt-lookup" and row["tuning"] is None and row["identical"] is True
    assert main(["demo", "--prompt-file", str(path), "--prompt-tokens", "5000", "--max-new-tokens", "4", "--no-tune"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--prompt-tokens 5000 is more than the prompt's 601 tokens")


def test_demo_names_an_unknown_stack_in_one_line(capsys) -> None:
    """... after it has set torch's threads (``--threads``), which ``main`` gives back as it found them."""
    import torch

    before = torch.get_num_threads()
    other = str(before % 2 + 1)
    assert main(["demo", "--prompt-tokens", "300", "--max-new-tokens", "4", "--stacks", "no-such-stack", "--no-tune", "--threads", other]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specstack demo: error:") and "no-such-stack" in err[-1]
    assert torch.get_num_threads() == before


def test_demo_retunes_gamma_during_decoding_when_asked(capsys, threads) -> None:
    record = _demo_json(capsys, threads, "--stacks", "triforce-lookup", "-o", "gamma=adaptive")
    (row,) = record["stacks"]
    assert row["identical"] is True
    assert isinstance(row["tuning"]["retuned"], list) and "gamma=adaptive" in row["tuning"]["description"]
    assert all(len(gammas) == 2 for _, gammas in row["tuning"]["retuned"])


def test_demo_in_bf16_certifies_each_stack_against_one_replayed_reference(capsys, threads, monkeypatch) -> None:
    """bf16: each stack's output is identical or certified; the autoregressive reference is replayed (its prefill
    paid) at most once for all the stacks."""
    from specstack.testing import certificate

    made = []
    init = certificate.GreedyReference.__attrs_post_init__
    monkeypatch.setattr(certificate.GreedyReference, "__attrs_post_init__", lambda self: made.append(1) or init(self))
    record = _demo_json(capsys, threads, "--dtype", "bfloat16", "--max-new-tokens", "128", "--stacks", "prompt-lookup", "medusa-lookup", "--no-tune")  # both diverge on the AVX2 host
    assert record["dtype"] == "bfloat16" and len(record["stacks"]) == 2
    for row in record["stacks"]:
        assert row["exactness"] == "identical to autoregressive decoding, token for token" or "certificate holds" in row["exactness"], row
    certified = sum(row["identical"] is False for row in record["stacks"])
    assert len(made) == min(certified, 1)


def test_demo_times_the_autoregressive_reference_warm(capsys, threads, monkeypatch) -> None:
    """Before the reference's clock starts, every model the stacks decode with (the target, and the draft
    TriForce asks for) has decoded a few tokens of a short prompt, as ``specstack bench`` warms them: a
    model's first step makes its compiled layers' plan, which a timed run would otherwise pay."""
    from specstack.run import WARMUP_PROMPT
    from specstack.stack import SpeculationStack

    calls = []
    generate = SpeculationStack.generate
    monkeypatch.setattr(SpeculationStack, "generate", lambda self, prompt, *a, **k: calls.append((self.target, len(prompt))) or generate(self, prompt, *a, **k))
    _demo_json(capsys, threads, "--stacks", "triforce", "--no-tune")
    first_timed = next(i for i, (_, length) in enumerate(calls) if length > WARMUP_PROMPT)
    warmed = [model for model, length in calls[:first_timed]]
    assert calls[first_timed][0] in warmed and len({id(model) for model in warmed}) == 2  # the target and the draft


def test_demo_turns_measure_each_stack_against_its_own_turns_autoregressive_run(capsys, threads, monkeypatch) -> None:
    """``--repeats 3``: autoregressive decoding and every stack run three times in turn; a stack's speedup is the
    median of its three, each against the autoregressive run of its own turn (the clock is scripted: the host slows
    turn by turn, the stack always runs at half the time of the autoregressive run before it)."""
    from specstack.stack import SpeculationStack

    generate, turns = SpeculationStack.generate, {"auto": 0}

    def scripted(self, prompt, max_new_tokens, *args, **kwargs):
        result = generate(self, prompt, max_new_tokens, *args, **kwargs)
        if len(prompt) < 500 or max_new_tokens != 12:  # warm-up and calibration runs keep their own time
            return result
        autoregressive = self.depth == 1
        turns["auto"] += autoregressive
        return attrs.evolve(result, seconds=turns["auto"] * (1.0 if autoregressive else 0.5))

    monkeypatch.setattr(SpeculationStack, "generate", scripted)
    record = _demo_json(capsys, threads, "--stacks", "prompt-lookup", "--no-tune", "--repeats", "3")
    (row,) = record["stacks"]
    assert row["speedups"] == pytest.approx([2.0, 2.0, 2.0]) and row["speedup"] == pytest.approx(2.0) and row["identical"] is True
    assert turns["auto"] == 4  # three turns, then the drift check
    assert main(["demo", "--repeats", "0", "--no-tune"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--repeats '0' is not allowed; use an integer >= 1")


def test_the_demo_says_when_the_host_changed_speed_under_its_runs() -> None:
    """The baseline measured again: within 10% of its first speed it is reported plainly, beyond it the line says the
    speedups moved with the host."""
    from specstack.demo import BaselineDrift

    assert BaselineDrift(ms_per_token=40.0, drift=1.05).describe() == "40.0 ms/token measured again after the stacks (drift 1.05)"
    assert "changed speed by more than 10%" in BaselineDrift(ms_per_token=40.0, drift=1.28).describe()
    assert "changed speed by more than 10%" in BaselineDrift(ms_per_token=60.0, drift=0.85).describe()
    assert "each turn's speedups are against its own autoregressive run" in BaselineDrift(ms_per_token=60.0, drift=0.85).describe(turns=3)


def test_a_reduced_precision_difference_points_to_widen_bf16_unless_it_was_given() -> None:
    from types import SimpleNamespace

    from specstack.demo import _exactness
    from specstack.sampling import SamplingConfig

    for widened in (False, True):
        session = SimpleNamespace(dtype=torch.bfloat16, sampling=SamplingConfig(temperature=0.6, coupled=True), widen_bf16=widened)
        line = _exactness(session, None, identical=False, replay=None)
        assert line.startswith("coupled: differs") and ("--widen-bf16" in line) is not widened


def test_a_stack_line_says_whose_time_per_token_it_shows() -> None:
    """The speedup is the median of a stack's turns, its time per token, tokens per forward and acceptance the first
    turn's: with several turns the line says so, since the median's turn may be another (a first turn at 0.85x beside
    a median of 0.97x)."""
    row = DemoRow(stack="medusa-lookup", speedup=0.85, ms_per_token=22.0, acceptance={"target": 0.38, "draft": None},
                  tokens_per_target_forward=1.45, exactness="identical", identical=True, tuning=None)
    assert row.describe() == ("medusa-lookup: 0.85x (22.0 ms/token), 1.45 tokens per target forward; "
                              "acceptance target 0.38, draft none drafted")
    turns = row.with_turn(0.97).with_turn(1.01)
    assert turns.describe() == ("medusa-lookup: 0.97x (turns 0.85-1.01); turn 1: 22.0 ms/token, 1.45 tokens per target forward; "
                                "acceptance target 0.38, draft none drafted")

