"""The acceptance rule (paper Algorithm 4, lines 6-12; docs/decisions.md D4), for one tree and batched.

For a node c with parent v, ŷ_v the verifier's sample at v and p̃ the request's sampling distribution:

    hit(c) = [token(c) == ŷ_v]
    ok(c)  = hit(c)                          EXACT   (ε >= 1 or None; its own code path)
    ok(c)  = hit(c) or p̃(token(c) | v) >= ε  EPSILON (0 < ε < 1; lossy, operator opt-in)

The accepted set A holds the nodes whose whole path from the root is ok. The endpoint v* maximizes, in
order: depth, hits on its path, the float64 sum of log p̃ along its path (summed from the root down),
then prefers the lowest row. The bonus token is ŷ_{v*}. With the root alone accepted, v* is the root.

EXACT needs no p̃ lookup and no tie-break: siblings carry distinct tokens (tree.py rejects duplicates),
so at most one child of each node matches its sample and the accepted nodes form one chain. The
committed tokens are then exactly the samples ŷ along that chain plus ŷ at its end, each drawn from p̃
of its own context: verification is lossless (docs/acceptance.md has the proof).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_hyco.errors import ConfigError


class AcceptanceMode(enum.Enum):
    """EXACT is lossless; EPSILON commits tokens the verifier did not sample (lossy, see §3.5)."""

    EXACT = "exact"
    EPSILON = "epsilon"


def normalize_epsilon(epsilon: float | None) -> float | None:
    """None for exact verification (ε None or ε >= 1), else ε in (0, 1); anything else is a ConfigError."""
    if epsilon is None:
        return None
    eps = float(epsilon)
    if math.isnan(eps) or eps <= 0:
        raise ConfigError(
            f"epsilon {epsilon!r} is not allowed: use a value in (0, 1) for lossy acceptance "
            f"(0.005 recommended) or >= 1 / None for exact verification"
        )
    return None if eps >= 1 else eps


def acceptance_mode(epsilon: float | None) -> AcceptanceMode:
    return AcceptanceMode.EXACT if normalize_epsilon(epsilon) is None else AcceptanceMode.EPSILON


def _ints(values: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


def _select_exact(tokens: list[int], parents: list[int], samples: list[int]) -> tuple[list[int], int]:
    children: dict[int, list[int]] = {}
    for row in range(1, len(tokens)):
        children.setdefault(parents[row], []).append(row)
    path: list[int] = []
    cur = 0
    while True:
        nxt = [c for c in children.get(cur, []) if tokens[c] == samples[cur]]
        if not nxt:
            return path, samples[cur]
        cur = nxt[0]
        path.append(cur)


def select_path(
    tokens: Sequence[int] | torch.Tensor,
    parents: Sequence[int] | torch.Tensor,
    probs: torch.Tensor | None,
    samples: Sequence[int] | torch.Tensor,
    epsilon: float | None,
) -> tuple[list[int], int]:
    """The accepted path of one tree (rows from the root's child to v*, root excluded) and the bonus.

    Shape: tokens, parents, samples [n] ints (row 0 the root); probs [n, V] p̃ per row (never read in
    exact mode, so it may be None there).

    >>> probs = torch.tensor([[0.0, 0.9, 0.1], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    >>> select_path([0, 1, 2], [-1, 0, 0], probs, [1, 0, 0], None)   # 1 is sampled at the root
    ([1], 0)
    >>> select_path([0, 2, 1], [-1, 0, 1], probs, [2, 2, 0], 0.05)  # 2 is sampled; p̃(1 | 1) = 0.5
    ([1, 2], 0)
    """
    tok, par, smp = _ints(tokens), _ints(parents), _ints(samples)
    eps = normalize_epsilon(epsilon)
    if eps is None:
        return _select_exact(tok, par, smp)
    assert probs is not None, "epsilon mode reads p̃: pass probs"
    n = len(tok)
    rows = torch.tensor(par[1:], dtype=torch.int64)
    cols = torch.tensor(tok[1:], dtype=torch.int64)
    p_edge = [0.0] + probs[rows, cols].tolist()  # float32 values, exact as Python floats
    log_edge = [0.0] + torch.log(torch.tensor(p_edge[1:], dtype=torch.float64)).tolist()
    accepted, hits, logp, depth = [True] * n, [0] * n, [0.0] * n, [0] * n
    for row in range(1, n):
        v = par[row]
        hit = tok[row] == smp[v]
        accepted[row] = accepted[v] and (hit or p_edge[row] >= eps)
        hits[row] = hits[v] + int(hit)
        logp[row] = logp[v] + log_edge[row]
        depth[row] = depth[v] + 1
    best = max((r for r in range(n) if accepted[r]), key=lambda r: (depth[r], hits[r], logp[r], -r))
    path, cur = [], best
    while cur != 0:
        path.append(cur)
        cur = par[cur]
    return path[::-1], smp[best]


@dataclass(frozen=True)
class Decision:
    """Per-request outcome of ``decide`` (global row indices into the packed rows)."""

    # [B] int64 global row of v*
    endpoint: torch.Tensor
    # [B] int64 accepted path length (depth of v*)
    length: torch.Tensor
    # [B] int64 hits on the accepted path
    hits: torch.Tensor
    # [B, D] int64 global rows of the path (column d is depth d + 1), -1 past its end
    path: torch.Tensor
    # [N] bool hit(c) per row
    hit: torch.Tensor


def _segment_max(values: torch.Tensor, seg: torch.Tensor, num_seg: int, fill: float) -> torch.Tensor:
    out = torch.full((num_seg,), fill, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, seg, values, reduce="amax", include_self=True)


def decide(
    tokens: torch.Tensor,
    parent: torch.Tensor,
    depth: torch.Tensor,
    req: torch.Tensor,
    valid: torch.Tensor,
    samples: torch.Tensor,
    p_edge: torch.Tensor | None,
    eps_row: torch.Tensor,
    num_req: int,
) -> Decision:
    """Vectorized Algorithm 4 lines 6-12 over packed rows of many trees (loops run over depth only).

    Shape: tokens, parent (global row of the parent; a root points at itself), depth, req (request of the
    row), samples: [N] int64; valid [N] bool (padding rows False); p_edge [N] float32 p̃(token | parent)
    or None when every request is exact; eps_row [N] float64, +inf on exact requests' rows.
    """
    is_root = depth == 0
    hit = (tokens == samples[parent]) & ~is_root & valid  # [N]
    ok = hit.clone()
    log_edge = torch.zeros(tokens.shape, dtype=torch.float64, device=tokens.device)
    if p_edge is not None:
        lossy = torch.isfinite(eps_row)
        p64 = p_edge.to(torch.float64)
        ok |= lossy & (p64 >= eps_row) & valid & ~is_root
        log_edge = torch.where(lossy & ~is_root, torch.log(p64), log_edge)
    ok |= is_root & valid
    max_depth = int(depth[valid].max()) if bool(valid.any()) else 0
    accepted, hits, logp = ok, hit.to(torch.int64), log_edge
    for _ in range(max_depth):  # after pass d every row at depth <= d holds its path value
        accepted = ok & accepted[parent]
        hits = hit.to(torch.int64) + torch.where(is_root, 0, hits[parent])
        logp = log_edge + torch.where(is_root, 0.0, logp[parent])
    endpoint = _lexicographic_best(accepted, depth, hits, logp, req, num_req)
    return Decision(
        endpoint=endpoint,
        length=depth[endpoint],
        hits=hits[endpoint],
        path=_trace_paths(endpoint, parent, depth, max_depth),
        hit=hit,
    )


def _lexicographic_best(
    accepted: torch.Tensor,
    depth: torch.Tensor,
    hits: torch.Tensor,
    logp: torch.Tensor,
    req: torch.Tensor,
    num_req: int,
) -> torch.Tensor:
    """[B] global row maximizing (depth, hits, log p̃ sum, -row) among each request's accepted rows."""
    cand = accepted
    for key, fill in ((depth, -1), (hits, -1), (logp, float("-inf"))):
        masked = torch.where(cand, key, fill)
        best = _segment_max(masked, req, num_req, fill)
        cand = cand & (masked == best[req])
    rows = torch.arange(req.numel(), device=req.device)
    first = torch.full((num_req,), req.numel(), dtype=torch.int64, device=req.device)
    first = first.scatter_reduce(0, req, torch.where(cand, rows, req.numel()), reduce="amin",
                                 include_self=True)
    assert bool((first < req.numel()).all()), "a request has no accepted row (is its root valid?)"
    return first


def _trace_paths(
    endpoint: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, max_depth: int
) -> torch.Tensor:
    """[B, max_depth] global rows from depth 1 to the endpoint, -1 beyond."""
    num_req = endpoint.numel()
    path = torch.full((num_req, max(max_depth, 1)), -1, dtype=torch.int64, device=endpoint.device)
    cur = endpoint.clone()
    batch = torch.arange(num_req, device=endpoint.device)
    for _ in range(max_depth):
        d = depth[cur]
        on = d >= 1
        path[batch[on], d[on] - 1] = cur[on]
        cur = torch.where(on, parent[cur], cur)
    return path[:, :max_depth]
