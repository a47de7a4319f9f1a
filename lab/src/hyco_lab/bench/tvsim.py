"""Distance from plain sampling without a server: the plugin's acceptance core on a fixture verifier.

A few prompts, many seeds: the first ``positions`` tokens are drawn (a) by plain sampling from the
verifier's p̃ (T, top-k, top-p: ``vllm_hyco.spec_decode.sampling.sampling_probs``, vLLM's sampler) and
(b) by tree decoding: each round drafts a tree from the committed context (the verifier's own greedy
chain, ``depth`` deep, plus the runner-ups of the root: HyCo's tree shape without the SLM), samples ŷ at
every node from p̃ and lets ``vllm_hyco.spec_decode.acceptance.select_path`` decide at the given ε
(None: exact), then commits the path and the bonus. ``quality.tv_check`` compares the two.

Exact verification must stay within the plain-vs-plain noise bound; ε = 0.001 accepts the greedy chain
almost always (its tokens hold at least ε of p̃), so the committed tokens drift toward the argmax and the
same measure flags it (tests/unit/test_bench_quality.py).

``logits_fn(context) -> [V]`` is any next-token model; :func:`hf_logits_fn` wraps a transformers causal
LM (the fixture verifier). Contexts are memoized, so many seeds cost few forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_hyco.spec_decode.acceptance import select_path
from vllm_hyco.spec_decode.sampling import sample_rows, sampling_probs

T1 = {"temperature": 1.0, "top_k": 64, "top_p": 0.95}


class MemoProbs:
    """p̃(context) [V] with the sampling settings, memoized by context."""

    def __init__(self, logits_fn: Callable[[Sequence[int]], torch.Tensor], sampling: dict = T1):
        self.logits_fn, self.sampling, self.cache = logits_fn, dict(sampling), {}

    def __call__(self, context: Sequence[int]) -> torch.Tensor:
        key = tuple(context)
        if key not in self.cache:
            logits = self.logits_fn(list(key)).float().reshape(1, -1)
            s = self.sampling
            self.cache[key] = sampling_probs(logits, s["temperature"], s["top_k"], s["top_p"])[0]
        return self.cache[key]


def hf_logits_fn(model) -> Callable[[Sequence[int]], torch.Tensor]:
    """Next-token logits of a transformers causal LM (fp32, no grad) for one context."""
    @torch.no_grad()
    def fn(context: Sequence[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([list(context)])).logits[0, -1]
    return fn


def plain_samples(probs: MemoProbs, prompt: Sequence[int], n: int, positions: int, seed: int
                  ) -> list[tuple[int, ...]]:
    """``n`` continuations of ``positions`` tokens sampled one by one from p̃ (seeds seed .. seed+n-1)."""
    out = []
    for i in range(n):
        gen, ctx = torch.Generator().manual_seed(seed + i), list(prompt)
        for _ in range(positions):
            ctx.append(int(sample_rows(probs(ctx)[None], gen)[0]))
        out.append(tuple(ctx[len(prompt):]))
    return out


def draft_tree(probs: MemoProbs, context: Sequence[int], depth: int, siblings: int
               ) -> tuple[list[int], list[int]]:
    """(tokens, parents): root = the last committed token; the greedy chain of p̃ ``depth`` deep; the
    root's next ``siblings`` most likely tokens as runner-up children."""
    ctx = list(context)
    tokens, parents = [ctx[-1]], [-1]
    top = torch.topk(probs(ctx), siblings + 1).indices.tolist()
    for d in range(depth):
        tok = int(torch.argmax(probs(ctx)))
        tokens.append(tok)
        parents.append(len(tokens) - 2 if d else 0)
        ctx.append(tok)
    for tok in top[1:]:
        tokens.append(int(tok))
        parents.append(0)
    return tokens, parents


def tree_samples(probs: MemoProbs, prompt: Sequence[int], n: int, positions: int, seed: int,
                 epsilon: float | None, depth: int = 3, siblings: int = 3) -> list[tuple[int, ...]]:
    """``n`` continuations decoded with trees and ``select_path`` at ``epsilon`` (None: exact)."""
    out = []
    for i in range(n):
        gen, ctx = torch.Generator().manual_seed(seed + i), list(prompt)
        while len(ctx) - len(prompt) < positions:
            tokens, parents = draft_tree(probs, ctx, depth, siblings)
            rows = []
            for r in range(len(tokens)):  # p̃ at each node: the committed context + its path
                path, cur = [], r
                while cur > 0:
                    path.append(tokens[cur])
                    cur = parents[cur]
                rows.append(probs(ctx + path[::-1]))
            p = torch.stack(rows)
            samples = sample_rows(p, gen)
            path, bonus = select_path(tokens, parents, p, samples, epsilon)
            ctx += [tokens[r] for r in path] + [int(bonus)]
        out.append(tuple(ctx[len(prompt):len(prompt) + positions]))
    return out
