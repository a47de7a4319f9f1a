"""Each phone session's last W quantized hand-off positions, kept by the route (API-server process).

:class:`KvRing` keeps a session's last W quantized K/V positions, so a phone that lost its drafter state
(``resume.need_seed``) gets a seed for *any* round from the endpoint, without asking the engine again. The
served model's spec, scales and payload framing are ``vllm_hyco.handoff.server_model``.
"""

from __future__ import annotations

import numpy as np


class KvRing:
    """The last W positions of one session's quantized hand-off K/V rows (for ``need_seed`` replays). A model
    whose hand-off has no per-position rows (schema 3 with no layer: DeepSeek-V3) keeps positions only."""

    def __init__(self, window: int):
        self.window = window
        self.start = 0  # position of row 0
        self.end = 0  # the position after the last row (the next root's)
        self.rows: list[tuple[np.ndarray, np.ndarray | None]] | None = None

    def extend(self, start: int, rows: list[tuple[np.ndarray, np.ndarray | None]], end: int) -> None:
        """Add rows for positions ``[start, end)`` (overwriting any from ``start`` on), keep W."""
        if self.rows is None or start < self.start or start > self.end:
            self.start, self.rows = start, [(k.copy(), None if v is None else v.copy()) for k, v in rows]
        else:
            keep = start - self.start
            self.rows = [(np.concatenate([k0[:keep], k]), None if v is None else np.concatenate([v0[:keep], v]))
                         for (k0, v0), (k, v) in zip(self.rows, rows)]
        self.end = end
        extra = self.end - self.start - self.window
        if extra > 0:
            self.start += extra
            self.rows = [(k[extra:], None if v is None else v[extra:]) for k, v in self.rows]

    def seed_rows(self, root_position: int) -> tuple[int, list[tuple[np.ndarray, np.ndarray | None]]]:
        """``(a, rows)`` covering ``[max(0, t' - W), t')`` (requires the ring to end at t')."""
        if self.rows is None or self.end != root_position:
            raise ValueError(f"the ring ends at {self.end}, not at the root position {root_position}")
        return self.start, self.rows
