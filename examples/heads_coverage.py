"""How much of the target's next-token distribution a chained head's first step covers with its top k candidates,
against the most any k candidates could cover (the target's own top k): the headroom a better drafter has.

Continuations of ``--prompts`` 64-token prompts from a held-out book, written by the fp32 target (greedy, or sampled at
T), are read back by it; at each position t the head's step 1 reads h_t and the embedding of x_{t+1} and ranks
candidates for x_{t+2}. Coverage is the target's probability (at T; at T = 0 one-hot on its argmax) summed over the
head's top k; the oracle sums the target's own top k. At T > 0 it also gives, per ``--draft-temperatures`` τ, how often
the verifier would accept candidates *drawn* from the head's softmax(logits / τ) (``-o draft_temperature=τ``): k draws
without replacement, accepted by Sequoia's rule (for one draw, sum_x min(p(x), q(x))), one set of draws per position.

    python examples/heads_coverage.py                                   # the shipped chained heads (docs/medusa.md)
    python examples/heads_coverage.py --heads /tmp/heads.safetensors --temperatures 0.6
"""

from __future__ import annotations

import argparse

import torch

from specstack.data import book_tokens
from specstack.models import load_target
from specstack.sampling import draw_without_replacement
from specstack.verify import SequoiaVerifier
from specstack_medusa.heads import load_heads


@torch.inference_mode()
def continuations(model, prompts: torch.Tensor, new: int, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """[N, P] prompts -> [N, P + new] tokens, each drawn from the fp32 target (argmax at T = 0)."""
    rows, past, step = prompts, None, prompts
    for _ in range(new):
        out = model(input_ids=step, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()  # [N, V]
        if temperature == 0:
            step = logits.argmax(-1, keepdim=True)  # [N, 1]
        else:
            step = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)  # [N, 1]
        rows = torch.cat([rows, step], 1)
    return rows


@torch.inference_mode()
def coverage(model, heads, rows: torch.Tensor, first: int, temperature: float, ks: list[int], draft_temperatures: list[float],
             generator: torch.Generator) -> tuple[dict[int, tuple[float, float]], dict[tuple[float, int], float]]:
    """k -> (the head's step-1 coverage, the oracle's), and (τ, k) -> the acceptance of k candidates drawn at τ (T > 0
    only), averaged over positions ``first`` … of ``rows`` [N, L]."""
    embedding, unembed = model.get_input_embeddings().weight, model.lm_head.weight.float().T  # [V, H], [H, V]
    hidden = model.model(input_ids=rows).last_hidden_state  # [N, L, H]
    logits = model.lm_head(hidden).float()  # [N, L, V]
    sums = {k: [0.0, 0.0] for k in ks}
    drawn = {(tau, k): 0.0 for tau in (draft_temperatures if temperature > 0 else []) for k in ks}
    count = 0
    for t in range(first, rows.shape[1] - 2):
        head = heads.step(hidden[:, t].float(), embedding[rows[:, t + 1]].float()) @ unembed  # [N, V]
        ranked = head.topk(max(ks), -1).indices  # [N, k]
        target = logits[:, t + 1]  # [N, V]: the target's distribution of x_{t+2}
        p = torch.softmax(target / temperature, -1) if temperature > 0 else torch.nn.functional.one_hot(target.argmax(-1), target.shape[-1]).float()
        best = p.topk(max(ks), -1).values  # [N, k]
        for k in ks:
            sums[k][0] += p.gather(1, ranked[:, :k]).sum().item()
            sums[k][1] += best[:, :k].sum().item()
        for tau, k in drawn:
            drawn[tau, k] += drawn_acceptance(p, torch.softmax(head / tau, -1), k, generator)
        count += rows.shape[0]
    return {k: (a / count, b / count) for k, (a, b) in sums.items()}, {key: total / count for key, total in drawn.items()}


def drawn_acceptance(p: torch.Tensor, q: torch.Tensor, k: int, generator: torch.Generator) -> float:
    """[N, V] target and head distributions -> the summed chance that Sequoia's rule accepts one of k candidates drawn
    from q without replacement (as the drafter draws them), one set of draws per row."""
    rule = SequoiaVerifier()
    return sum(float(rule.step(p[n], q[n], draw_without_replacement(q[n], k, generator)).accept.sum()) for n in range(p.shape[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="chained", help="a chained heads file, or a shipped name (default: chained)")
    parser.add_argument("--book", default="prideprejudice")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new", type=int, default=160)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6])
    parser.add_argument("--draft-temperatures", type=float, nargs="+", default=[0.6, 0.8, 1.0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(dtype=torch.float32)
    model, heads = target.module, load_heads(args.heads)
    if not heads.info.chained:
        raise SystemExit(f"{args.heads} holds parallel heads; this measures a chained head's first step")
    tokens = torch.tensor(book_tokens(tokenizer, 60000, name=args.book))
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(tokens) - 300, (args.prompts,), generator=generator)
    prompts = torch.stack([tokens[s : s + 64] for s in starts])  # [N, 64]
    for temperature in args.temperatures:
        rows = continuations(model, prompts, args.new, temperature, generator)
        print(f"T = {temperature}: the head's top-k coverage of the target's distribution (the most any k cover)"
              + (f"; k candidates drawn at τ = {', '.join(map(str, args.draft_temperatures))}, accepted" if temperature > 0 else ""))
        ranked, drawn = coverage(model, heads, rows, prompts.shape[1], temperature, [1, 2, 3, 4], args.draft_temperatures, generator)
        for k, (head, oracle) in ranked.items():
            print(f"  k = {k}: {head:.3f} ({oracle:.3f})" + "".join(f"  {drawn[tau, k]:.3f}" for tau in args.draft_temperatures if (tau, k) in drawn))


if __name__ == "__main__":
    main()
