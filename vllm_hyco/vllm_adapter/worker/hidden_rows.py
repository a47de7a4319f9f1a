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

Memory: the rings are one :class:`HiddenPool`, ``max_sessions`` x W x hidden in the model's dtype, allocated
when the model loads (``HycoRunnerMixin.load_model``), so vLLM's memory profile, which runs after the load,
leaves it out of the KV cache (128 MiB for MiMo-7B in bf16 at the default 16 sessions); a server that cannot
hold it stops at startup.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_hyco.kernels import quantize_int8
from vllm_hyco.vllm_adapter.worker.ordinary_mtp import session_rows

logger = logging.getLogger("vllm.hyco")  # a child of vLLM's logger: same handler and format


class HiddenRing:
    """The hidden states of one session's last W computed positions, column p mod W (``rows`` [W, hidden]), and
    the position each column holds (``held`` [W], -1: none yet): a slot of the :class:`HiddenPool`."""

    def __init__(self, rows: torch.Tensor, held: torch.Tensor):
        self.rows, self.held = rows, held
        self.window = rows.shape[0]

    @classmethod
    def empty(cls, window: int, like: torch.Tensor) -> HiddenRing:
        return cls(torch.zeros(window, like.shape[-1], dtype=like.dtype, device=like.device),
                   torch.full((window,), -1, dtype=torch.int64, device=like.device))

    def write(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        keep = slice(max(0, positions.shape[0] - self.window), positions.shape[0])  # later rows win a column
        cols = positions[keep] % self.window
        self.rows[cols] = rows[keep].to(self.rows.dtype)
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


class HiddenPool:
    """Every phone session's :class:`HiddenRing`: ``slots`` rings of ``window`` x ``hidden`` in one tensor,
    allocated once. A request takes a free slot at its first row and gives it back when it finishes. With every
    slot taken (a session opened in the step before another's end reaches the worker) the ring is allocated
    apart, and logged.

    >>> pool = HiddenPool(1, 4, 2, torch.float32, torch.device("cpu"))
    >>> pool.ring("a").rows.data_ptr() == pool.rows.data_ptr(), pool.nbytes
    (True, 64)
    >>> pool.ring("b").rows.data_ptr() == pool.rows.data_ptr()  # no slot left: a ring apart
    False
    >>> pool.free(["a", "b"]); pool.ring("b").rows.data_ptr() == pool.rows.data_ptr()
    True
    """

    def __init__(self, slots: int, window: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.rows = torch.zeros(slots, window, hidden, dtype=dtype, device=device)
        self.held = torch.full((slots, window), -1, dtype=torch.int64, device=device)
        self.free_slots = list(range(slots - 1, -1, -1))
        self.slot_of: dict[str, int] = {}
        self.apart: dict[str, HiddenRing] = {}

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size() + self.held.numel() * self.held.element_size()

    def ring(self, req_id: str) -> HiddenRing:
        """``req_id``'s ring: a slot taken at its first call (its columns cleared), or a ring apart."""
        slot = self.slot_of.get(req_id)
        if slot is not None:
            return HiddenRing(self.rows[slot], self.held[slot])
        if req_id in self.apart:
            return self.apart[req_id]
        if self.free_slots:
            slot = self.slot_of[req_id] = self.free_slots.pop()
            self.held[slot].fill_(-1)
            return HiddenRing(self.rows[slot], self.held[slot])
        logger.warning("HyCo: all %d h-ring slots are taken; session %s's ring is allocated apart",
                       len(self.slot_of), req_id)
        ring = self.apart[req_id] = HiddenRing.empty(self.rows.shape[1], self.rows[0])
        return ring

    def free(self, req_ids: Any) -> None:
        for req_id in req_ids:
            slot = self.slot_of.pop(req_id, None)
            if slot is not None:
                self.free_slots.append(slot)
            self.apart.pop(req_id, None)


def allocate(runner: Any) -> None:
    """The runner's pool (a family with ``hidden`` hand-off rows only), at model load, before vLLM profiles
    memory: ``max_sessions`` slots of the hand-off window, the model's hidden size and dtype."""
    st = runner.hyco
    if not st.hidden_rows or st.config is None:
        return
    mc = runner.vllm_config.model_config
    st.hidden_pool = HiddenPool(st.config.max_sessions, st.window, int(mc.get_hidden_size()), mc.dtype,
                                runner.device)
    logger.info("HyCo: the sessions' h rings hold %d sessions x %d positions x %d (%.1f MiB)",
                st.config.max_sessions, st.window, mc.get_hidden_size(), st.hidden_pool.nbytes / 2**20)


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
            ring = runner.hyco.hidden_pool.ring(runner.input_batch.req_ids[b])
            ring.write(runner.positions[lo:hi].to(torch.int64), hidden[lo:hi])


def record_rows(runner: Any, req_id: str, start: int, rows: torch.Tensor) -> None:
    """A tree's committed rows (its root at ``start`` and the accepted path): positions start, start + 1, ..."""
    positions = torch.arange(start, start + rows.shape[0], device=rows.device)
    runner.hyco.hidden_pool.ring(req_id).write(positions, rows)


def seed(runner: Any, req_id: str, num_committed: int, like: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(start, int8 rows [positions, 1, hidden]) of positions [start, T), T = ``num_committed``: start is
    max(0, T - W), or later where the session's prefix came from the prefix cache (``HiddenRing.read``)."""
    start, rows = runner.hyco.hidden_pool.ring(req_id).read(max(0, num_committed - runner.hyco.window), num_committed)
    return start, quantize_int8(rows.float(), runner.hyco.scales["h"])[:, None, :]


def free(runner: Any, req_ids: Any) -> None:
    if runner.hyco.hidden_pool is not None:
        runner.hyco.hidden_pool.free(req_ids)
