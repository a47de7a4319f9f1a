"""Server -> phone frames: ``session``, ``verdict``, ``handoff_chunk``, ``error`` and ``final``.

``session`` acknowledges every accepted ``start`` (new or resumed): the session id (with the replica's
routing key, ``session_id.py``), the round of the last verdict (-1: none; on a resume a replay of it
follows), the node budget for the next round, and the session's hand-off schema with its hash, which the
phone confirms in its next tree (protocol version 2). A verdict answers tree round r: the accepted path
(rows of that tree, root excluded), the committed token ids (the path's tokens, then the bonus), the bonus
(the next root), the hand-off for the next round (inline, or ``handoff_ref`` plus ``handoff_chunk`` frames
when it is bigger than one chunk), the node budget granted for round r + 1 (docs/decisions.md D3) and the
new text as an OpenAI streaming chunk.
When the request finishes (the chunk's ``finish_reason`` is set) the verdict carries no bonus, no
hand-off and budget 0, and its tokens may stop early (EOS, stop string, max_tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_hyco.errors import FrameError
from vllm_hyco.handoff._fields import Fields
from vllm_hyco.handoff.limits import WireLimits
from vllm_hyco.handoff.schema import (
    SCHEMA_HASH_BYTES,
    HandoffPayload,
    HandoffSpec,
    decode_handoff,
    handoff_to_wire,
)
from vllm_hyco.handoff.session_id import session_id_problem

SHA256_BYTES = 32
CHUNK_OBJECTS = ("chat.completion.chunk", "text_completion")
_E = FrameError


def openai_chunk(
    kind: str,
    completion_id: str,
    model: str,
    text: str,
    finish_reason: str | None = None,
    *,
    created: int | None = None,
    role: str | None = None,
) -> dict:
    """An OpenAI streaming chunk: ``chat.completion.chunk`` (choices[0].delta) or ``text_completion``.

    >>> openai_chunk("text_completion", "cmpl-1", "m", "Hi", created=0)["choices"]
    [{'index': 0, 'text': 'Hi', 'logprobs': None, 'finish_reason': None}]
    """
    created = int(time.time()) if created is None else created
    if kind == "chat.completion.chunk":
        delta = {"role": role, "content": text} if role is not None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    elif kind == "text_completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    else:
        raise ValueError(f"kind must be one of {CHUNK_OBJECTS}, got {kind!r}")
    return {"id": completion_id, "object": kind, "created": created, "model": model, "choices": [choice]}


def chunk_finish_reason(chunk: dict, limits: WireLimits) -> str | None:
    """Validate an OpenAI chunk object structurally (extra OpenAI fields pass); return its finish_reason."""
    f = Fields(chunk, _E, "verdict.chunk")
    for key in ("id", "model"):
        if len(f.get(key, str)) > limits.max_string_bytes:
            raise _E(f"verdict.chunk.{key} is too long", code="bad_field_value")
    kind = f.choice("object", CHUNK_OBJECTS)
    f.int("created", 0, 1 << 62)
    choices = f.get("choices", list)
    if len(choices) != 1:
        raise _E(
            f"verdict.chunk.choices must hold exactly one choice, got {len(choices)}", code="bad_field_value"
        )
    c = Fields(choices[0], _E, "verdict.chunk.choices[0]")
    c.int("index", 0, 0)
    reason = c.get("finish_reason", str, optional=True)
    if kind == "chat.completion.chunk":
        d = Fields(c.get("delta", dict), _E, "verdict.chunk.choices[0].delta")
        d.get("content", str, optional=True)
        d.get("role", str, optional=True)
    else:
        c.get("text", str)
    return reason


@dataclass(frozen=True)
class HandoffRef:
    """Announces a hand-off sent as ``chunks`` handoff_chunk frames after this verdict."""

    chunks: int
    total_bytes: int  # the encoded hand-off's length
    chunk_bytes: int  # every chunk but the last carries exactly this many bytes
    sha256: bytes  # of the encoded hand-off

    def to_wire(self) -> dict:
        return {
            "chunks": self.chunks,
            "bytes": self.total_bytes,
            "chunk_bytes": self.chunk_bytes,
            "sha256": self.sha256,
        }

    @classmethod
    def from_wire(cls, obj: Any, limits: WireLimits) -> HandoffRef:
        f = Fields(obj, _E, "verdict.handoff_ref")
        ref = cls(
            f.int("chunks", 1, 1 << 20),
            f.int("bytes", 1, limits.max_handoff_bytes),
            f.int("chunk_bytes", 1, limits.max_server_frame_bytes - 1024),
            f.bin("sha256"),
        )
        f.done()
        if len(ref.sha256) != SHA256_BYTES:
            raise _E(f"verdict.handoff_ref.sha256 must be {SHA256_BYTES} bytes", code="bad_field_value")
        if ref.chunks != -(-ref.total_bytes // ref.chunk_bytes):
            raise _E(
                f"verdict.handoff_ref: {ref.total_bytes} bytes in chunks of {ref.chunk_bytes} make "
                f"{-(-ref.total_bytes // ref.chunk_bytes)} chunks, not {ref.chunks}",
                code="bad_field_value",
            )
        return ref


def offer_figure(f: Fields, where: str, key: str) -> float:
    """One figure of the server's offer (``pong``, ``session``): a float in [0, 1e9); 0.0 when absent."""
    value = float(f.get(key, (float, int), optional=True, default=0.0))
    if not 0.0 <= value < 1e9:
        raise _E(f"{where}.{key} = {value} is outside [0, 1e9)", code="bad_field_value")
    return value


@dataclass(frozen=True)
class SessionFrame:
    """The start acknowledgement: the session id and the session's hand-off schema, stated once."""

    TYPE = "session"
    session_id: str  # "<routing-key>.<random>"
    last_round: int  # the round of the server's last verdict; -1: none (a new session)
    node_budget: int  # draft nodes granted for the next round (0 once finished; wire key "budget")
    schema: HandoffSpec  # the layout of every hand-off of this session
    mode: str = "phone"  # the session's mode now (protocol v3): "phone" or "server"
    tokens: int = 0  # completion tokens committed so far (v3)
    offers_server: bool = False  # the server would take a switch to server mode now (v3)
    server_tps: float = 0.0  # v3, as pong's: tokens per second of server-mode sessions lately (0: unknown)
    phone_ms: float = 0.0  # v3, as pong's: server ms per token committed in phone mode lately (0: unknown)
    server_ms: float = 0.0  # v3, as pong's: the same in server mode

    @property
    def schema_hash(self) -> bytes:
        return self.schema.schema_hash

    def to_wire(self) -> dict:
        return {
            "sid": self.session_id,
            "last_round": self.last_round,
            "budget": self.node_budget,
            "schema": self.schema.to_wire(),
            "schema_hash": self.schema.schema_hash,
            "mode": self.mode,
            "tokens": self.tokens,
            "offers_server": self.offers_server,
            "server_tps": float(self.server_tps),
            "phone_ms": float(self.phone_ms),
            "server_ms": float(self.server_ms),
        }

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> SessionFrame:
        sid = _sid(f.get("sid", str), "session")
        last_round = f.int("last_round", -1, limits.max_round)
        node_budget = f.int("budget", 0, limits.max_node_budget)
        schema = HandoffSpec.from_wire(f.get("schema", dict), limits)
        stated = f.bin("schema_hash")
        mode = f.choice("mode", ("phone", "server"))
        tokens, offers = f.int("tokens", 0, 1 << 62), f.get("offers_server", bool)
        tps, phone_ms, server_ms = (offer_figure(f, "session", k) for k in ("server_tps", "phone_ms", "server_ms"))
        f.done()
        if stated != schema.schema_hash:
            raise _E(
                f"session.schema_hash {stated.hex()} is not the hash of session.schema "
                f"({schema.schema_hash.hex()}: the first {SCHEMA_HASH_BYTES} bytes of sha256 of its encoding)",
                code="bad_field_value",
            )
        return cls(sid, last_round, node_budget, schema, mode, tokens, offers, tps, phone_ms, server_ms)


@dataclass(frozen=True)
class VerdictFrame:
    TYPE = "verdict"
    round: int
    path: tuple[int, ...]  # accepted rows of the round's tree, root excluded, increasing
    tokens: tuple[int, ...]  # committed ids: the path's tokens, then the bonus
    bonus: int | None  # the next root; None once finished
    handoff: HandoffPayload | None
    handoff_ref: HandoffRef | None
    node_budget: int  # draft nodes granted for the next round; 0 once finished (wire key "budget")
    chunk: dict  # OpenAI streaming chunk with this round's text

    @property
    def finish_reason(self) -> str | None:
        return self.chunk["choices"][0].get("finish_reason")

    def to_wire(self) -> dict:
        out = {
            "round": self.round,
            "path": bytes(self.path),
            "tokens": np.asarray(self.tokens, dtype="<u4").tobytes(),
            "bonus": self.bonus,
        }
        if self.handoff is not None:
            out["handoff"] = handoff_to_wire(self.handoff)
        if self.handoff_ref is not None:
            out["handoff_ref"] = self.handoff_ref.to_wire()
        out["budget"] = self.node_budget
        out["chunk"] = self.chunk
        return out

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits, schema: HandoffSpec | None = None) -> VerdictFrame:
        """``schema``: the session's (from its ``session`` frame); needed to read an inline hand-off."""
        rnd = f.int("round", 0, limits.max_round)
        path, tokens_raw = f.bin("path"), f.bin("tokens")
        bonus = f.int("bonus", 0, limits.max_token_id, optional=True)
        handoff_raw = f.get("handoff", dict, optional=True)
        ref_raw = f.get("handoff_ref", dict, optional=True)
        node_budget = f.int("budget", 0, limits.max_node_budget)
        chunk = f.get("chunk", dict)
        f.done()
        reason = chunk_finish_reason(chunk, limits)
        if (
            len(path) > limits.max_node_budget
            or any(not 1 <= r <= limits.max_node_budget for r in path)
            or any(a >= b for a, b in zip(path, path[1:]))
        ):
            raise _E(
                f"verdict.path {list(path)} must be increasing tree rows in 1..{limits.max_node_budget}",
                code="bad_verdict",
            )
        if len(tokens_raw) % 4 or not 4 <= len(tokens_raw) <= 4 * (len(path) + 1):
            raise _E(
                f"verdict.tokens must hold 1..{len(path) + 1} uint32 ids, got {len(tokens_raw)} bytes",
                code="bad_verdict",
            )
        tokens = tuple(int(t) for t in np.frombuffer(tokens_raw, dtype="<u4"))
        ref = None if ref_raw is None else HandoffRef.from_wire(ref_raw, limits)
        handoff = None
        if handoff_raw is not None:
            if schema is None:
                raise _E(
                    "verdict: an inline hand-off arrived before the session frame stated the schema",
                    code="bad_verdict",
                )
            handoff = decode_handoff(handoff_raw, schema, limits=limits)
        verdict = cls(rnd, tuple(path), tokens, bonus, handoff, ref, node_budget, chunk)
        _check_verdict(verdict, reason)
        return verdict


def _check_verdict(v: VerdictFrame, reason: str | None) -> None:
    if reason is not None:
        if v.bonus is not None or v.handoff is not None or v.handoff_ref is not None or v.node_budget != 0:
            raise _E(
                "verdict: a finished round (finish_reason set) carries no bonus, no hand-off and budget 0",
                code="bad_verdict",
            )
        return
    if v.bonus is None or len(v.tokens) != len(v.path) + 1 or v.tokens[-1] != v.bonus:
        raise _E(
            f"verdict: an unfinished round commits the path's {len(v.path)} tokens then the bonus "
            f"{v.bonus}, got tokens {list(v.tokens)}",
            code="bad_verdict",
        )
    if (v.handoff is None) == (v.handoff_ref is None) or v.node_budget < 1:
        raise _E(
            "verdict: an unfinished round carries exactly one of handoff / handoff_ref and budget >= 1",
            code="bad_verdict",
        )
    if v.handoff is not None and v.handoff.bonus_token != v.bonus:
        raise _E(
            f"verdict: hand-off bonus {v.handoff.bonus_token} != verdict bonus {v.bonus}", code="bad_verdict"
        )


def _sid(raw: str, where: str) -> str:
    problem = session_id_problem(raw)
    if problem is not None:
        raise _E(f"{where}.sid: {problem}", code="bad_field_value")
    return raw


@dataclass(frozen=True)
class HandoffChunkFrame:
    TYPE = "handoff_chunk"
    round: int
    index: int  # 0-based
    count: int
    data: bytes

    def to_wire(self) -> dict:
        return {"round": self.round, "index": self.index, "count": self.count, "data": self.data}

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> HandoffChunkFrame:
        rnd, count = f.int("round", 0, limits.max_round), f.int("count", 1, 1 << 20)
        index, data = f.int("index", 0, count - 1), f.bin("data")
        f.done()
        if not data:
            raise _E("handoff_chunk.data is empty", code="bad_field_value")
        return cls(rnd, index, count, data)


@dataclass(frozen=True)
class ErrorFrame:
    TYPE = "error"
    code: str
    message: str
    fatal: bool  # the server closes the connection after a fatal error
    round: int | None = None

    def to_wire(self) -> dict:
        out = {"code": self.code, "message": self.message, "fatal": self.fatal}
        if self.round is not None:
            out["round"] = self.round
        return out

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> ErrorFrame:
        code, message = f.get("code", str), f.get("message", str)
        if not 1 <= len(code) <= 64 or len(message) > limits.max_string_bytes:
            raise _E("error.code must be 1..64 characters and error.message short", code="bad_field_value")
        out = cls(code, message, f.get("fatal", bool), f.int("round", 0, limits.max_round, optional=True))
        f.done()
        return out


@dataclass(frozen=True)
class FinalFrame:
    """Ends a session: OpenAI usage plus HyCo statistics (rounds, mean accepted tokens, bytes)."""

    TYPE = "final"
    session_id: str
    prompt_tokens: int
    completion_tokens: int
    rounds: int
    mat: float  # mean committed tokens per round (accepted path + bonus)
    bytes_up: int  # frame bytes the server received in this session
    bytes_down: int  # frame bytes it sent (this frame excluded)
    server_tokens: int = 0  # completion tokens committed in server mode (v3); ``mat`` counts phone rounds only

    def to_wire(self) -> dict:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        stats = {
            "rounds": self.rounds,
            "mat": float(self.mat),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "server_tokens": self.server_tokens,
        }
        return {"sid": self.session_id, "usage": usage, "stats": stats}

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> FinalFrame:
        sid = _sid(f.get("sid", str), "final")
        u = Fields(f.get("usage", dict), _E, "final.usage")
        s = Fields(f.get("stats", dict), _E, "final.stats")
        f.done()
        big = 1 << 62
        prompt, completion = u.int("prompt_tokens", 0, big), u.int("completion_tokens", 0, big)
        if u.int("total_tokens", 0, big) != prompt + completion:
            raise _E(
                "final.usage.total_tokens must equal prompt_tokens + completion_tokens",
                code="bad_field_value",
            )
        u.done()
        rounds, mat = s.int("rounds", 0, big), s.get("mat", float)
        if not 0.0 <= mat <= limits.max_node_budget + 1:
            raise _E(
                f"final.stats.mat = {mat} is outside [0, {limits.max_node_budget + 1}]", code="bad_field_value"
            )
        out = cls(
            sid, prompt, completion, rounds, mat, s.int("bytes_up", 0, big), s.int("bytes_down", 0, big),
            s.int("server_tokens", 0, completion),
        )
        s.done()
        return out
