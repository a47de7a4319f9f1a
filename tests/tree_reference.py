"""The engine's former per-tree decision, kept as a test oracle and as the "before" of benchmarks/bench_verify_host.py.

Until the device-batched path (``vllm_adapter/worker/tree_step.py``) replaced it, the runner decided each tree on
its own, on the host: the rows' ``[n, V]`` logits copied to the CPU, p̃ built there
(``sampling_support``), one uniform per row from the session's generator, ``sample_sparse``, then
``select_path`` (with the dense p̃ in ε mode). This is that code, minus the runner.
"""

from __future__ import annotations

import torch

from vllm_hyco.spec_decode.acceptance import select_path
from vllm_hyco.spec_decode.sampling import SAMPLING_EPS, draw_uniforms, sample_sparse, sampling_support


def decide_one_tree(logits: torch.Tensor, tokens: list[int], parents: list[int], temperature: float,
                    top_k: int, top_p: float, eps: float | None, gen: torch.Generator | None,
                    min_tokens_rows: list[int] = (), stop_ids: list[int] = ()) -> dict:
    """``{"path_rows", "bonus", "hits", "samples"}`` of one tree, decided on host copies of its logits.

    Shape: logits [n, V] on any device (copied to the host, as the engine did).
    """
    logits = logits.cpu()
    if min_tokens_rows and stop_ids:
        logits = logits.clone()
        logits[torch.tensor(list(min_tokens_rows)).unsqueeze(1), torch.tensor(list(stop_ids)).unsqueeze(0)] = \
            float("-inf")
    probs = None
    if temperature < SAMPLING_EPS:
        samples = logits.argmax(dim=-1).tolist()
        eps = None
    else:
        support = sampling_support(logits, temperature, top_k, top_p)
        samples = sample_sparse(support, draw_uniforms(len(tokens), gen)).tolist()
        if eps is not None:
            probs = support.to_dense()
    path, bonus = select_path(tokens, parents, probs, samples, eps)
    hits = sum(int(tokens[r] == samples[parents[r]]) for r in path)
    return {"path_rows": path, "bonus": int(bonus), "hits": hits, "samples": samples}
