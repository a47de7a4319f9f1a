"""Fixed-tree replay (paper §3.5): the trees one run logged, re-decided at each ε.

Every round of a logged phone session keeps its tree (tokens, parents, node sources), its accepted path
and how many tokens were committed before it (``phones.recording_session_class``). Offline, the fixture
verifier (transformers, fp32) gives p̃ (T, top-k, top-p: vLLM's sampler) at every node from the committed
context plus the node's path; ŷ at each node is the logged one where the run revealed it (an exact run
commits ŷ along its path and ŷ at the path's end, the bonus) and a seeded draw from p̃ elsewhere. Then
``vllm_hyco.spec_decode.acceptance.select_path`` decides each tree again at each ε: MAT on the same trees
(``support``: every drafted token with p̃ > 0 accepted, the paper's upper limit), and which node sources
the threshold-only acceptances (accepted tokens that are not ŷ) come from.

It measures headroom on fixed trajectories, not the quality of new answers (those are the ε sweep's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_hyco.spec_decode.acceptance import select_path
from vllm_hyco.spec_decode.sampling import sample_rows, sampling_probs

SOURCES = {1: "chain", 2: "runner_up", 3: "slm"}
SUPPORT = 1e-9  # "ε -> 0": any drafted token in p̃'s support


def _paths(parents: Sequence[int]) -> list[list[int]]:
    """Row -> its rows from the root's child down to it (the root: [])."""
    out: list[list[int]] = [[]]
    for r in range(1, len(parents)):
        out.append(out[parents[r]] + [r])
    return out


@torch.no_grad()
def node_probs(verifier, context: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
               sampling: dict) -> torch.Tensor:
    """p̃ [rows, V] at every node: one forward per leaf path (right-padded batch), the root's context being
    ``context`` (it ends with the root token)."""
    paths = _paths(parents)
    has_child = {p for p in parents[1:]}
    leaves = [r for r in range(len(tokens)) if r not in has_child]
    seqs = [list(context) + [tokens[x] for x in paths[leaf]] for leaf in leaves]
    width = max(len(s) for s in seqs)
    batch = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    logits = verifier(input_ids=batch).logits.float()  # [leaves, width, V]
    out = torch.empty(len(tokens), logits.shape[-1])
    for i, leaf in enumerate(leaves):
        for depth, row in enumerate([0] + paths[leaf]):
            out[row] = logits[i, len(context) - 1 + depth]
    return sampling_probs(out, sampling["temperature"], sampling["top_k"], sampling["top_p"])


def known_samples(tree: dict, committed: Sequence[int]) -> dict[int, int]:
    """ŷ revealed by an exact round: along the accepted path and at its end (the bonus)."""
    path, before = tree["path"], tree["before"]
    got = list(committed[before : before + len(path) + 1])
    rows = [0] + list(path)
    return {row: got[i] for i, row in enumerate(rows) if i < len(got)}


def replay(sessions: list[dict], verifier, epsilons: Sequence[float | None], sampling: dict, *,
           exact_log: bool = True, seed: int = 0) -> dict:
    """``sessions``: [{"prompt_ids", "token_ids", "rounds": [tree dicts]}]. Returns per ε the MAT on the
    logged trees (path + bonus per round, so a finishing round counts whole) and the threshold-only
    acceptances by node source; ``logged_mat`` the same count on the logged paths and ``exact_same_path``
    the share of rounds whose exact re-decision is the logged path (1.0 for an exact log)."""
    gen = torch.Generator().manual_seed(seed)
    eps_list = list(epsilons) + [SUPPORT]
    committed = {e: 0 for e in eps_list}
    thresh: dict = {e: {} for e in eps_list}
    rounds = skipped = same_as_logged = logged_committed = 0
    for s in sessions:
        full = list(s["prompt_ids"]) + list(s["token_ids"])
        for tree in s["rounds"]:
            context = full[: len(s["prompt_ids"]) + tree["before"]]
            if not context or context[-1] != tree["tokens"][0]:
                skipped += 1
                continue
            probs = node_probs(verifier, context, tree["tokens"], tree["parents"], sampling)
            samples = sample_rows(probs, gen)
            if exact_log:
                for row, tok in known_samples(tree, s["token_ids"]).items():
                    samples[row] = tok
            rounds += 1
            logged_committed += len(tree["path"]) + 1
            for e in eps_list:
                path, _ = select_path(tree["tokens"], tree["parents"], probs, samples, e)
                same_as_logged += e is None and path == list(tree["path"])
                committed[e] += len(path) + 1
                for r in path:
                    if tree["tokens"][r] != int(samples[tree["parents"][r]]):
                        src = SOURCES.get(tree["sources"][r], "other")
                        thresh[e][src] = thresh[e].get(src, 0) + 1
    by_eps = []
    for e in eps_list:
        total = sum(thresh[e].values())
        by_eps.append({"epsilon": "exact" if e is None else ("support" if e == SUPPORT else e),
                       "mat": committed[e] / rounds if rounds else 0.0, "threshold_only": total,
                       "threshold_only_share": {k: v / total for k, v in thresh[e].items()} if total else {}})
    return {"rounds": rounds, "skipped": skipped, "by_epsilon": by_eps,
            "logged_mat": logged_committed / rounds if rounds else 0.0,
            "exact_same_path": same_as_logged / rounds if rounds else 0.0}
