"""bf16: every registered stack's greedy output, certified against bf16 autoregressive decoding.

In bf16 a T-token verify and a 1-token step round differently, so a stack's greedy output may leave
autoregressive decoding's at a near-tie. ``specstack.testing.certificate`` checks that the first such
divergence is one: the margin between the two tokens in autoregressive decoding's own logits is at
most twice the difference measured between T-token and 1-token logits there. Bit-exact equality is
tested in fp32 (test_real_model.py), and in bf16 for every stack, greedy and coupled sampling, with the target's
products widened (below: HFCausalLM.widen_bf16_products, what a CPU without faster bf16 paths takes anyway); docs/exactness.md states the guarantee.

The certificate must also fail on broken components: a verifier that emits the second-best token, a
target that hands a verifying level its logits one row off, a cache that is not rolled back.

Sizes: 28 generations (every stack, two prompts) each prefill their prompt in bf16, and on a CPU
without avx512_bf16 (this project's machine today) a bf16 forward of T tokens costs about T one-token
steps: a 256-token prefill takes seconds. So the book prompt is 256 tokens, not the thousands
TriForce is for, and 32 tokens are generated; both still show bf16 divergences. The module takes
minutes, not seconds (docs/exactness.md).
"""

from __future__ import annotations

import inspect
from typing import ClassVar

import attrs
import pytest
import torch

from specstack import Kind, Registry, SamplingConfig, SpeculationStack
from specstack.data import book_tokens
from specstack.errors import SpecstackError
from specstack.hf import HFCausalLM
from specstack.kvstore import KVStore
from specstack.testing.certificate import GreedyReference
from specstack.types import Draft, Verdict
from specstack.verify import GreedyVerifier

pytestmark = pytest.mark.real_model

NEW_TOKENS = 32
BOOK_TOKENS, BOOK_OFFSET = 256, 50_000  # Pride and Prejudice, chapter 21; short: see the module docstring
HELD_OUT = """<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
This Python function should merge overlapping intervals, but it is wrong for some inputs:

def merge(intervals):
    intervals.sort()
    out = [intervals[0]]
    for start, end in intervals[1:]:
        if start < out[-1][1]:
            out[-1][1] = end
        else:
            out.append([start, end])
    return out

merge([[1, 4], [2, 3]]) returns [[1, 3]] instead of [[1, 4]], and merge([[1, 2], [2, 5]]) returns two
intervals. Explain both bugs briefly and give a corrected version.<|im_end|>
<|im_start|>assistant
"""  # a chat turn about code: no Austen, no prose of the kind the draft was distilled on
PROMPTS = ("austen", "held-out")

# Every registered stack, plugins' included (Sequoia's token trees). A recipe whose options lack a
# default cannot be built here and is skipped with its name; today none is.
STACKS = Registry.create().names(Kind.STACK)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: on the shared 2-core machine a second one mostly waits on other processes
    (two of these tests took 58 s with one thread and 130 s with two, at a load of 5)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    from specstack.models import load_default

    return load_default(dtype=torch.bfloat16)  # target, draft, tokenizer


@pytest.fixture(scope="module")
def prompts(models) -> dict[str, list[int]]:
    tokenizer = models[2]
    return {"austen": book_tokens(tokenizer, BOOK_TOKENS, offset=BOOK_OFFSET), "held-out": tokenizer(HELD_OUT).input_ids}


@pytest.fixture(scope="module")
def widened_models():
    """The embedded default in bf16 with its target's products widened (HFCausalLM.widen_bf16_products): the same
    weights as ``models``, a second copy, so that the certificate tests above keep the kernels this CPU chose."""
    from specstack.models import load_default

    target, draft, tokenizer = load_default(dtype=torch.bfloat16)
    target.widen_bf16_products()
    return target, draft, tokenizer


@pytest.fixture(scope="module")
def references(models, prompts):
    return references_of(models, prompts)


@pytest.fixture(scope="module")
def widened_references(widened_models, prompts):
    return references_of(widened_models, prompts)


@pytest.fixture(scope="module")
def outputs(models, prompts, references):
    return outputs_of(models, prompts, references)


@pytest.fixture(scope="module")
def widened_outputs(widened_models, prompts, widened_references):
    return outputs_of(widened_models, prompts, widened_references)


def references_of(models, prompts):
    """Per prompt, bf16 autoregressive decoding (the registered stack), replayed on demand; the
    stacks that decoded them are kept in ``references.stacks`` (their target prefill is shared below)."""
    made: dict[str, GreedyReference] = {}
    stacks: dict[str, SpeculationStack] = {}

    def reference(kind: str) -> GreedyReference:
        if kind not in made:
            stacks[kind] = Registry.create().stack("autoregressive", target=models[0])
            tokens = stacks[kind].generate(prompts[kind], NEW_TOKENS).tokens
            made[kind] = GreedyReference(models[0], prompts[kind], tokens, decoded_by=stacks[kind])  # copies its prefill
        return made[kind]

    reference.stacks = stacks
    return reference


def outputs_of(models, prompts, references):
    """Per stack and prompt, its bf16 greedy output (computed once, shared by the tests below);
    the autoregressive stack's is the one its reference was made from."""
    made: dict[tuple[str, str], tuple[int, ...]] = {}

    def output(name: str, kind: str) -> tuple[int, ...]:
        if name == "autoregressive":
            return tuple(references(kind).tokens)
        if (name, kind) not in made:
            stack = build(name, models, len(prompts[kind]))
            references(kind)
            shared = stack.share_prefill(references.stacks[kind], prompts[kind])  # the same one-chunk prefill, copied
            made[name, kind] = stack.generate(prompts[kind], NEW_TOKENS, reuse_cache=shared).tokens
        return made[name, kind]

    return output


def small_options(recipe, context: int) -> dict[str, object]:
    """Options that keep a stack quick on a short prompt: a retrieval budget a quarter of the context
    (re-gathered every 16 tokens), StreamingLLM windows of 128; the rest as registered."""
    wanted = {"budget": context // 32 * 8, "stride": 16, "window": 128, "draft_window": 128}
    return {key: value for key, value in wanted.items() if key in recipe.options()}


def build(name: str, models, context: int, sampling: SamplingConfig | None = None):
    registry = Registry.create()
    recipe = registry.stack_recipe(name)
    missing = [key for key, default in recipe.options().items() if default is inspect.Parameter.empty]
    if missing:
        pytest.skip(f"stack '{name}' needs options without a default: {', '.join(missing)}")
    target, draft, _ = models
    with_draft = {"draft": draft} if recipe.needs_draft else {}
    return registry.stack(name, target=target, sampling=sampling, **with_draft, **small_options(recipe, context))


@pytest.mark.parametrize("kind", PROMPTS)
@pytest.mark.parametrize("name", STACKS)
def test_bf16_greedy_output_is_certified(references, outputs, name, kind) -> None:
    certificate = references(kind).certify(outputs(name, kind))
    print(f"{name} on {kind}: {certificate.describe()}")
    assert certificate.holds, f"{name} on {kind}: {certificate.describe()}"


# Where the target's bf16 products are widened (chosen on a CPU where that pays, or asked for with
# HFCausalLM.widen_bf16_products: no bf16 dot products, no AMX tiles), every token of a verify, a chain's or a token
# tree's, gets the one-token step's logits bit for bit (tests/test_decode_attention.py), so every stack writes exactly
# autoregressive decoding's output.
@pytest.mark.parametrize("kind", PROMPTS)
@pytest.mark.parametrize("name", STACKS)
def test_with_its_products_widened_every_stack_writes_autoregressive_decodings_output(widened_references, widened_outputs, name, kind) -> None:
    certificate = widened_references(kind).certify(widened_outputs(name, kind))
    assert certificate.diverged_at is None, f"{name} on {kind}: {certificate.describe()}"


COUPLED = SamplingConfig(temperature=0.6, coupled=True)


@pytest.fixture(scope="module")
def coupled_reference(widened_models, prompts):
    """Coupled autoregressive sampling at T = 0.6, seed 3, on the held-out prompt by the widened target, and its stack
    (its cache then holds the prompt)."""
    stack = Registry.create().stack("autoregressive", target=widened_models[0], sampling=COUPLED)
    return stack, stack.generate(prompts["held-out"], NEW_TOKENS, seed=3).tokens


@pytest.mark.parametrize("name", STACKS)
def test_with_its_products_widened_every_coupled_stack_samples_autoregressive_samplings_text(widened_models, prompts, coupled_reference, name) -> None:
    """Sampling too: every position's draw is fixed by the seed (docs/exactness.md, "Coupled sampling"), and every verify
    gives each token the step's logits bit for bit, so in bf16 each stack samples coupled autoregressive sampling's
    text at T = 0.6, token for token, trees included."""
    reference_stack, reference = coupled_reference
    stack = build(name, widened_models, len(prompts["held-out"]), sampling=COUPLED)
    shared = stack.share_prefill(reference_stack, prompts["held-out"])
    assert stack.generate(prompts["held-out"], NEW_TOKENS, seed=3, reuse_cache=shared).tokens == reference


def test_identical_output_passes_trivially(references) -> None:
    reference = references("held-out")
    certificate = reference.certify(reference.tokens)
    assert certificate.diverged_at is None and certificate.holds
    assert certificate.describe() == "identical to autoregressive decoding"


def test_the_replay_reproduces_autoregressive_decoding(references) -> None:
    """Every token autoregressive decoding emitted is the argmax of the replayed l1 (raises otherwise)."""
    reference = references("held-out")
    assert reference.logits(len(reference.tokens) - 1).argmax() == reference.tokens[-1]


def test_a_replay_that_copies_the_prefill_computes_the_logits_of_one_that_pays_it(models, prompts, references) -> None:
    """The replay given the autoregressive stack's prefilled cache (as the demo does) replays the same logits,
    bit for bit, as one that prefills the prompt itself, in the same chunks."""
    copied = references("austen")
    paid = GreedyReference(models[0], prompts["austen"], copied.tokens)
    for i in range(len(copied.tokens)):
        assert torch.equal(copied.logits(i), paid.logits(i)), f"generated token {i}"


def test_a_replay_copies_only_a_prefill_made_in_its_own_chunks(models, prompts, references) -> None:
    copied = references("austen")
    with pytest.raises(SpecstackError, match="prefilled in chunks of 64 tokens"):
        GreedyReference(models[0], prompts["austen"], copied.tokens, prefill_chunk=64, decoded_by=references.stacks["austen"])


# -- the certificate fails on broken components ----------------------------------------------------------


@attrs.define(eq=False)
class SecondBest(GreedyVerifier):
    """Greedy verification, except that generated token ``at`` becomes ``token`` (a second-best one)."""

    name: ClassVar[str] = "second-best"
    at: int
    token: int
    emitted: int = 0

    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Verdict:
        verdict = super().verify(draft, p, generator)
        offset = self.at - self.emitted  # where the replaced token falls in this round's output
        self.emitted += verdict.num_accepted + 1
        if 0 <= offset <= verdict.num_accepted:
            return Verdict(accepted=verdict.accepted[:offset], next_token=self.token, bonus=False)
        return verdict


def first_divergence(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_the_certificate_fails_when_the_verifier_accepts_the_second_best_token(models, prompts, references, outputs) -> None:
    """At the token autoregressive decoding was surest of, before the honest stack's own first divergence."""
    reference = references("held-out")
    flip = first_divergence(reference.tokens, outputs("prompt-lookup", "held-out"))  # the honest stack's own
    if flip == 0:
        pytest.skip("honest prompt lookup leaves autoregressive decoding at its first token: no earlier token to break")
    margins = [float(-torch.diff(reference.logits(i).topk(2).values)) for i in range(flip)]
    at = max(range(flip), key=margins.__getitem__)
    token = int(reference.logits(at).topk(2).indices[1])
    registry = Registry.create()
    levels = registry.stack_recipe("prompt-lookup").levels(registry, target=models[0])
    stack = SpeculationStack.build(levels, verifier=SecondBest(at=at, token=token))
    certificate = reference.certify(stack.generate(prompts["held-out"], NEW_TOKENS).tokens)
    print(certificate.describe())
    assert (certificate.diverged_at, certificate.stack_token, certificate.margin) == (at, token, margins[at])
    assert not certificate.holds, certificate.describe()


def test_the_certificate_fails_when_verify_logits_are_one_row_off(models, prompts, references, outputs) -> None:
    """The target's multi-token forwards return the logits of the next position in each row."""
    target = models[0]
    forward = HFCausalLM.forward

    def shifted(self, batch, cache):
        logits = forward(self, batch, cache)  # [num_logits, V]
        return torch.cat([logits[1:], logits[-1:]]) if self is target and logits.shape[0] > 1 else logits

    certificate = broken_certificate(models, prompts, references, outputs, HFCausalLM, "forward", shifted)
    assert not certificate.holds, certificate.describe()


def test_the_certificate_fails_when_rejected_tokens_stay_in_the_cache(models, prompts, references, outputs) -> None:
    """The KV store ignores every rollback but a reset, so rejected draft tokens stay visible."""
    truncate = KVStore.truncate

    def stale(self, position: int) -> None:
        if position == 0:
            truncate(self, position)

    certificate = broken_certificate(models, prompts, references, outputs, KVStore, "truncate", stale)
    assert not certificate.holds, certificate.describe()


def broken_certificate(models, prompts, references, outputs, owner, attribute: str, broken):
    """The certificate of prompt lookup on the held-out prompt with ``owner.attribute`` replaced by
    ``broken``; skipped if the honest stack's own rounding flip comes first (the break is then unseen)."""
    reference = references("held-out")  # replayed outside the patch below
    honest = outputs("prompt-lookup", "held-out")
    stack = build("prompt-lookup", models, len(prompts["held-out"]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(owner, attribute, broken)
        output = stack.generate(prompts["held-out"], NEW_TOKENS).tokens
    flip = first_divergence(honest, reference.tokens)  # the honest stack's own first divergence
    if output[: flip + 1] == honest[: flip + 1]:
        pytest.skip(f"the honest stack's own bf16 flip at token {flip} comes before the break shows")
    certificate = reference.certify(output)
    print(certificate.describe())
    return certificate
