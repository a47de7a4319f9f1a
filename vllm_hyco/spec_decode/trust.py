"""How far the server trusts a session's per-node values (protocol v2 ``values``): as far as that session's own
verdicts have shown them to predict acceptance better than the server's estimate (numpy only).

The phone sends, per row, its estimate that the row is accepted. A phone could inflate them to have more of
its rows verified, so before this module they could only lower a node (``budget.bound_values``: the minimum
of the phone's and the server's estimates). Now each session earns trust:

* **Calibration.** Per session, the verified rows' phone values are binned (``BINS`` bins of [0, 1]) and each
  bin counts how many of its rows were accepted (decayed: ``SESSION_HALF_LIFE`` rounds count half). A
  row's *calibrated* phone value is its bin's observed acceptance, shrunk towards the server's estimate of
  the row by ``SHRINK`` pseudo-rows. A phone whose values are too high gets them mapped down to what its
  verdicts showed.
* **Skill.** On the same verified rows, the decayed Brier score (mean squared error against accepted / not)
  of the calibrated phone values and of the best value-free prediction from the same verdicts: the session's
  observed acceptance at the row's depth (shrunk towards the server's estimate). The phone's values are used
  in proportion to how much better they predicted: ``w = clip((base_brier - phone_brier) / base_brier /
  SKILL_FULL, 0, 1)``, scaled by the evidence ``n / (n + EVIDENCE)`` (``n``: decayed verified rows). A phone
  whose values say nothing the depth does not (an inflating phone sends the same value everywhere: its
  calibrated values are one number) gets ``w = 0``.
* **The value used** by the cut: ``(1 - w) * min(phone, server) + w * calibrated``. With ``w = 0`` it is
  exactly the old bound; a calibrated phone that knows better than the server (a long chain it is sure of,
  a sibling it knows is hopeless) moves the cut, up or down.

>>> t = ValueTrust()
>>> t.values("s", np.array([1.0, 0.5, 0.2]), [1.0, 0.9, 0.9]).round(2).tolist()  # no evidence yet: the bound
[1.0, 0.5, 0.2]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BINS = 10
SHRINK = 4.0  # pseudo-rows of the server's estimate in each calibration bin
EVIDENCE = 64.0  # verified rows for half the evidence weight
SKILL_FULL = 0.2  # a Brier score this much (relative) better than the server's earns full trust
SESSION_HALF_LIFE = 64.0  # rounds


MAX_DEPTH = 256


class _Session:
    __slots__ = ("hits", "rows", "depth_hits", "depth_rows", "brier_phone", "brier_base", "n")

    def __init__(self) -> None:
        self.hits, self.rows = np.zeros(BINS), np.zeros(BINS)
        self.depth_hits, self.depth_rows = np.zeros(MAX_DEPTH), np.zeros(MAX_DEPTH)
        self.brier_phone = self.brier_base = self.n = 0.0


def _bins(values: np.ndarray) -> np.ndarray:
    return np.minimum((np.clip(values, 0.0, 1.0) * BINS).astype(np.int64), BINS - 1)


class ValueTrust:
    """Per-session calibration and skill of phone values (module docstring)."""

    def __init__(self, half_life: float = SESSION_HALF_LIFE):
        self.decay = 0.5 ** (1.0 / half_life)
        self._sessions: dict[str, _Session] = {}

    def forget(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def calibrated(self, sid: str | None, server: np.ndarray, phone: np.ndarray) -> np.ndarray:
        """Each row's phone value mapped to its bin's observed acceptance (shrunk towards ``server``)."""
        st = self._sessions.get(sid) if sid is not None else None
        if st is None:
            return np.fmin(server, phone)
        b = _bins(phone)
        return (st.hits[b] + SHRINK * server) / (st.rows[b] + SHRINK)

    def weight(self, sid: str | None) -> float:
        st = self._sessions.get(sid) if sid is not None else None
        if st is None or st.n <= 0 or st.brier_base <= 0:
            return 0.0
        skill = (st.brier_base - st.brier_phone) / st.brier_base
        return float(np.clip(skill / SKILL_FULL, 0.0, 1.0) * st.n / (st.n + EVIDENCE))

    def values(self, sid: str | None, server: np.ndarray, phone: Sequence[float] | np.ndarray | None) -> np.ndarray:
        """The values the cut uses (row 0, the root, keeps the server's)."""
        if phone is None:
            return server
        ph = np.clip(np.nan_to_num(np.asarray(phone, dtype=np.float64), nan=1.0), 0.0, 1.0)
        bound = np.fmin(server, ph)
        w = self.weight(sid)
        if w <= 0.0:
            return bound
        out = (1.0 - w) * bound + w * self.calibrated(sid, server, ph)
        out[0] = server[0]
        return np.clip(out, 0.0, 1.0)

    def observe(self, sid: str | None, server: np.ndarray, phone: Sequence[float] | np.ndarray | None,
                accepted: np.ndarray, depth: Sequence[int] | np.ndarray) -> None:
        """One verified tree: per row the ``server`` and ``phone`` values, whether it was accepted and its depth
        (row 0, the root, is skipped)."""
        if sid is None or phone is None or len(accepted) <= 1:
            return
        k = len(accepted)
        ph = np.clip(np.nan_to_num(np.asarray(phone, dtype=np.float64)[1:k], nan=1.0), 0.0, 1.0)
        sv, ok = np.asarray(server, dtype=np.float64)[1:k], np.asarray(accepted[1:], dtype=np.float64)
        dep = np.minimum(np.asarray(depth, dtype=np.int64)[1:k], MAX_DEPTH - 1)
        new = sid not in self._sessions
        st = self._sessions.setdefault(sid, _Session())
        # predictions made before this round's evidence: the phone's calibrated values, and the depth's rate
        cal = np.fmin(sv, ph) if new else self.calibrated(sid, sv, ph)
        base = (st.depth_hits[dep] + SHRINK * sv) / (st.depth_rows[dep] + SHRINK)
        d = self.decay
        st.brier_phone = d * st.brier_phone + float(((cal - ok) ** 2).sum())
        st.brier_base = d * st.brier_base + float(((base - ok) ** 2).sum())
        st.n = d * st.n + float(len(ok))
        for arr in (st.hits, st.rows, st.depth_hits, st.depth_rows):
            arr *= d
        b = _bins(ph)
        st.hits += np.bincount(b, weights=ok, minlength=BINS)
        st.rows += np.bincount(b, minlength=BINS)
        st.depth_hits += np.bincount(dep, weights=ok, minlength=MAX_DEPTH)
        st.depth_rows += np.bincount(dep, minlength=MAX_DEPTH)
