"""The ``hidden`` hand-off rows of a family whose MTP layer owns its KV (MiMo: ``models.DrafterKV.OWN``),
worker process.

The phone keeps its own copy of the MTP layer's KV cache and extends it from h_p, the verifier's hidden state
of every committed position p (with the committed token p + 1, which it holds): one int8 row of ``hidden``
values per position, quantized with h's per-channel scales (hand-off schema 3). A tree step's rows come
straight from the step's hidden states (the root and the accepted path). A seed (round 0, the round after
server mode) covers the last W committed positions, which earlier steps computed: the runner keeps them per
phone session in a :class:`HiddenRing` on the device, written by every step that computes the session's
rows (``record_step``: prefill chunks, server-mode decode; ``record_rows``: a tree's root and path).

A position served from the prefix cache was never computed for the session, so no step recorded its h: a seed
starts after the last such position (the phone takes any start). A position's last write is its committed
value: a row computed for a token that was then rejected (a
server-mode draft) sits at a position the scheduler rolls back, and the step that computes that position
again overwrites it before any seed reads it (a seed reads positions below the committed count only).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_hyco.kernels import quantize_int8
from vllm_hyco.vllm_adapter.worker.ordinary_mtp import session_rows


class HiddenRing:
    """The hidden states of one session's last ``window`` computed positions, column p mod W, and the position
    each column holds (-1: none yet)."""

    def __init__(self, window: int, like: torch.Tensor):
        self.window = window
        self.rows = torch.zeros(window, like.shape[-1], dtype=like.dtype, device=like.device)
        self.held = torch.full((window,), -1, dtype=torch.int64, device=like.device)

    def write(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        keep = slice(max(0, positions.shape[0] - self.window), positions.shape[0])  # later rows win a column
        cols = positions[keep] % self.window
        self.rows[cols] = rows[keep]
        self.held[cols] = positions[keep]

    def read(self, lo: int, hi: int) -> tuple[int, torch.Tensor]:
        """(start, rows of [start, hi)): the longest run of held positions ending at ``hi``, from ``lo`` on. A
        position no step computed for this session (a prefix-cache hit: vLLM reuses its KV, never its hidden
        state) ends the run, so a seed starts after it."""
        assert hi - lo <= self.window, (lo, hi, self.window)
        positions = torch.arange(lo, hi, device=self.rows.device)
        missing = torch.nonzero(self.held[positions % self.window] != positions)
        start = lo + (int(missing[-1]) + 1 if missing.numel() else 0)
        return start, self.rows[torch.arange(start, hi, device=self.rows.device) % self.window]


def ring(runner: Any, req_id: str, like: torch.Tensor) -> HiddenRing:
    rings = runner.hyco.hidden_rings
    if req_id not in rings:
        rings[req_id] = HiddenRing(runner.hyco.window, like)
    return rings[req_id]


def record_step(runner: Any, hidden: torch.Tensor, tree_batch_rows: set[int]) -> None:
    """Keep the hidden states of every phone session's rows computed this step outside a tree (the trees'
    rows are recorded after their decision, ``record_rows``). ``hidden``: the step's [tokens, hidden]."""
    sessions = session_rows(runner) - tree_batch_rows
    if not sessions:
        return
    starts = runner.query_start_loc.np
    for b in sorted(sessions):
        lo, hi = int(starts[b]), int(starts[b + 1])
        if hi > lo:
            req_id = runner.input_batch.req_ids[b]
            ring(runner, req_id, hidden).write(runner.positions[lo:hi].to(torch.int64), hidden[lo:hi])


def record_rows(runner: Any, req_id: str, start: int, rows: torch.Tensor) -> None:
    """A tree's committed rows (its root at ``start`` and the accepted path): positions start, start + 1, ..."""
    positions = torch.arange(start, start + rows.shape[0], device=rows.device)
    ring(runner, req_id, rows).write(positions, rows)


def seed(runner: Any, req_id: str, num_committed: int, like: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(start, int8 rows [positions, 1, hidden]) of positions [start, T), T = ``num_committed``: start is
    max(0, T - W), or later where the session's prefix came from the prefix cache (``HiddenRing.read``)."""
    lo = max(0, num_committed - runner.hyco.window)
    start, rows = ring(runner, req_id, like).read(lo, num_committed)
    return start, quantize_int8(rows.float(), runner.hyco.scales["h"])[:, None, :]


def free(runner: Any, req_ids: Any) -> None:
    for req_id in req_ids:
        runner.hyco.hidden_rings.pop(req_id, None)
