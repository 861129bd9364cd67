"""The demo: a three-level stack against autoregressive decoding, on identical input."""

from __future__ import annotations

from .registry import Registry
from .policies import StreamingLLM
from .stack import Level, SpeculationStack
from .synthetic import SyntheticLM


def synthetic_demo(*, max_new_tokens: int, seed: int) -> None:
    """TriForce's shape on synthetic models: small draft + StreamingLLM -> mid model -> target."""
    target = SyntheticLM(vocab_size=32, seed=seed, sharpness=3.0)
    middle = SyntheticLM(vocab_size=32, seed=seed + 1, base=target, noise=0.3)
    small = SyntheticLM(vocab_size=32, seed=seed + 2, base=target, noise=0.8)
    prompt = list(range(1, 17))
    reference = Registry.create().stack("autoregressive", target=target).generate(prompt, max_new_tokens)
    stack = SpeculationStack.build(
        [Level(model=small, policy=StreamingLLM(sinks=4, window=16), name="draft+streaming"),
         Level(model=middle, gamma=2, name="middle"),
         Level(model=target, gamma=6, name="target")],
    )
    result = stack.generate(prompt, max_new_tokens)
    print(f"synthetic models, vocabulary 32, prompt {len(prompt)} tokens, {max_new_tokens} new tokens, greedy")
    for level in result.levels[1:]:
        print(f"  {level.name:<16} acceptance {level.acceptance_rate:.3f} ({level.accepted}/{level.drafted} drafted tokens, {level.rounds} rounds)")
    print(f"  target forward passes: {result.levels[-1].forward_calls} (autoregressive: {reference.levels[-1].forward_calls})")
    print(f"  output identical to autoregressive greedy: {result.tokens == reference.tokens}")
