"""Typed errors for every boundary of vllm_hyco (and, through the shared wire format, mobile_client).

Audience split (style guide 10): ``assert`` guards internal invariants; everything a user, an operator
or a phone can get wrong raises one of these, with a message that says what to fix. Each class carries a
stable machine-readable ``code`` that the wire protocol puts in its error frames (docs/protocol.md).
"""

from __future__ import annotations


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
    """A request field that HyCo sessions (or speculative decoding in general) cannot honour."""

    code = "unsupported_field"

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class SessionError(HycoError, RuntimeError):
    """Session-state errors: unknown session, stale or duplicate round, timed out, evicted, closed."""

    code = "session_error"


class KVCaptureError(HycoError, RuntimeError):
    """A tree step in which a cache-owning attention layer did not capture the tree rows' K/V: the engine
    stops rather than compact (and hand off) a KV cache it cannot keep right. A server bug or an
    unsupported compile/backend configuration, never a client's fault."""

    code = "kv_capture"
