"""Session ids that name their replica, and the routing key a phone presents at the handshake.

A server started with the hyco option ``replica_id`` issues session ids ``"<replica-id>.<random>"``: the
ASCII bytes of the id, exactly ``SESSION_ID_BYTES`` long (the wire's ``bin[16]``), the random part drawn
from 62 letters and digits by ``secrets`` (9 characters, about 53 bits, for the longest replica id; more for
shorter ones). A server without a replica id issues 16 random bytes, as before.

On a reconnect the phone puts the session id's text in the WebSocket URL, ``?hyco_session=<key>``
(:func:`routing_key`), so that a proxy can route on it without reading frames: nginx maps the part before
the dot to that replica's upstream (``deploy/nginx-hyco.conf``). The key only routes; the server still
looks the session up by the id in the resume frame, and a server whose replica id differs from the id's
prefix answers ``unknown_session`` without looking (:func:`owned_by`).

>>> sid = new_session_id("r0")
>>> len(sid), sid[:3], replica_of(sid), owned_by(sid, "r0"), owned_by(sid, "r1")
(16, b'r0.', 'r0', True, False)
>>> routing_key(sid) == sid.decode()
True
>>> routing_key(bytes(range(16)))  # a legacy random id: its hex, which names no replica
'000102030405060708090a0b0c0d0e0f'
"""

from __future__ import annotations

import re
import secrets
import string

from vllm_hyco.handoff.client_frames import SESSION_ID_BYTES

#: the query parameter that carries the routing key on a reconnect (nginx reads it as ``$arg_hyco_session``)
ROUTING_PARAM = "hyco_session"
MAX_REPLICA_ID_CHARS = 6  # leaves 9 random characters in the 16 bytes
REPLICA_ID_RE = re.compile(rf"[a-z0-9][a-z0-9-]{{0,{MAX_REPLICA_ID_CHARS - 1}}}")
_ALPHABET = string.ascii_letters + string.digits
_KEY_RE = re.compile(r"[a-z0-9][a-z0-9-]*\.[A-Za-z0-9]+")


def check_replica_id(value: object) -> str | None:
    """Returns the replica id or None; a bad one raises ValueError with the rule (config.py wraps it)."""
    if value is None:
        return None
    if not isinstance(value, str) or not REPLICA_ID_RE.fullmatch(value):
        raise ValueError(f"hyco option replica_id={value!r} is invalid: use 1 to {MAX_REPLICA_ID_CHARS} "
                         f"characters of a-z, 0-9 and '-', starting with a letter or digit (for example "
                         f"\"r0\"), or null for a single server")
    return value


def new_session_id(replica_id: str | None) -> bytes:
    """A fresh session id: ``b"<replica-id>.<random>"`` (16 bytes); 16 random bytes without a replica id."""
    if replica_id is None:
        return secrets.token_bytes(SESSION_ID_BYTES)
    check_replica_id(replica_id)
    n = SESSION_ID_BYTES - len(replica_id) - 1
    return f"{replica_id}.{''.join(secrets.choice(_ALPHABET) for _ in range(n))}".encode("ascii")


def replica_of(sid: bytes) -> str | None:
    """The replica id a session id names, or None (a legacy random id)."""
    try:
        text = sid.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text.split(".", 1)[0] if _KEY_RE.fullmatch(text) else None


def owned_by(sid: bytes, replica_id: str | None) -> bool:
    """Whether a server with ``replica_id`` may hold ``sid`` (a server without one may hold any id)."""
    return replica_id is None or replica_of(sid) == replica_id


def routing_key(sid: bytes) -> str:
    """The text a phone presents as ``?hyco_session=``: the id when it names a replica, else its hex."""
    return sid.decode("ascii") if replica_of(sid) is not None else sid.hex()
