"""The comparison harness (``specstack bench``): grids, tasks, records, resumption and outputs.

Most tests run synthetic models over bytes (no weights); one runs a tiny grid on the embedded
default, one runs the Ray executor on a local one-CPU cluster.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

import attrs
import pytest
import torch

from specstack import SpecstackError
from specstack.bench import ByteTokenizer, Catalog, Grid, SyntheticModels, expand, load_grid, run_grid
from specstack.bench.cli import add_bench_parser, grid_overrides, run_bench
from specstack.bench.tasks import Books, task_by_name

SYNTHETIC = SyntheticModels(max_length=1024)
SMALL = dict(context_lengths=[256], max_new_tokens=12)


def points_by_stack(groups) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for group in groups:
        for point in group:
            found.setdefault(point.stack, []).append(dict(point.options))
    return found


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- grid -----------------------------------------------------------------------------------------


def test_axes_are_crossed_only_for_stacks_whose_recipe_has_the_option(registry) -> None:
    grid = Grid(stacks=["autoregressive", "speculative", "triforce:budget=64", "nope"], budgets=[64, 128], gammas=[2, 3],
                gamma2s=[4, 6], **SMALL)
    found = points_by_stack(expand(grid, Catalog(registry=registry), "synthetic"))
    assert found["autoregressive"] == [{}]  # no option axis applies: one run, not 2*2*2
    assert found["speculative"] == [{"gamma": 2}, {"gamma": 3}]
    assert found["triforce"] == [{"budget": 64, "gamma2": 4}, {"budget": 64, "gamma2": 6}]  # the fixed budget is not crossed
    assert found["nope"] == [{}]  # unknown: nothing crossed, its run records the error


def test_a_policies_axis_crosses_the_stacks_that_take_a_policy(registry) -> None:
    grid = Grid(stacks=["hierarchical", "self-speculative:policy=streaming", "naive"], policies=["retrieval", "h2o"], budgets=[64], **SMALL)
    found = points_by_stack(expand(grid, Catalog(registry=registry), "synthetic"))
    assert found["hierarchical"] == [{"budget": 64, "policy": "retrieval"}, {"budget": 64, "policy": "h2o"}]
    assert found["self-speculative"] == [{"budget": 64, "policy": "streaming"}]  # fixed in its spec: not crossed
    assert found["naive"] == [{}]


def test_the_cli_compares_cache_policies_on_identical_prompts(tmp_path, capsys) -> None:
    """Every policy's run of a group is measured against the same autoregressive run, so their speedups and
    acceptances compare; each greedy run writes the baseline's text. An unknown policy stops the bench before it runs."""
    from specstack.cli import main

    flags = ["bench", "--stacks", "self-speculative", "--budgets", "64", "--context-lengths", "256", "--max-new-tokens", "8",
             "--synthetic", "--quiet"]
    assert main([*flags, "--policies", "retrieval", "h2o", "topk-oracle", "--out", str(tmp_path / "ok")]) == 0
    records = read_jsonl(tmp_path / "ok" / "results.jsonl")
    runs = {r["options"].get("policy"): r for r in records}
    assert set(runs) == {None, "retrieval", "h2o", "topk-oracle"}  # None: the autoregressive baseline
    assert len({r["group"] for r in records}) == 1
    assert all(runs[p]["identical_to_baseline"] for p in ("retrieval", "h2o", "topk-oracle"))
    assert main([*flags, "--policies", "retrieval", "nope", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run 'self-speculative:budget=64,policy=nope': " in err and "nope" in err.split(": ", 2)[2], err
    assert not (tmp_path / "bad" / "results.jsonl").exists()


def test_groups_cross_task_axes_and_lead_with_their_baselines(registry) -> None:
    grid = Grid(stacks=["naive", "hf-assisted", "autoregressive"], temperatures=[0, 0.5], seeds=[0, 1], tasks=["prose", "needle"], **SMALL)
    groups = expand(grid, Catalog(registry=registry), "synthetic")
    assert len(groups) == 2 * 2 * 2
    for group in groups:
        assert [p.stack for p in group] == ["autoregressive", "hf-generate", "naive", "hf-assisted"]  # no duplicate autoregressive
        assert len({p.group for p in group}) == 1
    ids = [p.id for group in groups for p in group]
    assert len(ids) == len(set(ids))


def test_cpu_ids_are_those_of_records_written_before_devices_were_recorded(registry) -> None:
    grid = Grid(stacks=["naive", "speculative"], temperatures=[0, 0.5], context_lengths=[256], max_new_tokens=12)
    ids = {(p.stack, p.temperature): (p.id, p.group) for group in expand(grid, Catalog(registry=registry), "synthetic-v256-s0") for p in group}
    assert ids[("naive", 0.0)] == ("0f8c001abf1ce575", "cd4421ee4c71b338")  # computed before the device keys existed
    assert ids[("speculative", 0.5)] == ("53379c5ffea71743", "d8e9bd7b7a4ab54f")
    ids_without_graphs = {p.id for group in expand(attrs.evolve(grid, cuda_graphs=False), Catalog(registry=registry), "synthetic-v256-s0")
                          for p in group}
    assert ids_without_graphs == {v[0] for v in ids.values()}  # no CUDA graphs on the CPU either way


def test_a_run_on_cuda_gets_its_own_id_and_group(registry) -> None:
    catalog = Catalog(registry=registry)
    grid = Grid(stacks=["naive"], **SMALL)
    def points(grid, **devices):  # noqa: E306
        return [p for group in expand(grid, catalog, "synthetic", **devices) for p in group]

    cpu = points(grid)
    placements = [points(grid, device="cuda", draft_device="cuda"), points(grid, device="cuda", draft_device="cpu"),
                  points(attrs.evolve(grid, cuda_graphs=False), device="cuda", draft_device="cuda"), points(grid, device="cpu", draft_device="cuda:1")]
    ids = [{p.id for p in cpu}, *({p.id for p in found} for found in placements)]
    groups = [{p.group for p in cpu}, *({p.group for p in found} for found in placements)]
    assert sum(len(i) for i in ids) == len(set().union(*ids))  # all different
    assert sum(len(g) for g in groups) == len(set().union(*groups))
    assert [p.config()["device"] for p in placements[0]] == ["cuda", "cuda"] and placements[1][0].config()["draft_device"] == "cpu"


def test_models_already_placed_must_sit_where_the_grid_says(registry) -> None:
    from specstack.bench.models import DefaultModels, model_source

    with pytest.raises(SpecstackError, match=r"^grid key 'device' 'cuda:1' is not allowed with models synthetic-v256-s0, which run on cpu; "
                                             r"use cpu or leave 'device' out$"):
        model_source(SYNTHETIC, Grid(stacks=["naive"], device="cuda:1"))
    assert model_source(SYNTHETIC, Grid(stacks=["naive"], device="cpu")) is SYNTHETIC
    assert model_source(None, Grid(stacks=["naive"], device="cuda:1", draft_device="cpu")) == DefaultModels(device="cuda:1", draft_device="cpu")
    assert model_source(None, Grid(stacks=["naive"], device="cuda")) == DefaultModels(device="cuda", draft_device="cuda")


def test_a_ray_task_asks_for_the_gpus_its_devices_name() -> None:
    from specstack.bench.models import DefaultModels
    from specstack.bench.runner import Job

    assert Job(models=SYNTHETIC).gpus == 0
    assert Job(models=DefaultModels(device="cuda", draft_device="cpu")).gpus == 1
    assert Job(models=DefaultModels(device="cpu", draft_device="cuda:1")).gpus == 2


def test_no_cuda_graphs_reaches_the_transformers_models_of_a_job(tmp_path, registry) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from specstack.hf import HFCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=128)
    target = HFCausalLM(module=LlamaForCausalLM(config), tokenizer_id=None, name="tiny-llama")
    grid = Grid(stacks=["autoregressive"], context_lengths=[64], max_new_tokens=4, cuda_graphs=False, device="cpu")
    table = run_grid(grid, tmp_path, models=(target, None, ByteTokenizer()), registry=registry, progress=False)
    assert target.cuda_graphs is False
    (record,) = table.rows
    assert record["status"] == "ok" and record["cuda_graphs"] is False and record["draft_device"] is None
    assert record["environment"]["device"] == "cpu" and record["environment"]["draft_device"] is None and record["peak_cuda_mb"] is None


def test_the_runs_of_a_group_pay_the_targets_prefill_once(tmp_path, registry) -> None:
    """The autoregressive baseline prefills; every later run over the target's full cache copies it
    and decodes what it would have decoded after its own prefill."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specstack.hf import HFCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=256)
    target = HFCausalLM(module=LlamaForCausalLM(config), tokenizer_id=None, name="tiny-llama")
    grid = Grid(stacks=["autoregressive", "prompt-lookup", "self-speculative:policy=streaming"], context_lengths=[160], max_new_tokens=12)
    table = run_grid(grid, tmp_path, models=(target, None, ByteTokenizer()), registry=registry, progress=False)
    records = {r["stack"]: r for r in table.rows}
    assert all(r["status"] == "ok" for r in records.values()), [r.get("error") for r in records.values()]
    assert [records[name]["notes"]["prefill_shared"] for name in ("autoregressive", "prompt-lookup", "self-speculative")] == [False, True, True]
    assert records["prompt-lookup"]["identical_to_baseline"] and records["self-speculative"]["identical_to_baseline"]


def test_point_ids_are_stable_and_follow_the_configuration(registry) -> None:
    catalog = Catalog(registry=registry)
    ids = lambda grid: [p.id for group in expand(grid, catalog, "synthetic") for p in group]  # noqa: E731
    assert ids(Grid(stacks=["naive"], **SMALL)) == ids(Grid(stacks=["naive"], **SMALL))
    assert set(ids(Grid(stacks=["naive"], **SMALL))).isdisjoint(ids(Grid(stacks=["naive"], context_lengths=[256], max_new_tokens=13)))


def test_a_toml_grid_file_with_flag_overrides(tmp_path) -> None:
    path = tmp_path / "grid.toml"
    path.write_text('stacks = ["triforce:budget=1024,gamma2=6", "naive"]\nbudgets = [256, 512]\ntemperatures = [0, 0.6]\n'
                    'context_lengths = [2048]\ntasks = ["prose", "needle:depth=0.25"]\nmax_new_tokens = 32\n')
    grid = load_grid(path, {"seeds": [1, 2], "max_new_tokens": None})
    assert [s.text for s in grid.stacks] == ["triforce:budget=1024,gamma2=6", "naive"]
    assert grid.temperatures == (0.0, 0.6) and grid.seeds == (1, 2) and grid.max_new_tokens == 32
    assert [t.text for t in grid.tasks] == ["prose", "needle:depth=0.25"]


def test_a_yaml_grid_file(tmp_path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "grid.yaml"
    path.write_text("stacks: [naive]\ncontext_lengths: [512]\n")
    assert load_grid(path).context_lengths == (512,)


def test_a_grid_may_give_a_middle_level_gamma_zero(tmp_path) -> None:
    path = tmp_path / "grid.toml"
    path.write_text('stacks = ["triforce"]\ngamma1s = [0, 2]\n')
    assert load_grid(path).gamma1s == (0, 2)  # 0: the middle level drafts nothing and decodes alone


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('stacks = ["naive"]\nbudget = [256]\n', "unknown grid key 'budget'"),
        ('stacks = ["naive"]\nbudgets = ["big"]\n', "grid key 'budgets' must be a non-empty list of integers >= 1"),
        ('stacks = ["triforce"]\ngamma2s = [0, 6]\n', "grid key 'gamma2s' must be a non-empty list of integers >= 1"),
        ('stacks = ["triforce"]\ngamma1s = [-1]\n', "grid key 'gamma1s' must be a non-empty list of integers >= 0"),
        ('stacks = ["naive"]\nmax_new_tokens = "lots"\n', "grid key 'max_new_tokens' must be an integer >= 1"),
        ('stacks = ["naive"]\ntasks = ["summaries"]\n', "unknown task 'summaries'; available: prose, needle"),
        ('stacks = ["naive"]\ntasks = ["needle:depth=2"]\n', "task option depth 2 is not allowed"),
        ('stacks = ["naive"]\ncontext_lengths = []\n', "grid key 'context_lengths' must be a non-empty list"),
        ('stacks = []\n', "grid key 'stacks' must be a non-empty list"),
        ('stacks = ["naive", "triforce:gamma2=4", "triforce:gamma2=4"]\n',
         r'lists a value twice: \["naive", "triforce:gamma2=4", "triforce:gamma2=4"\]$'),
        ('budgets = [256]\n', "has no 'stacks'"),
        ('stacks = ["naive:budget"]\n', "stack option 'budget' is not KEY=VALUE"),
        ('stacks = ["naive"]\ndevice = "gpu0"\n', "grid key 'device': device 'gpu0' is not allowed; use cpu, cuda or cuda:N"),
        ('stacks = ["naive"]\ndraft_device = 0\n', "grid key 'draft_device' must be cpu, cuda or cuda:N; got 0"),
        ('stacks = ["naive"]\ncuda_graphs = "no"\n', "grid key 'cuda_graphs' must be true or false"),
        ('stacks = ["naive"]\nrepeats = 0\n', "grid key 'repeats' must be an integer >= 1"),
        ('stacks = ["naive"\n', "is not valid TOML"),
    ],
)
def test_a_malformed_grid_file_fails_in_one_line_before_anything_runs(tmp_path, text, message) -> None:
    path = tmp_path / "grid.toml"
    path.write_text(text)
    args = bench_args(["--grid", str(path), "--out", str(tmp_path / "out"), "--synthetic", "--quiet"])
    with pytest.raises(SpecstackError, match=message) as caught:
        run_bench(args)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


# -- tasks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [200, 333, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_needle_prompts_have_the_exact_length_and_keep_needle_and_question(length, depth) -> None:
    books = Books(ByteTokenizer())
    prompt = task_by_name("needle").prompt(books, length, 7, {"depth": depth})
    text = books.decode(prompt.tokens)
    assert len(prompt.tokens) == length
    assert f"The pass key is {prompt.answer}. Remember it." in text
    assert text.endswith("What is the pass key? The pass key is")
    assert prompt.score(f" {prompt.answer}.") == 1.0 and prompt.score(" 12.") == 0.0
    assert task_by_name("needle").prompt(books, length, 7, {"depth": depth}) == prompt  # deterministic in the seed
    assert task_by_name("needle").prompt(books, length, 8, {"depth": depth}).answer != prompt.answer


def test_prose_prompts_are_book_text_of_the_exact_length() -> None:
    books = Books(ByteTokenizer())
    prompt = task_by_name("prose").prompt(books, 300, 0, {"offset": 1000})
    assert len(prompt.tokens) == 300 and prompt.answer is None
    with pytest.raises(SpecstackError, match="cannot cut 10000000 tokens at offset 0"):
        task_by_name("prose").prompt(books, 10_000_000, 0, {})


def test_a_needle_task_too_short_for_the_needle_says_how_long_it_must_be() -> None:
    with pytest.raises(SpecstackError, match="too short for the needle task; use at least"):
        task_by_name("needle").prompt(Books(ByteTokenizer()), 40, 0, {})


# -- runs -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One synthetic grid with good and bad points, run once for the tests below."""
    out = tmp_path_factory.mktemp("bench")
    grid = Grid(stacks=["naive", "speculative", "streaming-hierarchy", "nope", "triforce:budget=4096", "hf-generate"],
                gamma2s=[4, 6], temperatures=[0, 0.8], context_lengths=[256, 1024], tasks=["prose", "needle"], max_new_tokens=12)
    from specstack import Registry

    table = run_grid(grid, out, models=SYNTHETIC, registry=Registry.create(entry_points=False), progress=False)
    return grid, out, table


def test_bad_points_become_error_records_and_the_rest_of_the_grid_runs(finished) -> None:
    _, _, table = finished
    errors = {(r["stack"], r["context_length"]): r["error"] for r in table.errors}
    assert errors[("nope", 256)].startswith("unknown stack 'nope'; available: ")
    assert errors[("triforce", 256)] == "budget 4096 is larger than the 256-token context; use a budget of at most 256"
    assert "needs 1036 positions but the model's window is 1024" in errors[("naive", 1024)]
    assert errors[("hf-generate", 256)] == "the transformers baselines need a transformers target (HFCausalLM); got SyntheticLM"
    assert all("\n" not in e for e in errors.values())
    ok_stacks = {r["stack"] for r in table.ok}
    assert ok_stacks == {"autoregressive", "naive", "speculative", "streaming-hierarchy"}
    assert {r["status"] for r in table.rows} == {"ok", "error"}
    assert len(table.ok) == 2 * 2 * (1 + 1 + 1 + 2)  # tasks x temperatures x (ar, naive, speculative, 2 gamma2) at 256


def test_numbers_are_in_their_ranges(finished) -> None:
    _, _, table = finished
    for record in table.ok:
        assert record["new_tokens"] == 12 and record["tokens_per_second"] > 0 and record["speedup"] > 0
        assert record["timing"] == "decode" and record["prefill_seconds"] >= 0 and record["peak_rss_mb"] > 0
        assert "peak_cuda_mb" in record and record["peak_cuda_mb"] is None  # on the CPU
        assert (record["device"], record["draft_device"], record["cuda_graphs"]) == ("cpu", "cpu", True)
        assert (record["environment"]["device"], record["environment"]["draft_device"]) == ("cpu", "cpu")
        split = record["time_split"]  # its parts are disjoint and add up to the decoding time
        assert all(v >= 0 for v in split.values()) and sum(split.values()) == pytest.approx(record["decode_seconds"], rel=1e-9)
        assert split["bookkeeping_seconds"] > 0 and set(split) == {"drafting_seconds", "verifying_seconds", "bookkeeping_seconds", "gathering_seconds", "rest_seconds"}
        for level in record["levels"]:
            assert 0 <= level["acceptance_rate"] <= 1 and level["accepted"] <= level["drafted"] or not level["drafted"] and level["acceptance_rate"] is None
        if record["temperature"] == 0:
            assert record["identical_to_baseline"] is True  # lossless
        else:
            assert record["identical_to_baseline"] is None
        assert (record["accuracy"] in (0.0, 1.0)) if record["task"] == "needle" else record["accuracy"] is None
        assert record["environment"]["python"] and "torch" in record["environment"] and "git_revision" in record
    baseline = [r for r in table.ok if r["stack"] == "autoregressive"]
    assert all(r["speedup"] == 1.0 for r in baseline)


def test_outputs_are_written(finished) -> None:
    _, out, table = finished
    assert len(read_jsonl(out / "results.jsonl")) == len(table.rows)
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == len(table.rows) and {"speedup", "level1_acceptance_rate", "option_gamma2"} <= set(rows[0])
    report = (out / "report.md").read_text()
    assert "| `naive` | prose | 256 | 0.00 |" in report and "unknown stack 'nope'" in report
    assert "- budget ablation: not drawn; no successful run has a retrieval budget." in report
    assert "- acceptance vs context length: not drawn; only one context length (256)." in report  # the 1024-token runs failed
    assert table.to_markdown().startswith("| stack | task |")
    assert "peak CUDA MiB" not in report and "| device |" not in report  # every run on the CPU


def test_the_report_shows_devices_and_peak_cuda_memory_only_when_they_tell_something(finished) -> None:
    from specstack.bench import report

    _, _, table = finished
    cpu = [r for r in table.ok if r["stack"] == "naive"]
    on_cuda = [{**r, "device": "cuda:0", "draft_device": "cpu", "peak_cuda_mb": 812.5} for r in cpu]
    header = report.summary_markdown(cpu + on_cuda).splitlines()[0]
    assert "| T | device | runs |" in header and header.endswith("| peak CUDA MiB |")
    rows = report.summary_markdown(cpu + on_cuda).splitlines()[2:]
    assert len(rows) == 2 * len(report.summary_rows(cpu))  # CPU and CUDA runs are not averaged together
    assert any("| cuda:0, draft on cpu |" in row and row.endswith("| 812 |") for row in rows)
    assert any("| cpu |" in row and row.endswith("|  |") for row in rows)
    without_graphs = [{**r, "device": "cuda", "draft_device": "cuda", "cuda_graphs": False, "peak_cuda_mb": 1.0} for r in cpu]
    assert "| cuda, no CUDA graphs |" in report.summary_markdown(cpu + without_graphs)


def test_a_plot_is_drawn_for_an_axis_with_several_values(finished) -> None:
    _, out, _ = finished
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "- speedup vs temperature: not drawn; matplotlib is not installed" in (out / "report.md").read_text()
        pytest.skip("matplotlib is not installed: the report says the plot is missing")
    assert "![speedup vs temperature](speedup_vs_temperature.png)" in (out / "report.md").read_text()
    assert (out / "speedup_vs_temperature.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.glob("*.png")) == ["speedup_vs_temperature.png"]


def test_a_second_run_skips_every_finished_point_and_a_lost_one_is_run_again(tmp_path, registry) -> None:
    grid = Grid(stacks=["naive", "speculative"], temperatures=[0, 1.0], **SMALL)
    first = run_grid(grid, tmp_path, models=SYNTHETIC, registry=registry, progress=False)
    assert first.executed == 2 * 3 and len(first.ok) == 6
    second = run_grid(grid, tmp_path, models=SYNTHETIC, registry=registry, progress=False)
    assert second.executed == 0 and len(second.rows) == 6
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # the last run lost, its line torn
    third = run_grid(grid, tmp_path, models=SYNTHETIC, registry=registry, progress=False)
    assert third.executed == 1 and len(third.ok) == 6
    assert next(r for r in third.rows if r["id"] == json.loads(lines[-1])["id"])["speedup"] > 0  # baseline measured again


def test_a_gamma_of_auto_tunes_the_stack_before_its_timed_run(tmp_path, registry) -> None:
    """``naive:gamma=auto`` (and ``adaptive``) tune γ as ``specstack generate -o gamma=auto`` does, untimed, and the
    record notes the choice; the output is still the baseline's. A fixed γ is not tuned."""
    grid = Grid(stacks=["naive:gamma=auto", "naive:gamma=adaptive", "naive:gamma=3"], temperatures=[0], **SMALL)
    table = run_grid(grid, tmp_path, models=SYNTHETIC, registry=registry, progress=False)
    notes = {json.dumps(r["options"]): r["notes"] for r in table.rows if r["stack"] == "naive"}
    assert all(r["status"] == "ok" for r in table.rows), [r.get("error") for r in table.rows]
    assert notes['{"gamma": "auto"}']["tuning"].startswith("gamma=auto chose γ1=")
    assert notes['{"gamma": "adaptive"}']["tuning"].startswith("gamma=auto chose γ1=") and "gamma=adaptive" in notes['{"gamma": "adaptive"}']["tuning"]
    assert "tuning" not in notes['{"gamma": 3}']
    records = [r for r in table.rows if r["stack"] == "naive"]
    assert len(records) == 3 and all(r["identical_to_baseline"] for r in records)


def test_a_groups_baseline_is_measured_again_at_its_end_and_its_drift_reported(tmp_path, registry) -> None:
    """The baseline's record carries ``baseline_again`` (its decode speed measured once more after the group's other
    runs, and that over the first: the host's drift while they ran); a group of the baseline alone is not measured
    again. The report lists the groups whose baseline moved by more than 10%."""
    table = run_grid(Grid(stacks=["naive", "speculative"], temperatures=[0, 1.0], **SMALL), tmp_path / "a", models=SYNTHETIC, registry=registry, progress=False)
    baselines = [r for r in table.rows if r["stack"] == "autoregressive"]
    assert len(baselines) == 2 and all("baseline_again" not in r for r in table.rows if r["stack"] != "autoregressive")
    for record in baselines:
        again = record["baseline_again"]
        assert again["decode_tokens_per_second"] > 0 and again["drift"] == pytest.approx(again["decode_tokens_per_second"] / record["decode_tokens_per_second"])
    assert "## Baseline drift\n\n2 groups' baselines measured again" in (tmp_path / "a" / "report.md").read_text()
    alone = run_grid(Grid(stacks=["autoregressive"], **SMALL), tmp_path / "b", models=SYNTHETIC, registry=registry, progress=False)
    assert alone.rows[0]["baseline_again"] is None


def test_repeats_measure_each_stack_in_turns_and_report_the_median(tmp_path, registry) -> None:
    """With ``repeats`` 3 a group's stacks run three turns, each after its baselines again: every record keeps its three
    speedups, its speedup is their median, and the report gives their range; the baselines' records are as without."""
    table = run_grid(Grid(stacks=["naive", "speculative"], repeats=3, **SMALL), tmp_path, models=SYNTHETIC, registry=registry, progress=False)
    stacks = [r for r in table.rows if r["stack"] != "autoregressive"]
    assert len(stacks) == 2 and all("speedups" not in r for r in table.rows if r["stack"] == "autoregressive")
    for record in stacks:
        assert len(record["speedups"]) == 3 and all(s > 0 for s in record["speedups"])
        assert record["speedup"] == sorted(record["speedups"])[1] and record["identical_to_baseline"] is True
        low, high = min(record["speedups"]), max(record["speedups"])
        assert f"{record['speedup']:.2f}× ({low:.2f}-{high:.2f})" in (tmp_path / "report.md").read_text()


def test_each_turn_is_measured_against_its_own_baseline(tmp_path, registry, monkeypatch) -> None:
    """The host slows turn by turn (every run of turn t takes t + 1 times as long) and the stack is always twice as fast
    as the baseline beside it: each turn's speedup is 2, where against the first turn's baseline they would read 2, 1
    and 2/3. A run whose text leaves the baseline's in one turn is not identical."""
    from specstack.bench.runner import Runner
    from specstack.bench.stacks import Measurement

    calls: dict[str, int] = {}

    def measure(self, point, prompt, prefill=None):
        turn = calls[point.stack] = calls.get(point.stack, -1) + 1
        seconds = (turn + 1) * (1.0 if point.stack == "autoregressive" else 0.5)
        tokens = (1, 2, 3) if point.stack == "autoregressive" or turn != 2 else (1, 2, 4)
        return Measurement(tokens=tokens, levels=(), decode_seconds=seconds, prefill_seconds=0.1, total_seconds=seconds + 0.1, timing="decode")

    monkeypatch.setattr(Runner, "_measure", measure)
    table = run_grid(Grid(stacks=["naive"], repeats=3, **SMALL), tmp_path, models=SYNTHETIC, registry=registry, progress=False)
    record = next(r for r in table.rows if r["stack"] == "naive")
    assert record["speedups"] == pytest.approx([2.0, 2.0, 2.0]) and record["speedup"] == pytest.approx(2.0)
    assert record["identical_to_baseline"] is False
    assert calls == {"autoregressive": 3, "naive": 2}  # counted from 0: the baseline ran four times (three turns, then the drift check), the stack three


def test_the_drift_section_lists_the_groups_that_moved() -> None:
    from specstack.bench.report import drift_markdown

    record = {"status": "ok", "label": "autoregressive", "task": "prose", "task_options": {}, "context_length": 256, "temperature": 0.0,
              "seed": 0, "decode_tokens_per_second": 40.0}
    steady, moved = {**record, "baseline_again": {"decode_tokens_per_second": 38.0, "drift": 0.95}}, {**record, "baseline_again": {"decode_tokens_per_second": 22.0, "drift": 0.55}}
    assert "none moved by more than 10%" in drift_markdown([steady])
    assert "| `autoregressive` | prose | 256 | 0.0 | 0 | 40.00 | 22.00 | 0.55 |" in drift_markdown([steady, moved])


def test_the_cli_runs_a_synthetic_grid(tmp_path, capsys) -> None:
    args = bench_args(["--stacks", "naive", "speculative:gamma=3", "--context-lengths", "256", "--max-new-tokens", "8",
                       "--temperatures", "0", "--synthetic", "--out", str(tmp_path), "--quiet"])
    assert run_bench(args) == 0
    out = capsys.readouterr().out
    assert "| `speculative:gamma=3` | prose | 256 |" in out and "3 runs executed" in out


def test_the_cli_exits_2_when_a_run_failed_on_bad_input(tmp_path, capsys, monkeypatch) -> None:
    """The runs that worked are reported and written, and a script running the bench learns that some gave no figures:
    exit code 2 (bad input, as everywhere) and one line on stderr naming the first failed run and its error. (Here an
    input error that only decoding finds: the prompt-lookup drafter refusing every draft call.)"""
    from specstack.drafters import PromptLookupDrafter

    def refuse(*args, **kwargs):
        raise SpecstackError("a deliberate input error")

    monkeypatch.setattr(PromptLookupDrafter, "propose", refuse)
    args = bench_args(["--stacks", "naive", "prompt-lookup", "--context-lengths", "256", "--max-new-tokens", "8",
                       "--temperatures", "0", "--synthetic", "--out", str(tmp_path), "--quiet"])
    assert run_bench(args) == 2
    captured = capsys.readouterr()
    assert "3 runs executed; 2 ok and 1 failed" in captured.out
    assert captured.err == "specstack bench: 1 run(s) failed, the first 'prompt-lookup': a deliberate input error\n"


@pytest.mark.parametrize(("flags", "message"), [
    ("--stacks naive triforce:budgett=5", "run 'triforce:budgett=5': stack 'triforce' has no option 'budgett'; options: gamma1, gamma2, "
                                          "budget, chunk_size, stride, draft_window, sinks, draft_vocab"),
    ("--stacks naive triforce:gamma1=-1", "run 'triforce:gamma1=-1': gamma -1 is not allowed; use an integer >= 1"),
    ("--stacks naive triforce:budget=512", "run 'triforce:budget=512': budget 512 is larger than the 256-token context; use a budget of at most 256"),
    ("--stacks naive prompt-lookup:max_ngram=0", "run 'prompt-lookup:max_ngram=0': n-gram range 1..0 is not allowed"),
    ("--stacks naive autoregressive:gamma=auto", "run 'autoregressive:gamma=auto': gamma=auto needs a stack with at least one verifying level"),
    ("--stacks naive --tasks needle --context-lengths 256 40", "run 'autoregressive': context length 40 is too short for the needle task"),
])
def test_the_cli_refuses_a_runs_bad_input_before_anything_runs(tmp_path, capsys, flags, message) -> None:
    """Options a stack refuses are found by building the stack once the models are loaded, and a prompt its task
    cannot make by making it: one error line and exit code 2 before the first forward, where the run would meet them
    only after its group's baselines had run (after the other groups, for the needle's context of 40)."""
    from specstack.cli import main

    assert main(["bench", "--context-lengths", "256", "--max-new-tokens", "4", "--synthetic", "--out", str(tmp_path), "--quiet",
                 *flags.split()]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "results.jsonl").exists()  # nothing ran


def test_run_grid_records_a_runs_bad_options_unless_asked_to_check_first(tmp_path, registry) -> None:
    """The Python API keeps its grid going (the bad run becomes an error record); ``check_first`` raises instead."""
    grid = Grid(stacks=["naive", "triforce:gamma2=0"], **SMALL)
    with pytest.raises(SpecstackError, match=r"^run 'triforce:gamma2=0': gamma 0 is not allowed"):
        run_grid(grid, tmp_path / "first", models=SYNTHETIC, registry=registry, progress=False, check_first=True)
    assert not (tmp_path / "first" / "results.jsonl").exists()
    table = run_grid(grid, tmp_path / "recorded", models=SYNTHETIC, registry=registry, progress=False)
    (failed,) = table.errors
    assert failed["label"] == "triforce:gamma2=0" and failed["error_kind"] == "input"
    assert {r["stack"] for r in table.ok} == {"autoregressive", "naive"}


def test_a_crash_while_checking_first_is_left_for_the_run_to_record(tmp_path, registry, monkeypatch) -> None:
    """Only bad input stops a grid before it runs: a component that crashes while being built (not the user's
    fault) is recorded by its run, and the other runs go on."""
    from specstack.drafters import PromptLookupDrafter

    def crash(self, *args, **kwargs):
        raise RuntimeError("a deliberate fault")

    monkeypatch.setattr(PromptLookupDrafter, "__attrs_post_init__", crash, raising=False)
    table = run_grid(Grid(stacks=["naive", "prompt-lookup"], **SMALL), tmp_path, models=SYNTHETIC, registry=registry, progress=False,
                     check_first=True)
    (failed,) = table.errors
    assert (failed["stack"], failed["error_kind"], failed["error"]) == ("prompt-lookup", "crash", "RuntimeError: a deliberate fault")
    assert {r["stack"] for r in table.ok} == {"autoregressive", "naive"}


@pytest.mark.parametrize(("stack", "options", "message"), [
    ("hf-assisted", {"schedule": "bogus"}, "hf-assisted schedule 'bogus' is not allowed; use one of heuristic, heuristic_transient, constant"),
    ("hf-assisted", {"num_assistant_tokens": 0}, "hf-assisted num_assistant_tokens 0 is not allowed; use an integer >= 1"),
    ("hf-prompt-lookup", {"num_tokens": 0}, "hf-prompt-lookup num_tokens 0 is not allowed; use an integer >= 1"),
    ("hf-prompt-lookup", {"max_ngram": True}, "hf-prompt-lookup max_ngram True is not allowed; use an integer >= 1"),
])
def test_the_transformers_baselines_refuse_values_transformers_would_ignore_or_fail_on(registry, stack, options, message) -> None:
    """transformers runs an unknown schedule as a constant one, and fails on a zero count with a bare ValueError."""
    baseline = Catalog(registry=registry).get(stack)
    with pytest.raises(SpecstackError, match=f"^{re.escape(message)}$"):
        baseline.extra(None, baseline._with_defaults(options))


def test_the_cli_exits_1_when_a_run_crashed(tmp_path, capsys, monkeypatch) -> None:
    """A fault that is not bad input (here every decoding raising RuntimeError) is exit code 1, not 2."""
    from specstack.stack import SpeculationStack

    def crash(*args, **kwargs):
        raise RuntimeError("a deliberate fault")

    monkeypatch.setattr(SpeculationStack, "generate", crash)
    args = bench_args(["--stacks", "naive", "--context-lengths", "256", "--max-new-tokens", "8", "--synthetic",
                       "--out", str(tmp_path), "--quiet"])
    assert run_bench(args) == 1
    assert "RuntimeError: a deliberate fault" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--stacks", "naive", "--trees", "binary:3"],
     "grid key 'trees' sets option 'tree', which none of the stacks (naive) takes unfixed; add a stack that has it"),
    (["--stacks", "triforce:gamma1=2", "autoregressive", "--gamma1", "1", "2"],
     "grid key 'gamma1s' sets option 'gamma1', which none of the stacks (triforce:gamma1=2, autoregressive) takes unfixed"),
    (["--stacks", "naive", "--num-cpus", "2"], "num_cpus 2 is only used by the ray executor; add executor='ray' (--executor ray)"),
    (["--stacks", "prompt-lookup:gamma=auto,gamma=2"], "stack option 'gamma' is given twice ('gamma=auto', 'gamma=2'); give it once"),
])
def test_the_cli_refuses_what_it_would_drop_before_anything_runs(tmp_path, capsys, flags, message) -> None:
    """An option axis no stack takes, a Ray-only setting on the local executor and an option given twice would
    each be dropped without a word: one error line instead, and nothing runs."""
    from specstack.cli import main

    assert main(["bench", *flags, "--context-lengths", "256", "--max-new-tokens", "4", "--synthetic", "--out", str(tmp_path / "out"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_an_axis_is_taken_where_one_stack_has_it_unfixed(tmp_path, capsys) -> None:
    """The check above does not refuse an axis that one stack of several takes: it is crossed there alone."""
    args = bench_args(["--stacks", "autoregressive", "speculative", "--gamma", "2", "3", "--context-lengths", "256", "--max-new-tokens", "4",
                       "--synthetic", "--out", str(tmp_path), "--quiet"])
    assert run_bench(args) == 0
    labels = {json.loads(line)["label"] for line in (tmp_path / "results.jsonl").read_text().splitlines()}
    assert labels == {"speculative:gamma=2", "speculative:gamma=3", "autoregressive"}


def test_a_coupled_grid_compares_sampled_runs_on_one_text(tmp_path, capsys) -> None:
    """--coupled: at T = 1 every stack writes the baseline's text (docs/exactness.md, "Coupled sampling"), so the
    identity is asked of sampled runs and holds (fp32); the records say coupled, their ids differ from independent
    sampling's, and the report marks the rows."""
    argv = ["--stacks", "naive", "speculative:gamma=3", "--context-lengths", "256", "--max-new-tokens", "12", "--temperatures", "1",
            "--synthetic", "--quiet"]
    assert run_bench(bench_args([*argv, "--coupled", "--out", str(tmp_path / "coupled")])) == 0
    assert "| 1.00 coupled |" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "coupled" / "results.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["coupled"] and r["identical_to_baseline"] is True for r in records)
    assert run_bench(bench_args([*argv, "--out", str(tmp_path / "independent")])) == 0
    independent = [json.loads(line) for line in (tmp_path / "independent" / "results.jsonl").read_text().splitlines()]
    assert all("coupled" not in r and r["identical_to_baseline"] is None for r in independent)
    assert not {r["id"] for r in records} & {r["id"] for r in independent}


def test_only_specstack_stacks_are_asked_for_their_baselines_coupled_text(registry) -> None:
    """transformers and llama.cpp sample with their own samplers, coupled or not: their texts are not compared."""
    catalog = Catalog(registry=registry)
    assert catalog.get("naive").couples and catalog.get("triforce").couples
    assert not any(catalog.get(name).couples for name in ("hf-generate", "hf-assisted", "llama-cpp"))


def test_widen_bf16_reaches_the_target_of_a_job_and_marks_its_records(tmp_path, registry) -> None:
    """--widen-bf16: the target's bf16 products are widened (its attention kernel without AMX tiles or bf16 dot
    products, its linears' rows too), its records say so and take ids of their own; unset, a point's id is the one it
    had before the key existed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specstack.bench.report import placement
    from specstack.hf import HFCausalLM
    from specstack.packed_linear import PackedLinear

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=128)
    target = HFCausalLM(module=LlamaForCausalLM(config).to(torch.bfloat16), tokenizer_id=None, name="tiny-llama")
    grid = Grid(stacks=["autoregressive"], context_lengths=[64], max_new_tokens=4, widen_bf16=True, dtype="bfloat16")
    table = run_grid(grid, tmp_path, models=(target, None, ByteTokenizer()), registry=registry, progress=False)
    kernel = target.attention_kernel
    assert kernel is None or not (kernel.amx or kernel.dot_products)
    rows = [m._rows for m in target.module.modules() if isinstance(m, PackedLinear) and m._rows is not None]
    assert not any(r.tiles or r.bf16_dots for r in rows)
    (record,) = table.rows
    assert record["status"] == "ok" and record["widen_bf16"] is True and placement(record) == "cpu, bf16 widened"
    catalog = Catalog(registry=registry)
    widened, plain = ([p for g in expand(g, catalog, "tiny") for p in g] for g in (grid, attrs.evolve(grid, widen_bf16=False)))
    assert not {p.id for p in widened} & {p.id for p in plain} and all("widen_bf16" not in p.config() for p in plain)
    assert grid_overrides(bench_args(["--stacks", "naive", "--widen-bf16"]))["widen_bf16"] is True


def test_device_flags_become_grid_keys(tmp_path) -> None:

    args = bench_args(["--stacks", "naive", "--device", "cuda:1", "--draft-device", "cpu", "--no-cuda-graphs"])
    assert {k: v for k, v in grid_overrides(args).items() if k != "stacks"} == {"device": "cuda:1", "draft_device": "cpu", "cuda_graphs": False}
    assert "cuda_graphs" not in grid_overrides(bench_args(["--stacks", "naive"]))  # unset: the grid file's value or the default
    assert grid_overrides(bench_args(["--stacks", "naive", "--repeats", "3"]))["repeats"] == 3


def bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specstack")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


# -- Ray ------------------------------------------------------------------------------------------


def test_the_ray_executor_runs_groups_on_a_local_cluster(tmp_path) -> None:
    pytest.importorskip("ray")
    grid = Grid(stacks=["naive"], temperatures=[0, 1.0], context_lengths=[256], max_new_tokens=8, threads=1)
    table = run_grid(grid, tmp_path, models=SYNTHETIC, executor="ray", num_cpus=1, progress=False)
    assert table.executed == 4 and {r["status"] for r in table.rows} == {"ok"}
    assert all(r["speedup"] > 0 for r in table.rows)


# -- the embedded default -------------------------------------------------------------------------


@pytest.mark.real_model
def test_a_tiny_grid_on_the_embedded_default(tmp_path) -> None:
    grid = Grid(stacks=["autoregressive", "retrieval-flat:budget=256", "hf-generate"], context_lengths=[512], max_new_tokens=8,
                tasks=["prose", "needle"])
    table = run_grid(grid, tmp_path, progress=False)
    assert table.executed == 6 and not table.errors
    for record in table.ok:
        assert record["new_tokens"] == 8 and record["speedup"] > 0 and record["identical_to_baseline"] is True
        assert record["environment"]["target"] == "smollm2-135m-instruct"
    flat = [r for r in table.ok if r["stack"] == "retrieval-flat"]
    assert all(0 <= r["levels"][-1]["acceptance_rate"] <= 1 and r["time_split"]["drafting_seconds"] > 0 for r in flat)
    hf = [r for r in table.ok if r["stack"] == "hf-generate"]
    assert all(r["timing"] == "total" and r["baseline"] == "hf-generate" for r in hf)
    assert all(r["decode_tokens_per_second"] > r["tokens_per_second"] for r in hf)  # its prefill is left out of the one, not the other
    needle = [r for r in table.ok if r["task"] == "needle"]
    assert all(r["accuracy"] == 1.0 for r in needle)  # the 135M model finds a pass key in 512 tokens
    assert (tmp_path / "report.md").exists() and (tmp_path / "results.csv").exists()


def test_the_acceptance_plot_leaves_out_a_level_that_was_offered_no_drafts(finished, tmp_path) -> None:
    """A tuned γ of 0 below a level (``triforce:gamma=adaptive`` whose draft model did not pay) leaves that level
    verifying nothing: its acceptance is None in the record. The plot draws the other levels' and the report is
    written, instead of failing at the end of a grid on the missing rate."""
    from specstack.bench import report

    pytest.importorskip("matplotlib")
    _, _, table = finished
    runs = [r for r in table.ok if r["stack"] == "naive"]
    idle = [{**r, "context_length": r["context_length"] * 2, "levels": [{**level, "drafted": 0, "accepted": 0, "acceptance_rate": None}
                                                                            for level in r["levels"]]} for r in runs]
    drawn = dict((title, file) for title, file, _ in report.draw_plots(runs + idle, tmp_path))
    assert drawn["acceptance vs context length"] == "acceptance_vs_context_length.png"
    plot = next(p for p in report.PLOTS if p.title == "acceptance vs context length")
    points = [x for line in report._lines(plot, report.ACCEPTANCE, runs + idle).values() for x, _ in line]
    assert points and set(points) == {r["context_length"] for r in runs}  # the idle runs' levels drew no point


def test_a_plot_that_fails_to_draw_is_named_in_the_report_and_the_rest_is_written(finished, tmp_path, monkeypatch) -> None:
    """A fault while drawing one plot (a metric the plot did not expect) costs that plot, not the report of a grid
    that may have run for hours: the report says which plot failed and why, and the other plots are drawn."""
    from specstack.bench import report

    pytest.importorskip("matplotlib")
    _, _, table = finished
    runs = [r for r in table.ok if r["stack"] == "naive"]
    runs += [{**r, "context_length": r["context_length"] * 2} for r in runs]

    def broken(record: dict) -> list[tuple[str, float]]:
        raise ValueError("no such metric")

    monkeypatch.setattr(report, "ACCEPTANCE", report.Panel(title="acceptance rate", values=broken))
    monkeypatch.setattr(report, "PLOTS", tuple(attrs.evolve(p, panels=(report.ACCEPTANCE,)) if p.title.startswith("acceptance") else p
                                               for p in report.PLOTS))
    drawn = report.draw_plots(runs, tmp_path)
    report.write_report(runs, tmp_path / "report.md", drawn)
    text = (tmp_path / "report.md").read_text()
    assert "- acceptance vs context length: not drawn; drawing it failed (ValueError: no such metric)." in text
    assert "![speedup vs context length](speedup_vs_context_length.png)" in text
    assert (tmp_path / "speedup_vs_context_length.png").exists() and not (tmp_path / "acceptance_vs_context_length.png").exists()


def test_a_plot_draws_one_axes_per_task_and_temperature_and_a_stack_keeps_its_colour(finished) -> None:
    """Against context length, runs of two tasks at two temperatures make four axes (as TriForce's Figure 1 draws a
    panel per text), each with one line per stack, titled by its task and temperature; a stack has the same colour in
    every axes, so that the one legend under them reads for all."""
    from specstack.bench import report

    pytest.importorskip("matplotlib")
    _, _, table = finished
    runs = [r for r in table.ok if r["stack"] in ("naive", "speculative")]
    runs += [{**r, "context_length": r["context_length"] * 2, "speedup": r["speedup"] + 0.5} for r in runs]
    plot = next(p for p in report.PLOTS if p.title == "speedup vs context length")
    figure = report._figure(plot, runs)
    drawn = [ax for ax in figure.axes if ax.get_lines()]
    tasks, temperatures = {report.task_label(r) for r in runs}, {r["temperature"] for r in runs}
    assert len(drawn) == len(tasks) * len(temperatures) == 4
    assert sorted(ax.get_title() for ax in drawn) == sorted(f"{task}, T={t}" for task in tasks for t in temperatures)
    stacks = {f"{task}, T={t}": sorted({report.label(r["stack"], r.get("options") or {}) for r in runs
                                        if report.task_label(r) == task and r["temperature"] == t}) for task in tasks for t in temperatures}
    colours: dict[str, tuple] = {}
    for ax in drawn:
        assert sorted(line.get_label() for line in ax.get_lines()) == stacks[ax.get_title()]
        for line in ax.get_lines():
            assert colours.setdefault(line.get_label(), line.get_color()) == line.get_color()
            assert [x for x in line.get_xdata()] == sorted({r["context_length"] for r in runs})
    assert len(figure.legends) == 1 and sorted(t.get_text() for t in figure.legends[0].get_texts()) == sorted(colours)
