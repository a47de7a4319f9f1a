"""Typed errors for every boundary of vllm_hyco (and, through the shared wire format, mobile_client).

Audience split (docs/decisions.md D17): ``assert`` guards internal invariants; everything a user, an operator
or a phone can get wrong raises one of these, with a message that says what to fix. Each class carries a
stable machine-readable ``code`` that the wire protocol puts in its error frames (docs/protocol.md).
Every error class of the project (plugin and phone) is defined here, and so is the one table of wire error
codes (:data:`ERROR_CODES`: fatal or not, the HTTP status class, meaning), from which :data:`FATAL_CODES`
is derived.
"""

from __future__ import annotations

from typing import NamedTuple


class HycoError(Exception):
    """Base class. ``code`` is stable and goes on the wire; the message is for humans."""

    code: str = "hyco_error"

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class ConfigError(HycoError, ValueError):
    """A bad ``--speculative-config`` / HycoConfig option, or an unsupported topology."""

    code = "bad_config"


class VllmVersionError(HycoError, RuntimeError):
    """The installed vLLM is not the version this plugin was built for."""

    code = "vllm_version"


class HardwareUnsupportedError(HycoError, RuntimeError):
    """The requested path needs hardware this machine does not have (tests turn this into a skip)."""

    code = "hardware_unsupported"


class TreeValidationError(HycoError, ValueError):
    """A token tree that cannot be verified. ``code`` names the rule it broke."""

    code = "bad_tree"


class HandoffSchemaError(HycoError, ValueError):
    """A hand-off payload that does not match its schema (version, fingerprint, layout, sizes)."""

    code = "bad_handoff"


class FrameError(HycoError, ValueError):
    """A malformed or out-of-contract protocol frame."""

    code = "bad_frame"


class RequestFieldError(HycoError, ValueError):
    """A request field that HyCo sessions cannot honour (``unsupported_field``), or, with another code, a
    field whose value vLLM's own validation rejects (``bad_request``) or a model this server does not
    serve (``model_not_found``). ``field`` names it, as the OpenAI routes' 400 does."""

    code = "unsupported_field"

    def __init__(self, field: str, message: str, *, code: str | None = None):
        super().__init__(message, code=code)
        self.field = field


class SessionError(HycoError, RuntimeError):
    """Session-state errors: unknown session, stale or duplicate round, timed out, evicted, closed."""

    code = "session_error"


class KernelInputError(HycoError, ValueError):
    """Inputs a kernel launcher cannot accept (shape, dtype, layout, or a broken precondition)."""

    code = "bad_kernel_input"


class EngineError(HycoError):
    """A refusal or failure reported by the engine to the serving client, with the engine's code
    (``server_busy``, ``session_evicted``, ``bad_root``...); ``internal_error`` when it gave none."""

    code = "internal_error"


class WireError(HycoError):
    """An error the server sends to a phone as an ``error`` frame. ``fatal`` comes from
    :data:`ERROR_CODES` unless the caller overrides it (a resume's impossible ``bad_round`` is fatal)."""

    def __init__(self, message: str, *, code: str, fatal: bool | None = None, round: int | None = None):
        super().__init__(message, code=code)
        self.fatal = code in FATAL_CODES if fatal is None else fatal
        self.round = round

    @property
    def closes(self) -> bool:
        """The server closes the WebSocket after sending it (docs/protocol.md section 7)."""
        return self.code in CLOSING_CODES


# -- the phone's own errors (mobile_client raises them; they live here so every class has one home) -----
class HycoServerError(SessionError):
    """An ``error`` frame from the server (or a refused handshake): ``code``, ``fatal``, ``round``."""

    def __init__(self, message: str, *, code: str, fatal: bool = True, round: int | None = None):
        super().__init__(message, code=code)
        self.fatal, self.round = fatal, round


class PhoneTimeoutError(HycoError, TimeoutError):
    """The server stayed silent past the timeout on every retry."""

    code = "client_timeout"


class ConnectionLostError(HycoError, ConnectionError):
    """The connection kept dropping (or could not be opened) on every retry."""

    code = "connection_lost"


class TreeBuildError(HycoError, ValueError):
    """Drafter outputs that cannot form a tree (wrong row count, NaN, logits instead of log-probs, ...)."""

    code = "bad_draft_input"


class KeepSetError(ConfigError):
    """A keep set that does not fit its vocabulary, its size target, or its saved hash."""

    code = "bad_keep_set"


class KVCaptureError(HycoError, RuntimeError):
    """A tree step in which a cache-owning attention layer did not capture the tree rows' K/V: the engine
    stops rather than compact (and hand off) a KV cache it cannot keep right. A server bug or an
    unsupported compile/backend configuration, never a client's fault."""

    code = "kv_capture"


# -- the wire's error codes ---------------------------------------------------------------------------------
class ErrorCode(NamedTuple):
    """One code of ``error`` frames: fatal by default, the HTTP status the OpenAI routes would give for
    the same fault (4xx: the phone's mistake, fix the request; 5xx: the server's side), what it means."""

    fatal: bool
    status: int
    meaning: str

    @property
    def side(self) -> str:
        return "client" if self.status < 500 else "server"


_C = ErrorCode
#: The one table of wire error codes (docs/protocol.md section 7 prints it; a unit test keeps them equal).
#: Frame decoders raise FrameError / HandoffSchemaError with these codes, the endpoint sends them.
ERROR_CODES: dict[str, ErrorCode] = {
    # framing (raised by vllm_hyco.handoff.frames)
    "bad_msgpack": _C(False, 400,
                   "the message is not one valid msgpack object; send one binary frame per message"),
    "frame_too_large": _C(False, 413, "the frame is over the size limit; shorten the prompt or tree"),
    "bad_field_type": _C(False, 400, "a field has the wrong msgpack type; see section 4 for its type"),
    "bad_field_value": _C(False, 400, "a field's value is out of range or not an allowed value"),
    "missing_field": _C(False, 400, "a required field is absent"),
    "unknown_field": _C(False, 400, "a field this protocol version does not define; drop it or raise `v`"),
    "unknown_type": _C(False, 400, "the frame's `type` is not one this direction accepts"),
    "unsupported_version": _C(True, 400, "the frame's `v` is not a protocol version this server speaks "
                                         "(the message names it and what to upgrade; a version-1 phone gets it "
                                         "as a version-1 error frame)"),
    "bad_request": _C(True, 400, "the OpenAI body in `start` is malformed or vLLM rejects it (the message "
                                 "names the field, as the OpenAI routes' 400 does), or both/neither of "
                                 "`request` and `resume`"),
    "request_too_large": _C(True, 413, "the OpenAI body in `start` is over `max_prompt_bytes`"),
    "model_not_found": _C(True, 404,
                   "the body's `model` is not the one this server serves (the message names it)"),
    "bad_hyco": _C(True, 400, "the `hyco` object in `start` is malformed (mode, epsilon, capabilities, "
                              "resume, fingerprint)"),
    "too_many_nodes": _C(False, 400, "the tree has more nodes than `max_node_budget` (the wire limit)"),
    "bad_tokens": _C(False, 400, "the tree's `tokens` is not n+1 uint32 little-endian ids in range"),
    "bad_parents": _C(False, 400, "`parents` must be n+1 bytes, 0xFF for the root, `0 <= parents[i] < i`"),
    "bad_labels": _C(False, 400, "`labels` must be n+1 bytes, 0 (ROOT) for row 0, 1..4 for the others"),
    "bad_draft_q": _C(False, 400, "`draft_q` records: rows ascending, each row's token among its ids, positive "
                                  "weights, one sampled child per node"),
    # raised by the phone's own decoder on server frames (docs: *phone*)
    "bad_verdict": _C(True, 502, "*phone*: a verdict whose fields contradict each other"),
    "bad_handoff": _C(True, 502, "*phone*: a malformed hand-off"),
    "handoff_version": _C(True, 400, "the hand-off schema is not one this side decodes"),
    "fingerprint_mismatch": _C(True, 409,
                   "server and phone run different models or scales; update the model bundle"),
    "schema_mismatch": _C(True, 409, "a tree's `schema` is not the session's `schema_hash`, or a resumed "
                                     "session restates another schema (*phone*); the session is over: start "
                                     "a new one"),
    "layout_mismatch": _C(True, 409, "*phone*: the hand-off's layer layout differs from the phone's model"),
    "scales_mismatch": _C(True, 409,
                   "*phone*: the hand-off was quantized with other scales than the phone ships"),
    "bad_scales": _C(True, 500, "a scales file or scale array is malformed"),
    "chunk_missing": _C(True, 502, "*phone*: a hand-off chunk never arrived; resume with `need_seed`"),
    "chunk_duplicate": _C(True, 502, "*phone*: a hand-off chunk arrived twice"),
    "chunk_out_of_order": _C(True, 502, "*phone*: hand-off chunks arrived out of order"),
    "chunk_corrupt": _C(True, 502,
                   "*phone*: the reassembled hand-off's size or sha256 differs from `handoff_ref`"),
    # session and transport (raised by the endpoint)
    "unauthorized": _C(True, 401, "missing or wrong API key (HTTP 401 at the WebSocket handshake)"),
    "no_session": _C(False, 409, "a tree arrived before `start` on this connection"),
    "unknown_session": _C(True, 404, "resume names a session the server does not hold (expired or never "
                                     "existed): start over"),
    "bad_round": _C(False, 409, "the tree's round is not the session's next round (fatal when a resume's "
                                "`last_round` is impossible)"),
    "budget_exceeded": _C(False, 400, "the tree has more nodes than the last verdict granted"),
    "too_many_sessions": _C(True, 503, "the server holds its maximum number of sessions; retry later"),
    "idle_timeout": _C(True, 408, "the session was idle past the timeout and was closed"),
    "bad_tree": _C(False, 400,
                   "the tree breaks a semantic rule (duplicate siblings, vocabulary, root token)"),
    "unsupported_field": _C(True, 400,
                   "a request field HyCo sessions cannot honour (e.g. `min_p`, `logit_bias`)"),
    "server_busy": _C(False, 503, "the server cannot take this round now; resend the same tree"),
    "wrong_mode": _C(False, 409, "a tree sent while the session is in server mode; switch back with a `mode` "
                                 "frame first"),
    "mid_round": _C(False, 409, "a switch asked while a round is in flight; wait for its verdict and ask again"),
    "server_mode_unavailable": _C(False, 409, "this server does not draft for phones (no MTP `model`, or the "
                                              "operator forbids server mode): keep drafting on the phone"),
    "phone_mode_unavailable": _C(False, 409, "this server drafts every session itself (`server_mode` \"only\"): "
                                             "stay in server mode"),
    "server_mode_full": _C(False, 503, "every server-mode place is taken (`max_server_sessions`): keep drafting "
                                       "on the phone and ask again later"),
    "session_busy": _C(False, 409, "the session is re-prefilled after a preemption; ask again after its next "
                                   "tokens"),
    "internal_error": _C(True, 500, "a server bug; the message says what failed"),
}
del _C

#: codes whose error frame is fatal unless the raiser says otherwise (derived, never listed by hand)
FATAL_CODES = frozenset(code for code, e in ERROR_CODES.items() if e.fatal)
#: codes after which the server closes the WebSocket (all fatal)
CLOSING_CODES = frozenset({"unauthorized", "too_many_sessions", "idle_timeout", "internal_error"})
assert CLOSING_CODES <= FATAL_CODES
