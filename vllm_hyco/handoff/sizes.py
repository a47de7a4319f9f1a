"""Byte counts of the wire format for a given layer layout (measured by encoding, not estimated).

The paper (Algorithm 4, line 14) counts the hand-off as 44 B + 2H B per round + (K/V values) B per
committed position at 8 bits. Our per-round hand-off (protocol version 2) carries the same int8 values plus
msgpack framing: the span, the bonus id and the bin-length prefixes; the self-describing schema (layer
list, fingerprint, scales id) travels once per session in the ``session`` frame
(:func:`session_frame_bytes`). :func:`verdict_bytes` returns ours and the paper's count, and the verdict
around the hand-off (path, committed ids, budget, the OpenAI chunk with the text); docs/protocol.md
tabulates them.

>>> spec = spec_from_hf_config(FIXTURE_VERIFIER_CONFIG)
>>> (spec.values_per_round, spec.values_per_position)
(512, 2048)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_hyco.handoff.chunks import split_handoff
from vllm_hyco.handoff.client_frames import TreeFrame
from vllm_hyco.handoff.frames import encode_frame
from vllm_hyco.handoff.limits import DEFAULT_LIMITS, WireLimits
from vllm_hyco.handoff.schema import FINGERPRINT_BYTES, HandoffPayload, HandoffSpec, LayerSpec, encode_handoff
from vllm_hyco.handoff.server_frames import SessionFrame, VerdictFrame, openai_chunk
from vllm_hyco.handoff.session_id import RANDOM_HEX_CHARS
from vllm_hyco.models import family_of

PAPER_HEADER_BYTES = 44

# The tiny verifier of hyco_lab.fixtures (FixtureOptions defaults; a test keeps the two equal).
FIXTURE_VERIFIER_CONFIG = {
    "model_type": "gemma4_text",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "num_key_value_heads": 2,
    "num_global_key_value_heads": 1,
    "head_dim": 256,
    "global_head_dim": 512,
    "sliding_window": 128,
    "attention_k_eq_v": True,
    "vocab_size": 4096,
}


def layers_from_hf_config(cfg: Mapping[str, Any]) -> tuple[int, tuple[LayerSpec, ...]]:
    """(hidden, hand-off layers) of a verifier's config, by the rule of its model family
    (``vllm_hyco.models``: for Gemma 4 its last sliding and last full cache-owning layer)."""
    family = family_of(cfg)
    layers = tuple(LayerSpec(h.layer_id, h.kind, h.kv_heads, h.head_dim, h.window, k_eq_v=h.k_eq_v,
                             has_v=h.has_v) for h in family.handoff_layers(cfg))
    return family.hidden_size(cfg), layers


def spec_from_hf_config(
    cfg: dict, fingerprint: bytes = bytes(FINGERPRINT_BYTES), scales_id: bytes = bytes(FINGERPRINT_BYTES)
) -> HandoffSpec:
    hidden, layers = layers_from_hf_config(cfg)
    return HandoffSpec(fingerprint, hidden, layers, scales_id)


def paper_handoff_bytes(spec: HandoffSpec, positions: int) -> int:
    """The paper's count: 44 B header + 2H B + values_per_position B per position."""
    return PAPER_HEADER_BYTES + spec.values_per_round + spec.values_per_position * positions


def handoff_bytes(spec: HandoffSpec, positions: int, root_position: int = 4096) -> int:
    """Exact length of one encoded hand-off carrying ``positions`` K/V rows."""
    root_position = max(root_position, positions)
    payload = HandoffPayload.make_dummy(spec, root_position - positions, root_position, bonus_token=100_000)
    return len(encode_handoff(payload))


def tree_frame_bytes(
    num_nodes: int,
    labels: bool = True,
    round: int = 1000,
    token: int = 200_000,
    values: bool = False,
    schema: bool = False,
) -> int:
    """Uplink per round: one tree frame with ``num_nodes`` draft nodes (a chain; ids of 3 bytes);
    ``values``: with per-node values, ``schema``: with the schema hash (the first tree after ``session``)."""
    tokens = [token + i for i in range(num_nodes + 1)]
    parents = [-1] + list(range(num_nodes))
    labs = [0] + [1] * num_nodes if labels else None
    vals = [255] + [max(0, 250 - 7 * i) for i in range(num_nodes)] if values else None
    frame = TreeFrame.from_lists(round, tokens, parents, labs, vals, bytes(8) if schema else None)
    return len(encode_frame(frame))


def session_frame_bytes(spec: HandoffSpec, route_key: str = "r1", node_budget: int = 32) -> int:
    """Downlink once per session (and per resume): the ``session`` frame with the schema."""
    sid = f"{route_key}.{'0' * RANDOM_HEX_CHARS}"
    return len(encode_frame(SessionFrame(sid, -1, node_budget, spec)))


def verdict_bytes(
    spec: HandoffSpec,
    accepted: int,
    chars_per_token: int = 4,
    round: int = 1000,
    limits: WireLimits = DEFAULT_LIMITS,
) -> dict:
    """Downlink of a round that accepts ``accepted`` draft nodes (commits accepted + 1 tokens).

    Returns the verdict frame's bytes, its hand-off's bytes and the paper's count for the same rows.
    """
    positions = accepted + 1  # the root's row plus the accepted path's rows get K/V
    payload = HandoffPayload.make_dummy(spec, 4096 - positions, 4096, bonus_token=100_000)
    chunk = openai_chunk(
        "chat.completion.chunk",
        "chatcmpl-" + "0" * 32,
        "model",
        "x" * (chars_per_token * positions),
        created=1_750_000_000,
    )
    verdict = VerdictFrame(
        round,
        tuple(range(1, accepted + 1)),
        tuple([100_000] * positions),
        100_000,
        payload,
        None,
        limits.max_node_budget,
        chunk,
    )
    frame = len(encode_frame(verdict))
    return {
        "verdict": frame,
        "handoff": len(encode_handoff(payload)),
        "paper_handoff": paper_handoff_bytes(spec, positions),
    }


def seed_bytes(spec: HandoffSpec, positions: int, limits: WireLimits = DEFAULT_LIMITS) -> dict:
    """The first verdict's seed hand-off (``positions`` = min(W, prompt length)), sent in chunks."""
    payload = HandoffPayload.make_dummy(spec, 0, positions, bonus_token=100_000)
    encoded = encode_handoff(payload)
    ref, frames = split_handoff(encoded, 0, limits.chunk_bytes)
    return {
        "handoff": len(encoded),
        "chunks": ref.chunks,
        "chunk_bytes": ref.chunk_bytes,
        "chunk_frames": sum(len(encode_frame(f)) for f in frames),
        "max_frame": max(len(encode_frame(f)) for f in frames),
        "paper_handoff": paper_handoff_bytes(spec, positions),
    }


def size_report(
    cfg: dict, seed_positions: int, max_accepted: int = 4, limits: WireLimits = DEFAULT_LIMITS
) -> dict:
    """Everything the benchmark prints for one model: per-round up/down, per-position, seed."""
    spec = spec_from_hf_config(cfg)
    one, two = handoff_bytes(spec, 1), handoff_bytes(spec, 2)
    return {
        "hidden_size": spec.hidden_size,
        "layers": [layer.to_wire() for layer in spec.layers],
        "values_per_round": spec.values_per_round,
        "values_per_position": spec.values_per_position,
        "handoff_fixed_bytes": one - (two - one),  # header + bonus + e + h + framing
        "handoff_bytes_per_position": two - one,
        "paper_fixed_bytes": PAPER_HEADER_BYTES + spec.values_per_round,
        "handoff_over_paper_bytes": one - paper_handoff_bytes(spec, 1),  # the same at every P
        "session_frame_bytes": session_frame_bytes(spec, node_budget=limits.max_node_budget),
        "tree_frame_bytes": {n: tree_frame_bytes(n) for n in (0, 8, 16, 32)},
        "tree_frame_bytes_values": {n: tree_frame_bytes(n, values=True) for n in (0, 8, 16, 32)},
        "tree_frame_bytes_no_labels": {n: tree_frame_bytes(n, labels=False) for n in (0, 8, 16, 32)},
        "rounds": {a: verdict_bytes(spec, a, limits=limits) for a in range(max_accepted + 1)},
        "seed": seed_bytes(spec, seed_positions, limits),
    }
