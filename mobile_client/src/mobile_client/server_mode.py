"""A phone session's server mode (protocol v3, docs/protocol.md section 3 "Modes"): the session-side half.

``PhoneSession`` takes these methods; the client (``client.py``) drives them::

    frame = session.mode_frame("server", window=64)  # at a round boundary (no tree in flight)
    session.apply_mode(server_mode_frame)             # the stretch is round r
    session.apply_tokens(tokens_frame)                # per `tokens` frame: commit, stream the text
    session.ack_frame()                               # what the phone holds (opens the credit window)
    frame = session.mode_frame("phone")               # back: the answer names round r + 1 and its root
    session.apply_mode(phone_mode_frame)              # the next tree is SLM-only; its verdict seeds the MTP

During a stretch the drafter sees nothing: the tokens the server commits become the SLM's catch-up rows
(drafted over in the next forward) and the MTP head waits for the seed hand-off of the next verdict.
Replays after a resume (a ``mode`` or ``tokens`` frame the phone already holds) are ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mobile_client.results import RoundStats
from vllm_hyco.errors import FrameError, SessionError
from vllm_hyco.handoff.mode_frames import AckFrame, ModeAckFrame, ModeFrame, TokensFrame
from vllm_hyco.handoff.tree_contract import grant_node_budget

if TYPE_CHECKING:
    from mobile_client.session import PhoneSession


def _bad(msg: str) -> FrameError:
    return FrameError(msg, code="bad_verdict")


class ServerModeSession:
    """PhoneSession's server-mode methods."""

    def mode_frame(self: PhoneSession, mode: str, window: int | None = None) -> ModeFrame:
        """Ask for ``mode`` at the session's round boundary: in phone mode the next round (no tree of it in
        flight), in server mode the stretch's round."""
        if self.finished:
            raise SessionError("the session is finished", code="session_finished")
        if self.tree_in_flight:
            raise SessionError(f"round {self.round}'s tree is in flight: switch after its verdict",
                               code="mid_round")
        return ModeFrame(mode, self.round, window if mode == "server" else None)

    def apply_mode(self: PhoneSession, ack: ModeAckFrame) -> bool:
        """Take the server's ``mode`` frame; False for a replay of a switch already applied."""
        if ack.tokens != len(self.tokens):
            if ack.tokens < len(self.tokens) or (ack.mode == self.mode and ack.mode == "server"):
                return False  # a replay (resume), or a stretch resumed on another connection
            raise _bad(f"the mode frame says {ack.tokens} tokens are committed; the phone holds {len(self.tokens)}")
        if ack.mode == "server":
            if self.mode == "server" and ack.round == self.round:
                return False
            if ack.round != self.round:
                raise _bad(f"server mode at round {ack.round}; the phone is at round {self.round}")
            self.mode, self.window = "server", ack.window
            self.resumable = True  # the server holds the session for a resume from here on
            return True
        if self.mode == "phone" and ack.round == self.round:
            return False
        if ack.round != self.round + 1 or ack.root != self.root:
            raise _bad(f"phone mode at round {ack.round} with root {ack.root}; the phone expects round "
                       f"{self.round + 1} with root {self.root}")
        self.mode, self.window = "phone", 0
        self.held_round, self.round = ack.round - 1, ack.round
        self.x_hat = None  # the MTP head's state is stale: the next tree is the SLM's, its verdict seeds it
        self._prepared = None
        self.node_budget = grant_node_budget(ack.node_budget, self.options.node_budget)
        return True

    def apply_tokens(self: PhoneSession, f: TokensFrame, *, wait_ms: float = 0.0, bytes_down: int = 0
                     ) -> RoundStats | None:
        """Commit a ``tokens`` frame of the stretch; None for a replay of tokens already held."""
        if self.mode != "server":
            raise _bad("a tokens frame arrived in phone mode")
        if f.offset + len(f.tokens) <= len(self.tokens) and f.finish_reason is None:
            return None
        if f.offset != len(self.tokens) or f.round != self.round:
            raise _bad(f"tokens frame at offset {f.offset} of round {f.round}; the phone holds {len(self.tokens)} "
                       f"tokens at round {self.round}")
        self.resumable = True
        ids = [int(t) for t in f.tokens]
        self.tokens.extend(ids)
        choice = f.chunk["choices"][0]
        text = (choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")) or ""
        self.text_parts.append(text)
        if text and self.on_text is not None:
            self.on_text(text)
        if ids:  # the drafter has seen none of them: the SLM drafts over them in its next forward
            self.catch_up = self.catch_up + (self.root, *ids[:-1])
            self.root, self.position = ids[-1], self.position + len(ids)
        stats = RoundStats(f.round, 0, 0, len(ids), 0.0, wait_ms, 0, bytes_down, 0, text, mode="server")
        self.stats.append(stats)
        if f.finish_reason is not None:
            self.finish_reason = f.finish_reason
        return stats

    def ack_frame(self: PhoneSession) -> AckFrame:
        return AckFrame(len(self.tokens))
