"""Server-mode frames (protocol version 3, docs/protocol.md section 4.8-4.13): the session's mode, the tokens
the server drafts and verifies itself, the phone's acknowledgements and a link probe.

A session runs in one of two modes. In **phone** mode the phone drafts trees and the server verifies them
(``tree`` / ``verdict``). In **server** mode the server drafts with its own MTP head, verifies, and streams
the committed tokens (``tokens`` frames) with no round trip per step; the phone drafts nothing and gets no
hand-off. Either side moves at a round boundary::

    phone -> server:  mode {mode, round, window?}   switch at ``round`` (the phone's next round)
                      ack {tokens}                  completion tokens the phone holds (the credit window)
                      ping {nonce}                  a link probe, answered at once by ``pong``
    server -> phone:  mode {mode, round, ...}       the switch done: where the session stands now
                      tokens {round, offset, ...}   committed tokens of a server-mode stretch
                      pong {nonce, ...}             what server mode gives now (offer, tokens per second)

A server-mode **stretch** is one round: it starts with the server's ``mode`` frame of round r and ends with
its ``mode`` frame back to phone, which names round r + 1, the next tree's (an SLM-only tree, whose verdict
carries a seed hand-off, as round 0's does).

>>> from vllm_hyco.handoff.frames import decode_client_frame, encode_frame
>>> decode_client_frame(encode_frame(ModeFrame("server", 4, window=64)))
ModeFrame(mode='server', round=4, window=64)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_hyco.errors import FrameError
from vllm_hyco.handoff._fields import Fields
from vllm_hyco.handoff.limits import WireLimits
from vllm_hyco.handoff.server_frames import chunk_finish_reason, offer_figure

SESSION_MODES = ("phone", "server")
MAX_WINDOW = 1 << 16  # tokens a phone may let the server send beyond its last ack
MAX_NONCE = (1 << 64) - 1
_E = FrameError
_BIG = 1 << 62


# -- phone -> server ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModeFrame:
    """Ask to switch the session to ``mode`` at ``round`` (the phone's next round: no tree of it sent).

    ``window``: in server mode, the completion tokens the server may send beyond the phone's last ``ack``
    (the credit window; absent: the server's default). The server stops decoding when it is used up."""

    TYPE = "mode"
    mode: str
    round: int
    window: int | None = None

    def to_wire(self) -> dict:
        out: dict = {"mode": self.mode, "round": self.round}
        if self.window is not None:
            out["window"] = self.window
        return out

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> ModeFrame:
        mode = f.choice("mode", SESSION_MODES)
        rnd = f.int("round", 0, limits.max_round)
        window = f.int("window", 1, MAX_WINDOW, optional=True)
        f.done()
        if window is not None and mode != "server":
            raise _E("mode.window is the server-mode credit window: send it only with mode 'server'",
                     code="bad_field_value")
        return cls(mode, rnd, window)


@dataclass(frozen=True)
class AckFrame:
    """The completion tokens the phone holds (cumulative): it opens the credit window again."""

    TYPE = "ack"
    tokens: int

    def to_wire(self) -> dict:
        return {"tokens": self.tokens}

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> AckFrame:
        out = cls(f.int("tokens", 0, _BIG))
        f.done()
        return out


@dataclass(frozen=True)
class PingFrame:
    """A link probe: the server answers ``pong`` with the same nonce at once (between rounds or steps)."""

    TYPE = "ping"
    nonce: int

    def to_wire(self) -> dict:
        return {"nonce": self.nonce}

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> PingFrame:
        out = cls(f.int("nonce", 0, MAX_NONCE))
        f.done()
        return out


# -- server -> phone ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModeAckFrame:
    """A switch done (wire type ``mode``). ``round``: in server mode the stretch's round; in phone mode the
    next tree's round, rooted at ``root``. ``tokens``: completion tokens committed before this frame (the
    phone holds them all once the ``tokens`` frames before it are in). ``budget``: nodes granted for the next
    tree (0 in server mode). ``window``: the credit window granted (0 in phone mode). ``exact``: server mode
    verifies exactly (an ε session's stretches are exact too)."""

    TYPE = "mode"
    mode: str
    round: int
    tokens: int
    root: int | None  # the next tree's root (phone mode); None in server mode
    node_budget: int  # wire key "budget"
    window: int
    exact: bool = True

    def to_wire(self) -> dict:
        return {"mode": self.mode, "round": self.round, "tokens": self.tokens, "root": self.root,
                "budget": self.node_budget, "window": self.window, "exact": self.exact}

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> ModeAckFrame:
        mode = f.choice("mode", SESSION_MODES)
        rnd, tokens = f.int("round", 0, limits.max_round), f.int("tokens", 0, _BIG)
        root = f.int("root", 0, limits.max_token_id, optional=True)
        budget, window = f.int("budget", 0, limits.max_node_budget), f.int("window", 0, MAX_WINDOW)
        exact = f.get("exact", bool)
        f.done()
        phone = mode == "phone"
        if phone != (root is not None) or phone != (budget >= 1) or phone == (window >= 1):
            raise _E("mode: phone mode names the next root, a budget >= 1 and window 0; server mode no root, "
                     "budget 0 and a window >= 1", code="bad_field_value")
        return cls(mode, rnd, tokens, root, budget, window, exact)


@dataclass(frozen=True)
class TokensFrame:
    """Committed tokens of a server-mode stretch: ``offset`` completion tokens came before them. The
    ``chunk`` is the OpenAI streaming chunk of their text; its ``finish_reason`` ends the session
    (``final`` follows)."""

    TYPE = "tokens"
    round: int
    offset: int
    tokens: tuple[int, ...]
    chunk: dict

    @property
    def finish_reason(self) -> str | None:
        return self.chunk["choices"][0].get("finish_reason")

    def to_wire(self) -> dict:
        return {"round": self.round, "offset": self.offset,
                "tokens": np.asarray(self.tokens, dtype="<u4").tobytes(), "chunk": self.chunk}

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> TokensFrame:
        rnd, offset = f.int("round", 0, limits.max_round), f.int("offset", 0, _BIG)
        raw, chunk = f.bin("tokens"), f.get("chunk", dict)
        f.done()
        reason = chunk_finish_reason(chunk, limits)
        if len(raw) % 4 or (not raw and reason is None) or len(raw) > 4 * 4096:
            raise _E(f"tokens.tokens must hold 1..4096 uint32 ids (0 only in a finishing frame), got "
                     f"{len(raw)} bytes", code="bad_field_value")
        ids = tuple(int(t) for t in np.frombuffer(raw, dtype="<u4"))
        if any(t > limits.max_token_id for t in ids):
            raise _E("tokens.tokens holds an id over the limit", code="bad_field_value")
        return cls(rnd, offset, ids, chunk)


@dataclass(frozen=True)
class PongFrame:
    """The answer to ``ping``: the nonce, and what server mode gives now: ``offers_server`` (the server
    would take a switch now: it drafts, allows it, and has a place), ``server_tps`` (tokens per second
    its server-mode sessions got lately; 0: none measured), and what a committed token costs the server in
    each mode lately, ``phone_ms`` and ``server_ms`` (ms of server compute; 0: not measured yet)."""

    TYPE = "pong"
    nonce: int
    offers_server: bool
    server_tps: float
    phone_ms: float = 0.0
    server_ms: float = 0.0

    def to_wire(self) -> dict:
        return {"nonce": self.nonce, "offers_server": self.offers_server, "server_tps": float(self.server_tps),
                "phone_ms": float(self.phone_ms), "server_ms": float(self.server_ms)}

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> PongFrame:
        nonce, offers = f.int("nonce", 0, MAX_NONCE), f.get("offers_server", bool)
        tps, phone_ms, server_ms = (offer_figure(f, "pong", k) for k in ("server_tps", "phone_ms", "server_ms"))
        f.done()
        return cls(nonce, offers, tps, phone_ms, server_ms)

