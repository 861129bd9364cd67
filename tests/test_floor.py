"""The floor of a forward (specstack.floor) and the command that measures forwards against it
(``specstack floor``, specstack.bench.floor)."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specstack import SpecstackError
from specstack.batch import TokenBatch
from specstack.bench.floor import Level, Row, ceiling_lines, ceilings, chain_costs, fill, measure, run_floor, time_forwards, tree_parents
from specstack.cli import _parser, main
from specstack.floor import BandwidthProbe, Floor, Gemm, Machine, ModelShape, forward_floor, measure_machine
from specstack.testing.llama import random_llama
from specstack.types import Draft, DraftKind

SMOLLM2_135M = ModelShape(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, tied=True)
SMALL = ModelShape(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10, tied=False)
MACHINE = Machine(threads=1, read_bandwidth=1e10, gemm_peak={"float32": 1e11, "bfloat16": 2e11})


# -- the formula, by hand -------------------------------------------------------------------------

def test_smollm2_parameter_counts_by_hand() -> None:
    # per layer: q, o 576·576 each; k, v 576·192 each; gate, up, down 576·1536 each
    assert SMOLLM2_135M.linear_params == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) == 106_168_320
    assert SMOLLM2_135M.head_params == 49152 * 576 == 28_311_552


def test_smollm2_autoregressive_step_over_no_cache_by_hand() -> None:
    floor = forward_floor(SMOLLM2_135M, torch.float32, 1, 0, 1, MACHINE)
    assert floor.bytes == 4 * (106_168_320 + 28_311_552)  # tied: the token's embedding row is in the head
    assert floor.flops == 2 * 106_168_320 + 2 * 49152 * 576 == 268_959_744
    assert floor.memory_s == pytest.approx(0.0537919488)
    assert floor.compute_s == pytest.approx(0.00268959744)
    assert floor.seconds == floor.memory_s and floor.bound == "memory"


def test_a_bf16_step_reading_q4_1_blocks_counts_their_bytes_for_the_linear_maps_only() -> None:
    floor = forward_floor(SMOLLM2_135M, "bfloat16", 1, 7500, 1, MACHINE, linear_bytes=0.75)
    kv = 2 * 7500 * 30 * 3 * 64
    assert floor.bytes == 0.75 * 106_168_320 + 2 * (28_311_552 + kv)  # the head and the cache stay bf16
    assert floor.flops == forward_floor(SMOLLM2_135M, "bfloat16", 1, 7500, 1, MACHINE).flops
    with pytest.raises(SpecstackError, match="linear_bytes 0 is not allowed"):
        forward_floor(SMOLLM2_135M, "bfloat16", 1, 7500, 1, MACHINE, linear_bytes=0)


def test_smollm2_verify_of_7_tokens_over_7500_slots_in_bf16_by_hand() -> None:
    floor = forward_floor(SMOLLM2_135M, "bfloat16", 7, 7500, 7, MACHINE)
    kv = 2 * 7500 * 30 * 3 * 64  # keys and values: 86,400,000 elements
    assert floor.bytes == 2 * (106_168_320 + 28_311_552 + kv) == 441_759_744
    # linear 2·P·T + attention 2·2·T·n·Hq·D·L + head 2·r·V·d
    assert floor.flops == 1_486_356_480 + 3_628_800_000 + 396_361_728 == 5_511_518_208
    assert floor.memory_s == pytest.approx(0.0441759744)
    assert floor.compute_s == pytest.approx(0.027557591)


def test_a_small_model_tied_and_untied_by_hand() -> None:
    assert SMALL.linear_params == 2 * (8 * 4 * 4 + 2 * 4 * 8 + 3 * 8 * 16) == 1152
    floor = forward_floor(SMALL, torch.float32, 3, 5, 1, MACHINE)
    # weights 1152 + head 80 + 3 embedding rows of 8; KV 2·5·2·1·4 = 80 elements
    assert floor.bytes == 4 * (1152 + 80 + 24) + 4 * 80 == 5344
    assert floor.flops == 2 * 1152 * 3 + 4 * 3 * 5 * 2 * 4 * 2 + 2 * 1 * 10 * 8 == 8032
    no_logits = forward_floor(SMALL, torch.float32, 3, 5, 0, MACHINE)  # no head read, no head arithmetic
    assert (no_logits.bytes, no_logits.flops) == (4 * (1152 + 24) + 4 * 80, 2 * 1152 * 3 + 4 * 3 * 5 * 2 * 4 * 2)
    tied = forward_floor(attrs.evolve(SMALL, tied=True), torch.float32, 3, 5, 1, MACHINE)
    assert tied.bytes == 4 * (1152 + 80) + 4 * 80  # the embedding rows are inside the head, read once
    tied_no_logits = forward_floor(attrs.evolve(SMALL, tied=True), torch.float32, 3, 5, 0, MACHINE)
    assert tied_no_logits.bytes == 4 * (1152 + 24) + 4 * 80  # no head read: only the 3 embedding rows


def test_the_floor_is_the_larger_roof() -> None:
    slow_arithmetic = Machine(threads=1, read_bandwidth=1e12, gemm_peak={"float32": 1e9})
    floor = forward_floor(SMOLLM2_135M, torch.float32, 64, 1024, 64, slow_arithmetic)
    assert floor.bound == "compute" and floor.seconds == floor.compute_s > floor.memory_s


def test_the_shape_of_a_real_llama_matches_its_modules() -> None:
    model = random_llama(hidden_size=64, intermediate_size=96, layers=3, heads=4, kv_heads=2, vocab_size=200)
    shape = ModelShape.from_config(model.module.config)
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab) == (3, 64, 96, 4, 2, 16, 200)
    linear = sum(m.weight.numel() for m in model.module.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert shape.linear_params == linear
    assert shape.head_params == model.module.lm_head.weight.numel()


@given(st.integers(1, 64), st.integers(0, 8192), st.integers(0, 64), st.sampled_from(["float32", "bfloat16"]))
def test_more_tokens_cache_or_logits_never_lower_the_floor(tokens: int, cached: int, rows: int, dtype: str) -> None:
    rows = min(rows, tokens)
    base = forward_floor(SMOLLM2_135M, dtype, tokens, cached, rows, MACHINE)
    for more in (forward_floor(SMOLLM2_135M, dtype, tokens + 1, cached, rows, MACHINE),
                 forward_floor(SMOLLM2_135M, dtype, tokens, cached + 1, rows, MACHINE),
                 forward_floor(SMOLLM2_135M, dtype, tokens + 1, cached, rows + 1, MACHINE)):
        assert more.bytes >= base.bytes and more.flops > base.flops and more.seconds >= base.seconds
    assert forward_floor(SMOLLM2_135M, dtype, tokens, cached + 1, rows, MACHINE).bytes > base.bytes  # every slot is read
    half = forward_floor(SMOLLM2_135M, "bfloat16", tokens, cached, rows, MACHINE)
    assert half.bytes <= forward_floor(SMOLLM2_135M, "float32", tokens, cached, rows, MACHINE).bytes / 2 + 1


@pytest.mark.parametrize(("call", "message"), [
    (lambda: forward_floor(SMALL, "float32", 0, 5, 0, MACHINE), "tokens 0 is not allowed"),
    (lambda: forward_floor(SMALL, "float32", 2, -1, 1, MACHINE), "cached -1 is not allowed"),
    (lambda: forward_floor(SMALL, "float32", 2, 5, 3, MACHINE), "logits_rows 3 is not allowed; use an integer from 0 to tokens (2)"),
    (lambda: forward_floor(SMALL, torch.float16, 2, 5, 1, MACHINE), "unknown dtype 'float16'; available: bfloat16, float32"),
    (lambda: forward_floor(SMALL, "bfloat16", 2, 5, 1, Machine(threads=1, read_bandwidth=1.0, gemm_peak={"float32": 1.0})),
     "no GEMM throughput was measured for bfloat16"),
    (lambda: ModelShape(layers=0, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10, tied=False), "layers 0 is not allowed"),
])
def test_bad_floor_inputs_are_one_line_errors(call, message) -> None:
    with pytest.raises(SpecstackError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as error:
        call()
    assert "\n" not in str(error.value)


# -- measuring ------------------------------------------------------------------------------------

def test_the_machine_roofs_are_measured_and_the_peak_is_the_best() -> None:
    machine = measure_machine({"target": SMALL}, [1, 4], bandwidth_mib=64, square=64, min_seconds=0.001, blocks=1)
    assert machine.read_bandwidth > 1e8  # 0.1 GB/s: any machine reads faster
    assert [(g.dtype, g.what, g.rows) for g in machine.gemm] == [
        (d, w, r) for d in ("float32", "bfloat16") for r in (1, 4, 64) for w in ("target layer", "lm head", "square 64")
        if (r == 64) == (w == "square 64")]
    for dtype in ("float32", "bfloat16"):
        assert machine.gemm_peak[dtype] == max(g.flops_per_s for g in machine.gemm if g.dtype == dtype) > 0
    assert machine.threads == torch.get_num_threads()


def test_fill_writes_ascending_positions_without_a_forward() -> None:
    model = random_llama()
    store = model.new_cache(50)
    fill(store, 40, torch.Generator(device="cpu").manual_seed(0))
    assert len(store) == 40 and store.positions.tolist() == list(range(40))
    assert bool((store.keys[:, :, :40] != 0).all()) and bool((store.keys[:, :, 40:] == 0).all())
    assert torch.equal(store.values[0, :, :40], store.values[1, :, :40])


def test_the_tree_is_binary_in_breadth_first_order() -> None:
    parents = tree_parents(5)
    assert parents.tolist() == [-1, -1, 0, 0, 1]
    draft = Draft(tokens=torch.arange(5), probs=torch.zeros(5, 8), parents=parents, kind=DraftKind.TREE_DETERMINISTIC)
    batch = TokenBatch.tree([7], 100, draft)
    assert batch.positions.tolist() == [100, 101, 101, 102, 102, 102] and batch.num_logits == 6


def test_measure_times_every_level_and_rolls_back() -> None:
    target = random_llama(layers=2, max_positions=512)
    draft = random_llama(seed=1, layers=1, hidden_size=32, intermediate_size=64, heads=2, kv_heads=1)
    widths = []

    class Recording:  # the draft, noting each forward's width
        vocab_size, dtype = draft.vocab_size, draft.dtype

        def __getattr__(self, name):
            return getattr(draft, name)

        def forward(self, batch, cache):
            widths.append(len(batch.tokens))
            return draft.forward(batch, cache)

    levels = [Level(name="L2 target+full", role="target", model=target, caches=(16, 40)),
              Level(name="L0 draft+streaming", role="draft", model=Recording(), caches=(24,), relative_positions=True)]
    rows = measure(levels, MACHINE, tokens=(1, 3), tree=True, repeats=2)
    assert widths == [1, 3] * 3 + [3] * 3  # the chains' widths in turn (a warm-up turn and two), then the trees
    assert [(r.level, r.cache, r.tokens, r.tree) for r in rows] == [
        ("L2 target+full", 16, 1, False), ("L2 target+full", 16, 3, False), ("L2 target+full", 16, 3, True),
        ("L2 target+full", 40, 1, False), ("L2 target+full", 40, 3, False), ("L2 target+full", 40, 3, True),
        ("L0 draft+streaming", 24, 1, False), ("L0 draft+streaming", 24, 3, False), ("L0 draft+streaming", 24, 3, True)]
    for row, level in zip(rows, [levels[0]] * 6 + [levels[1]] * 3):
        assert row.seconds > 0 and row.ratio == row.seconds / row.floor.seconds
        assert row.floor == forward_floor(level.shape, torch.float32, row.tokens, row.cache, row.tokens, MACHINE)


def test_each_levels_floor_is_priced_at_the_bandwidth_read_between_its_turns() -> None:
    """measure reads the bandwidth before each timed turn of a level and cache length (not the warm-up turn), and
    prices those forwards' floors at the median of the readings: a reading taken minutes before, or another
    level's, would price them at bandwidth the machine no longer had."""
    target = random_llama(layers=2, max_positions=512)
    events, readings = [], iter([1e9, 5e9, 2e9, 7e9, 8e9, 3e9, 4e9, 9e9, 6e9])

    class Recording:  # the target, noting each forward's width
        vocab_size, dtype, module = target.vocab_size, target.dtype, target.module

        def __getattr__(self, name):
            return getattr(target, name)

        def forward(self, batch, cache):
            events.append(len(batch.tokens))
            return target.forward(batch, cache)

    def bandwidth() -> float:
        events.append("read")
        return next(readings)

    level = Level(name="L2 target+full", role="target", model=Recording(), caches=(16, 40))
    rows = measure([level], MACHINE, tokens=(1, 3), repeats=3, bandwidth=bandwidth)
    turn = ["read", 1, 3]
    assert events == ([1, 3] + turn * 3) * 2  # per cache: a warm-up turn unread, then three read turns
    by_cache = {16: 2e9, 40: 7e9}  # medians of (1, 5, 2) and (7, 8, 3) GB/s
    for row in rows:
        priced = attrs.evolve(MACHINE, read_bandwidth=by_cache[row.cache])
        assert row.read_bandwidth == by_cache[row.cache]
        assert row.floor == forward_floor(level.shape, torch.float32, row.tokens, row.cache, row.tokens, priced)
        assert row.as_dict()["read_bandwidth_gb_s"] == by_cache[row.cache] / 1e9


def test_the_bandwidth_probe_reads_its_buffer_again_at_each_call() -> None:
    probe = BandwidthProbe.of(mib=16, repeats=1)
    assert probe.buffer.numel() * probe.buffer.element_size() == 16 * 2**20 and probe.buffer.dtype == torch.float32
    buffer = probe.buffer.data_ptr()  # made once: each call reads it again, none makes another
    first, second = probe(), probe()
    assert first > 1e8 and second > 1e8 and probe.buffer.data_ptr() == buffer


def test_widths_are_timed_in_turn_and_rolled_back() -> None:
    """time_forwards takes the widths in turn within each repeat (one warm-up turn, then ``repeats``), so that a
    slow spell of the machine falls on every width alike; each forward is rolled back to the cached slots."""
    model = random_llama(layers=1, max_positions=128)
    store = model.new_cache(40)
    fill(store, 24, torch.Generator().manual_seed(0))
    widths = []

    class Recording:  # the model, noting each forward's width
        vocab_size = model.vocab_size

        def forward(self, batch, cache):
            widths.append(len(batch.tokens))
            return model.forward(batch, cache)

    seconds = time_forwards(Recording(), store, cached=24, widths=(1, 3, 5), tree=True, repeats=2, generator=torch.Generator().manual_seed(1))
    assert widths == [1, 3, 5] * 3
    assert sorted(seconds) == [1, 3, 5] and all(s > 0 for s in seconds.values()) and len(store) == 24


def _row(tokens: int, ms: float, *, cache: int = 100, tree: bool = False) -> Row:
    return Row(level="L2 target+full", cache=cache, tokens=tokens, tree=tree, seconds=ms / 1e3,
               floor=Floor(bytes=1.0, flops=1.0, memory_s=1.0, compute_s=0.0))


def test_the_ceiling_prices_chains_from_the_measured_forwards_and_the_line_between_them() -> None:
    """Chains timed at 1, 2 and 4 tokens (10, 12, 20 ms): 3 tokens cost 16 ms, between 2 and 4; at acceptance 0.9
    the best chain is one drafted token, 1.9 x 10 / 12 = 1.583x (two: 2.71 x 10 / 16 = 1.694x; three: 3.439 x 10 / 20 =
    1.72x, the longest measured); at 0.1 none (1.1 x 10 / 12 < 1). Trees, and a cache without a one-token forward, are left out."""
    rows = [_row(1, 10.0), _row(2, 12.0), _row(4, 20.0), _row(2, 11.0, tree=True), _row(2, 30.0, cache=200), _row(4, 50.0, cache=200)]
    assert chain_costs(rows[:3]) == pytest.approx([0.010, 0.012, 0.016, 0.020])
    found = ceilings(rows, acceptances=(0.9, 0.1))
    assert [(c.level, c.cache, c.acceptance) for c in found] == [("L2 target+full", 100, 0.9), ("L2 target+full", 100, 0.1)]
    assert (found[0].gamma, found[0].longest) == (3, True) and found[0].speedup == pytest.approx(3.439 * 10 / 20)
    assert (found[1].gamma, found[1].longest) == (0, False) and found[1].speedup == pytest.approx(1.0)  # 1.1 x 10 / 12 < 1


def test_the_full_levels_ceiling_drafted_by_the_retrieval_level_pays_a_retrieval_step_per_drafted_token() -> None:
    """The full level's chains of 1, 2 and 4 tokens (10, 12, 20 ms) drafted by a retrieval level whose step takes 2 ms:
    a round of m drafted tokens costs c_m + 2 m. At 0.9: one token 1.9 x 10 / 14 = 1.357x, two 2.71 x 10 / 20 = 1.355x,
    three 3.439 x 10 / 26 = 1.323x, so γ 1 (drafting free chose γ 3). The retrieval level's own chains get no drafted
    ceiling, and without its step timed there is none."""
    retrieval = [Row(level="L1 target+retrieval", cache=16, tokens=t, tree=False, seconds=ms / 1e3,
                     floor=Floor(bytes=1.0, flops=1.0, memory_s=1.0, compute_s=0.0)) for t, ms in ((1, 2.0), (2, 3.0))]
    found = ceilings([_row(1, 10.0), _row(2, 12.0), _row(4, 20.0), *retrieval], acceptances=(0.9,))
    drafted = [c for c in found if c.drafted_by]
    assert [(c.level, c.cache, c.drafted_by) for c in drafted] == [("L2 target+full", 100, "L1 target+retrieval")]
    assert drafted[0].gamma == 1 and drafted[0].speedup == pytest.approx(1.9 * 10 / 14)
    free = {c.level: c for c in found if not c.drafted_by}
    assert free["L2 target+full"].gamma == 3 and free["L1 target+retrieval"].speedup == pytest.approx(1.9 * 2 / 3)
    assert not [c for c in ceilings([_row(1, 10.0), _row(2, 12.0)], acceptances=(0.9,)) if c.drafted_by]
    lines = ceiling_lines(found)
    assert lines[-2].startswith("ceiling with each drafted token") and lines[-1].startswith("L2 <- L1") and "γ 1" in lines[-1]


# -- the command ----------------------------------------------------------------------------------

def _args(*flags: str):
    return _parser(["floor"]).parse_args(["floor", *flags])


def test_the_command_reports_each_forward_against_its_floor(capsys, monkeypatch) -> None:
    import specstack.bench.floor as command

    monkeypatch.setattr(command, "measure_machine", lambda shapes, rows: Machine(
        threads=1, read_bandwidth=1e10, gemm_peak={"float32": 1e11, "bfloat16": 2e11}, bandwidth_mib=64,
        gemm=(Gemm(dtype="float32", what="target layer", rows=1, flops_per_s=1e11),)))

    class Probe:  # the bandwidth read between turns: 20 GB/s, twice the machine's reading at the start
        @classmethod
        def of(cls, *, mib):
            assert mib == 64  # the buffer the machine was measured with
            return lambda: 2e10

    monkeypatch.setattr(command, "BandwidthProbe", Probe)
    paired = attrs.evolve(MACHINE, read_bandwidth=2e10)
    levels = [Level(name="L1 target+retrieval", role="target", model=random_llama(), caches=(32,))]
    assert run_floor(_args("--tokens", "1", "2", "--repeats", "1", "--json"), levels) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "float32" and report["machine"]["read_bandwidth_gb_s"] == 10.0
    assert [(r["level"], r["cache"], r["tokens"], r["shape"]) for r in report["rows"]] == [
        ("L1 target+retrieval", 32, 1, "chain"), ("L1 target+retrieval", 32, 2, "chain")]
    for row in report["rows"]:
        assert row["ratio"] == pytest.approx(row["ms"] / row["floor_ms"])
        assert row["floor_ms"] == pytest.approx(1e3 * forward_floor(levels[0].shape, "float32", row["tokens"], 32, row["tokens"], paired).seconds)
        assert row["read_bandwidth_gb_s"] == 20.0
    one, two = (row["ms"] for row in report["rows"])
    assert [c["acceptance"] for c in report["ceilings"]] == [0.7, 0.8, 0.9, 0.95]
    for c in report["ceilings"]:  # the better of the step alone and one drafted token, priced by the two forwards measured
        assert c["speedup"] == pytest.approx(max(1.0, (1 + c["acceptance"]) * one / two)) and c["gamma"] == (c["speedup"] > 1)
    assert run_floor(_args("--tokens", "2", "--repeats", "1", "--tree"), levels) == 0
    out = capsys.readouterr().out
    assert "read bandwidth: 10.0 GB/s" in out
    assert [line.split()[4] for line in out.splitlines() if line.startswith("L1 target+retrieval")] == ["chain", "tree"]
    assert [line.split()[-2] for line in out.splitlines() if line.startswith("L1 target+retrieval")] == ["20.0", "20.0"]
    assert "ceiling" not in out  # chains of one length only: nothing to price


@pytest.mark.parametrize(("flags", "message"), [
    (["--tokens", "0"], "--tokens '0' is not allowed; use an integer >= 1"),
    (["--cache", "1K"], "--cache '1K' is not allowed; use an integer >= 1"),
    (["--repeats", "-2"], "--repeats '-2' is not allowed; use an integer >= 1"),
    (["--threads", "0"], "--threads '0' is not allowed; use an integer >= 1"),
    (["--budget", "x"], "--budget 'x' is not allowed; use an integer >= 1"),
    (["--dtype", "float16"], "unknown dtype 'float16'; available: bfloat16, float32"),
    (["--levels", "full", "middle"], "unknown level 'middle'; available: full, retrieval, draft"),
    (["--levels", "full", "draft", "--budget", "256"],
     "--budget 256 sizes the retrieval level, which --levels full draft leaves out; add retrieval or drop --budget"),
    (["--levels", "retrieval", "--window", "64"], "--window 64 sizes the draft level, which --levels retrieval leaves out; add draft or drop --window"),
    (["--tree", "--tokens", "1"], "--tree times token trees of 2 tokens or more, and --tokens 1 has none; add one or drop --tree"),
    (["--widen-bf16"], "--widen-bf16 widens bf16 products, and --dtype float32 has none; add --dtype bfloat16 or drop --widen-bf16"),
])
def test_bad_input_exits_2_with_one_line_before_any_weights_are_read(capsys, monkeypatch, flags, message) -> None:
    import specstack.bench.floor as command

    monkeypatch.setattr(command, "default_levels", lambda opts: pytest.fail("weights were read"))
    assert main(["floor", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"specstack floor: error: {message}" in err


@pytest.mark.real_model
def test_the_command_runs_on_the_embedded_default(capsys) -> None:
    assert main(["floor", "--cache", "64", "--tokens", "1", "2", "--repeats", "1", "--levels", "full", "draft", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["models"]["target"]["layers"] == 30 and report["models"]["draft"]["layers"] == 1
    assert [(r["level"], r["cache"], r["tokens"]) for r in report["rows"]] == [
        ("L2 target+full", 64, 1), ("L2 target+full", 64, 2), ("L0 draft+streaming", 272, 1), ("L0 draft+streaming", 272, 2)]
    target_1 = report["rows"][0]
    # the layers read as Q4_1 blocks (0.75 bytes a weight), the LM head as Q8_0 (1.125), the fp32 cache (4)
    assert target_1["bytes"] == 0.75 * 106_168_320 + 1.125 * 28_311_552 + 4 * 2 * 64 * 30 * 3 * 64
    for row in report["rows"]:
        assert row["ms"] > 0 and row["ratio"] == pytest.approx(row["ms"] / row["floor_ms"])
        assert row["ratio"] > 0.2  # nothing runs five times faster than its floor; more means the formula is wrong


@pytest.mark.real_model
def test_a_cache_beyond_the_target_context_is_a_one_line_error(capsys) -> None:
    assert main(["floor", "--cache", "8190", "--tokens", "1", "4", "--levels", "full"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("specstack floor: error: L2 target+full: 8190 cached + 4 new tokens exceed the model's 8192 "
                                    "positions; use a shorter --cache or fewer --tokens")
    assert "Traceback" not in err


def test_bf16s_peak_is_at_least_fp32s() -> None:
    """Where bf16 GEMMs are emulated (slower than fp32), the kernels widen bf16 to fp32: the floor takes fp32's rate."""
    emulated = Machine(threads=1, read_bandwidth=1e10, gemm_peak={"float32": 1e11, "bfloat16": 2e10})
    assert emulated.peak(torch.bfloat16) == 1e11 and emulated.peak("float32") == 1e11
    assert MACHINE.peak("bfloat16") == 2e11  # faster bf16 products keep their own rate


def test_widen_bf16_widens_the_target_the_command_loads(monkeypatch) -> None:
    """--widen-bf16: the target's products widened before anything is timed (HFCausalLM.widen_bf16_products); unset, not."""
    import specstack.models
    from specstack.bench.floor import default_levels, options
    from specstack.hf import HFCausalLM

    target = random_llama()
    widened = []
    monkeypatch.setattr(specstack.models, "load_target", lambda **kwargs: (target, None))
    monkeypatch.setattr(HFCausalLM, "widen_bf16_products", lambda self: widened.append(self))
    for flags, expected in [((), []), (("--widen-bf16",), [target])]:
        widened.clear()
        levels = default_levels(options(_args("--levels", "full", "--cache", "32", "--tokens", "1", "--dtype", "bfloat16", *flags)))
        assert [level.model for level in levels] == [target] and widened == expected
