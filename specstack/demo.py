"""The demo: a three-level stack against autoregressive decoding, on identical input."""

from __future__ import annotations

import torch

from .registry import Registry
from .policies import StreamingLLM
from .stack import Level, SpeculationStack
from .synthetic import SyntheticLM


def synthetic_demo(*, max_new_tokens: int, seed: int, device: str = "cpu", draft_device: str | None = None) -> None:
    """TriForce's shape on synthetic models: small draft + StreamingLLM -> mid model -> target; the
    target and the middle model on ``device``, the draft on ``draft_device`` (default: ``device``)."""
    from .run import check_devices

    device, draft_device = check_devices(device, draft_device)
    target = SyntheticLM(vocab_size=32, seed=seed, sharpness=3.0, device=device)
    middle = SyntheticLM(vocab_size=32, seed=seed + 1, base=target, noise=0.3, device=device)
    small = SyntheticLM(vocab_size=32, seed=seed + 2, base=target, noise=0.8, device=draft_device)
    prompt = list(range(1, 17))
    reference = Registry.create().stack("autoregressive", target=target).generate(prompt, max_new_tokens)
    stack = SpeculationStack.build(
        [Level(model=small, policy=StreamingLLM(sinks=4, window=16), name="draft+streaming"),
         Level(model=middle, gamma=2, name="middle"),
         Level(model=target, gamma=6, name="target")],
    )
    result = stack.generate(prompt, max_new_tokens)
    where = f"on {device}" + (f", the draft on {draft_device}" if draft_device != device else "")
    print(f"synthetic models, vocabulary 32, prompt {len(prompt)} tokens, {max_new_tokens} new tokens, greedy, {where}")
    for level in result.levels[1:]:
        print(f"  {level.name:<16} acceptance {level.acceptance_rate:.3f} ({level.accepted}/{level.drafted} drafted tokens, {level.rounds} rounds)")
    print(f"  target forward passes: {result.levels[-1].forward_calls} (autoregressive: {reference.levels[-1].forward_calls})")
    print(f"  output identical to autoregressive greedy: {result.tokens == reference.tokens}")


def triforce_demo(args) -> int:
    """The README's main job: a stack against autoregressive decoding on the embedded default,
    same prompt, same process; prints the speedup, per-level acceptance and whether outputs match."""
    from . import run

    session = run.Session.open(args)
    prompt = session.prompt_tokens(prompt=None, prompt_file=None, book="prideprejudice", length=args.prompt_tokens)
    sampling = session.sampling
    print(f"target {session.target.name}, prompt: Pride and Prejudice, {len(prompt)} tokens; {args.max_new_tokens} new tokens; "
          f"temperature {sampling.temperature}, top_p {sampling.top_p}, top_k {sampling.top_k}; torch threads {torch.get_num_threads()}; "
          f"device {session.target.device}")
    baseline = session.stack("autoregressive", [])
    ours = session.stack(args.stack, args.option)
    reference = baseline.generate(prompt, args.max_new_tokens, seed=args.seed, progress=run.progress_printer("autoregressive"))
    result = ours.generate(prompt, args.max_new_tokens, seed=args.seed, progress=run.progress_printer(args.stack))
    print(f"autoregressive: {run.summary(reference)}")
    print(f"{args.stack}: {run.summary(result)}")
    speedup = reference.seconds / len(reference.tokens) / (result.seconds / len(result.tokens))
    print(f"speedup over autoregressive decoding (decode time per token, same process): {speedup:.2f}x")
    if sampling.greedy:
        print(f"outputs identical token for token: {result.tokens == reference.tokens}")
    else:
        print("outputs sampled with the same seed differ by design; both follow the target's distribution")
    print("text:", session.tokenizer.decode(list(result.tokens))[:400].replace("\n", " "))
    return 0
