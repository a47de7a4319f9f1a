"""What a phone session reports: one ``RoundStats`` per round, the ``SessionResult`` at the end, and
``fmt_round`` (the per-round console line). ``mobile_client.session`` fills them and re-exports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RoundStats:
    """One round, as the phone saw it (CPU-measured times; bytes are whole frames)."""

    round: int
    nodes: int  # drafted nodes sent (root excluded)
    accepted: int  # |P|: accepted nodes
    committed: int  # tokens committed (path + bonus; fewer on the finishing round)
    draft_ms: float  # drafting the tree (0-ish when a proactive tree was reused)
    wait_ms: float  # tree sent -> verdict and its whole hand-off received
    bytes_up: int
    bytes_down: int
    budget: int  # nodes granted for the next round
    text: str = ""
    resumes: int = 0  # reconnections while this round was in flight
    proactive_hit: bool | None = None  # None: proactive drafting off
    proactive_ms: float = 0.0  # spent preparing the proactive tree (overlapped with the wait)
    mode: str = "phone"  # "server": tokens the server drafted itself (one `tokens` frame; nodes 0)


@dataclass
class SessionResult:
    text: str
    token_ids: list[int]  # committed completion tokens
    finish_reason: str | None
    rounds: list[RoundStats]
    resumes: int
    final: Any = None  # the server's FinalFrame (None if the connection died after the last verdict)

    @property
    def mat(self) -> float:
        """Mean committed tokens per round (path + bonus), as the paper's MAT."""
        return sum(r.committed for r in self.rounds) / max(len(self.rounds), 1)

    def summary(self) -> dict:
        n = max(len(self.rounds), 1)
        return {"rounds": len(self.rounds), "tokens": len(self.token_ids), "mat": round(self.mat, 3),
                "draft_ms_mean": round(sum(r.draft_ms for r in self.rounds) / n, 3),
                "wait_ms_mean": round(sum(r.wait_ms for r in self.rounds) / n, 3),
                "bytes_up": sum(r.bytes_up for r in self.rounds),
                "bytes_down": sum(r.bytes_down for r in self.rounds), "resumes": self.resumes,
                "finish_reason": self.finish_reason}


def fmt_round(s: RoundStats) -> str:
    """One line per round for consoles and logs."""
    hit = "" if s.proactive_hit is None else f" pd={'hit' if s.proactive_hit else 'miss'}"
    if s.mode == "server":
        return (f"round {s.round:3d}: server | +{s.committed} tok | wait {s.wait_ms:7.2f} ms | down "
                f"{s.bytes_down:7d} B{' resumed' * (s.resumes > 0)}")
    return (f"round {s.round:3d}: phone | nodes {s.nodes:2d} accepted {s.accepted:2d} +{s.committed} tok | draft "
            f"{s.draft_ms:7.2f} ms wait {s.wait_ms:7.2f} ms | up {s.bytes_up:4d} B down {s.bytes_down:7d} B"
            f"{hit}{' resumed' * (s.resumes > 0)}")


__all__ = ["RoundStats", "SessionResult", "fmt_round"]
