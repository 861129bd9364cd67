"""Random synthetic stacks for the property tests."""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

from specstack import Level, PromptLookupDrafter, SamplingConfig, SpeculationStack, StreamingLLM
from specstack.synthetic import SyntheticLM


@attrs.frozen(kw_only=True)
class StackCase:
    vocab: int
    depth: int
    gammas: tuple[int, ...]
    noises: tuple[float, ...]
    lookup_base: bool
    streaming_base: bool
    sampling: SamplingConfig
    stop_token: int | None
    seed: int

    def target(self, device: str = "cpu") -> SyntheticLM:
        return SyntheticLM(vocab_size=self.vocab, seed=self.seed, sharpness=1.5, device=device)

    def levels(self, device: str = "cpu") -> list[Level]:
        target = self.target(device)
        models = [SyntheticLM(vocab_size=self.vocab, seed=self.seed + 1 + i, base=target, noise=noise, device=device) for i, noise in enumerate(self.noises)]
        if self.lookup_base:
            base = Level(drafter=PromptLookupDrafter(vocab=self.vocab))
        else:
            policy = StreamingLLM(sinks=1, window=3) if self.streaming_base else None
            base = Level(model=models[0], **({"policy": policy} if policy else {}))
        middle = [Level(model=m, gamma=g) for m, g in zip(models[1:], self.gammas[:-1])]
        return [base, *middle, Level(model=target, gamma=self.gammas[-1])]

    def stack(self, device: str = "cpu") -> SpeculationStack:
        stops = () if self.stop_token is None else (self.stop_token,)
        return SpeculationStack.build(self.levels(device), sampling=self.sampling, stop_tokens=stops, seed=self.seed)


@st.composite
def stack_cases(draw, *, temperatures=(0.0, 0.5, 1.0, 1.5), depths=(2, 3, 4)) -> StackCase:
    vocab = draw(st.integers(3, 5))
    depth = draw(st.sampled_from(depths))
    top_k = draw(st.sampled_from([None, None, 2, 3]))
    top_p = draw(st.sampled_from([1.0, 1.0, 0.9, 0.6]))
    return StackCase(
        vocab=vocab,
        depth=depth,
        gammas=(*(draw(st.integers(0, 6)) for _ in range(depth - 2)), draw(st.integers(1, 6))),  # γ 0 below the top: that level decodes alone
        noises=tuple(draw(st.sampled_from([0.0, 0.3, 1.0, 3.0])) for _ in range(depth - 1)),
        lookup_base=draw(st.booleans()),
        streaming_base=draw(st.booleans()),
        sampling=SamplingConfig(temperature=draw(st.sampled_from(temperatures)), top_p=top_p, top_k=top_k),
        stop_token=draw(st.sampled_from([None, None, 0])),
        seed=draw(st.integers(0, 10_000)),
    )
