"""Wire limits (one frozen dataclass, passed in), and the error-code table re-exported from vllm_hyco.errors.

The decoders in this package enforce the structural limits; the endpoint enforces the session ones
(sessions per server, idle time) with the codes of ``vllm_hyco.errors.ERROR_CODES``, so a phone sees one
code table (docs/protocol.md, "Errors").
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm_hyco.errors import ERROR_CODES, FATAL_CODES, ConfigError
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET

AIOHTTP_DEFAULT_MAX_MSG = 4 * 1024 * 1024  # aiohttp ClientSession.ws_connect(max_msg_size=4 MiB)


@dataclass(frozen=True)
class WireLimits:
    """Structural limits every decoder checks. Defaults fit the paper's setting (B = 32, W = 1,024)."""

    max_node_budget: int = DEFAULT_NODE_BUDGET  # draft nodes per tree, root excluded (tree_contract)
    max_client_frame_bytes: int = 1 << 20  # any phone -> server frame
    max_prompt_bytes: int = 768 << 10  # the msgpack-encoded OpenAI body inside `start`
    max_server_frame_bytes: int = AIOHTTP_DEFAULT_MAX_MSG  # any server -> phone frame
    chunk_bytes: int = 1 << 20  # hand-off bytes per handoff_chunk frame
    max_handoff_positions: int = 1024  # K/V positions in one hand-off (the ring size W)
    max_handoff_bytes: int = 64 << 20  # one encoded hand-off (a reassembled seed included)
    max_hidden_size: int = 65536
    max_layers: int = 16  # layers listed in a hand-off header
    max_kv_channels: int = 65536  # kv_heads * head_dim of one layer
    max_token_id: int = 2**31 - 1
    max_round: int = 2**31 - 1
    max_string_bytes: int = 64 << 10  # ids, messages and texts inside frames

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"WireLimits.{f.name} must be a positive int, got {value!r}")
        if self.max_node_budget > 254:
            raise ConfigError(
                f"WireLimits.max_node_budget={self.max_node_budget}: parents travel as uint8 with 0xFF for "
                f"the root, so at most 254 nodes fit; lower it"
            )
        if self.chunk_bytes + 1024 > self.max_server_frame_bytes:
            raise ConfigError(
                f"WireLimits.chunk_bytes={self.chunk_bytes} leaves no room for the chunk frame's "
                f"own fields under max_server_frame_bytes={self.max_server_frame_bytes}; "
                f"use at most max_server_frame_bytes - 1024"
            )


DEFAULT_LIMITS = WireLimits()


# The table of error codes that go in error frames lives with the error classes (vllm_hyco.errors:
# fatal or not, the HTTP status class, meaning); it is re-exported here for the wire format's users.
__all__ = ["AIOHTTP_DEFAULT_MAX_MSG", "DEFAULT_LIMITS", "ERROR_CODES", "FATAL_CODES", "WireLimits"]
