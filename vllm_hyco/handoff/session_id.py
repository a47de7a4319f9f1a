"""Session ids (protocol version 2): ``"<routing-key>.<random>"``, issued by the server in the ``session`` frame.

The routing key names the replica that holds the session (the operator's ``VLLM_HYCO_ROUTE_KEY``); the
random part (128 bits, lowercase hex) makes the id unguessable. A phone that reconnects to resume presents
the routing key at the WebSocket handshake (``GET /v1/hyco/session?route=<routing-key>``), so an ordinary
L7 proxy can send it to the replica that holds the session by mapping (or hashing) that one parameter,
without parsing frames and without shared state (docs/protocol.md section 3, "Session ids and routing").

Validation is strict everywhere a session id is decoded (``session`` and ``final`` frames,
``start.hyco.resume.session_id``): anything but the exact format is refused.

>>> sid = new_session_id("r1")
>>> route_key(sid), len(sid)
('r1', 35)
>>> is_session_id("r1.ABC")
False
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from vllm_hyco.errors import ConfigError

ROUTE_KEY_PATTERN = r"[a-z0-9][a-z0-9-]{0,31}"  # 1..32 characters: lowercase letters, digits, '-'
RANDOM_HEX_CHARS = 32  # 128 random bits
SESSION_ID_RE = re.compile(rf"({ROUTE_KEY_PATTERN})\.([0-9a-f]{{{RANDOM_HEX_CHARS}}})")
ROUTE_KEY_RE = re.compile(ROUTE_KEY_PATTERN)
MAX_SESSION_ID_CHARS = 32 + 1 + RANDOM_HEX_CHARS
DEFAULT_ROUTE_KEY = "hyco"
ROUTE_QUERY_PARAM = "route"  # the handshake's query parameter that carries the routing key on a resume


def check_route_key(key: str) -> str:
    """The replica's routing key, or ConfigError naming the format."""
    if not isinstance(key, str) or ROUTE_KEY_RE.fullmatch(key) is None:
        raise ConfigError(
            f"routing key {key!r}: use 1..32 characters of lowercase letters, digits and '-', starting "
            f"with a letter or digit (e.g. 'r1' or 'gpu-node-3')"
        )
    return key


def new_session_id(key: str) -> str:
    """A fresh session id for this replica: ``"<key>.<32 random hex chars>"``."""
    return f"{check_route_key(key)}.{secrets.token_hex(RANDOM_HEX_CHARS // 2)}"


def is_session_id(value: Any) -> bool:
    return isinstance(value, str) and SESSION_ID_RE.fullmatch(value) is not None


def route_key(session_id: str) -> str:
    """The routing key of a well-formed session id (ValueError otherwise)."""
    m = SESSION_ID_RE.fullmatch(session_id) if isinstance(session_id, str) else None
    if m is None:
        raise ValueError(f"not a session id: {session_id!r}")
    return m.group(1)


def session_id_problem(value: Any) -> str | None:
    """None for a well-formed session id, else what is wrong with it (for error messages)."""
    if is_session_id(value):
        return None
    shown = repr(value[:80]) if isinstance(value, str) else type(value).__name__
    return (
        f"{shown} is not a session id: expected '<routing-key>.<random>' with a routing key of 1..32 "
        f"characters [a-z0-9-] (not starting with '-') and {RANDOM_HEX_CHARS} lowercase hex characters, "
        f"as the server's `session` frame gave it"
    )
