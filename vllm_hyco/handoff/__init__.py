"""The wire format's single owner (numpy + msgpack, no vLLM, no torch): hand-off, tree and verdict frames.

Modules: ``quant`` (fixed-scale int8 and the scales file), ``schema`` (the session's hand-off schema and the
per-round hand-off), ``client_frames`` (start, tree), ``server_frames`` (session, verdict, handoff_chunk,
error, final), ``frames`` (envelope, versions, encode, decode), ``session_id`` (``"<routing-key>.<random>"``),
``chunks`` (seed chunking and reassembly), ``limits`` (WireLimits, error codes), ``tree_contract``
(what a tree is: labels, depth, ancestor masks, padding, ``validate_tree``), ``sizes`` (byte counts),
``golden`` (``python -m vllm_hyco.handoff.golden DIR``). docs/protocol.md is the spec (protocol version 2).
"""

from vllm_hyco.handoff.chunks import HandoffAssembler, plan_handoff, split_handoff
from vllm_hyco.handoff.client_frames import (
    ClientCapabilities,
    HycoOptions,
    ResumeRequest,
    StartFrame,
    TreeFrame,
)
from vllm_hyco.handoff.frames import PROTOCOL_VERSION, decode_client_frame, decode_server_frame, encode_frame
from vllm_hyco.handoff.limits import DEFAULT_LIMITS, ERROR_CODES, WireLimits
from vllm_hyco.handoff.quant import HandoffScales, dequantize, load_scales, quantize, save_scales
from vllm_hyco.handoff.schema import (
    HANDOFF_SCHEMA_VERSION,
    SCHEMA_HASH_BYTES,
    HandoffHeader,
    HandoffPayload,
    HandoffSpec,
    LayerSpec,
    decode_handoff,
    encode_handoff,
    model_fingerprint,
)
from vllm_hyco.handoff.server_frames import (
    ErrorFrame,
    FinalFrame,
    HandoffChunkFrame,
    HandoffRef,
    SessionFrame,
    VerdictFrame,
    openai_chunk,
)
from vllm_hyco.handoff.session_id import new_session_id, route_key
from vllm_hyco.handoff.tree_contract import NodeLabel

__all__ = [
    "ClientCapabilities",
    "DEFAULT_LIMITS",
    "ERROR_CODES",
    "ErrorFrame",
    "FinalFrame",
    "HANDOFF_SCHEMA_VERSION",
    "HandoffAssembler",
    "HandoffChunkFrame",
    "HandoffHeader",
    "HandoffPayload",
    "HandoffRef",
    "HandoffScales",
    "HandoffSpec",
    "HycoOptions",
    "LayerSpec",
    "NodeLabel",
    "PROTOCOL_VERSION",
    "ResumeRequest",
    "SCHEMA_HASH_BYTES",
    "SessionFrame",
    "StartFrame",
    "TreeFrame",
    "VerdictFrame",
    "WireLimits",
    "decode_client_frame",
    "decode_handoff",
    "decode_server_frame",
    "dequantize",
    "encode_frame",
    "encode_handoff",
    "load_scales",
    "model_fingerprint",
    "new_session_id",
    "openai_chunk",
    "plan_handoff",
    "quantize",
    "route_key",
    "save_scales",
    "split_handoff",
]
