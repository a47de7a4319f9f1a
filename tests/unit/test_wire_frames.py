"""Frames of both directions: round trips, size bounds, every validation path (vllm_hyco.handoff.frames)."""

import msgpack
import numpy as np
import pytest

from vllm_hyco.errors import ConfigError, FrameError, HandoffSchemaError
from vllm_hyco.handoff.client_frames import (
    ClientCapabilities,
    HycoOptions,
    ResumeRequest,
    StartFrame,
    TreeFrame,
)
from vllm_hyco.handoff.frames import decode_client_frame, decode_server_frame, encode_frame, frame_to_wire
from vllm_hyco.handoff.limits import ERROR_CODES, WireLimits
from vllm_hyco.handoff.schema import HandoffPayload, HandoffSpec, LayerSpec
from vllm_hyco.handoff.server_frames import (
    ErrorFrame,
    FinalFrame,
    HandoffChunkFrame,
    HandoffRef,
    SessionFrame,
    VerdictFrame,
    openai_chunk,
)
from vllm_hyco.handoff.tree_contract import NodeLabel

SID = "r1." + bytes(range(16)).hex()
SPEC = HandoffSpec(
    bytes(16), 4, (LayerSpec(0, "sliding", 1, 4, 16), LayerSpec(1, "full", 1, 8, 0, True)), bytes(16)
)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def tree32(labels=True):
    parents = [-1] + [max(0, i - 1 - (i % 3)) for i in range(1, 33)]
    labs = [0] + [1 + i % 4 for i in range(32)] if labels else None
    return TreeFrame.from_lists(123456, [262143 - i for i in range(33)], parents, labs)


def verdict(**kw):
    args = dict(
        round=2,
        path=(1, 3),
        tokens=(7, 8, 9),
        bonus=9,
        handoff=HandoffPayload.make_dummy(SPEC, 10, 13, bonus_token=9),
        handoff_ref=None,
        node_budget=32,
        chunk=openai_chunk("chat.completion.chunk", "c", "m", "abc", created=5),
    )
    args.update(kw)
    return VerdictFrame(**args)


def raw(frame, **changes):
    obj = frame_to_wire(frame)
    for key, value in changes.items():
        if value is KeyError:
            del obj[key]
        else:
            obj[key] = value
    return msgpack.packb(obj, use_bin_type=True)


def err(fn, data, code, **kw):
    with pytest.raises((FrameError, HandoffSchemaError)) as e:
        fn(data, **kw)
    assert e.value.code == code, (e.value.code, str(e.value))
    assert e.value.code in ERROR_CODES
    return str(e.value)


CLIENT_FRAMES = [
    StartFrame("chat.completions", CHAT, HycoOptions()),
    StartFrame(
        "completions",
        {"prompt": [1, 2, 3]},
        HycoOptions("epsilon", 0.002, ClientCapabilities(8, False), b"\x01" * 32),
    ),
    StartFrame(
        "chat.completions", None, HycoOptions(resume=ResumeRequest(SID, -1, True), fingerprint=bytes(16))
    ),
    tree32(),
    tree32(labels=False),
    TreeFrame.from_lists(0, [5], [-1], [0]),
    TreeFrame.from_lists(0, [5, 6, 7], [-1, 0, 1], None, [255, 100, 3], SPEC.schema_hash),
]
SERVER_FRAMES = [
    verdict(),
    verdict(handoff=None, handoff_ref=HandoffRef(2, 10, 8, bytes(32))),
    verdict(
        bonus=None,
        handoff=None,
        tokens=(7,),
        node_budget=0,
        chunk=openai_chunk("text_completion", "c", "m", "x", "length", created=5),
    ),
    HandoffChunkFrame(0, 1, 2, b"ab"),
    ErrorFrame("bad_round", "send round 3", False, 2),
    ErrorFrame("internal_error", "boom", True),
    FinalFrame(SID, 10, 20, 6, 20 / 6, 1000, 90000),
    SessionFrame(SID, -1, 32, SPEC),
    SessionFrame(SID, 7, 0, SPEC),
]


@pytest.mark.parametrize("frame", CLIENT_FRAMES, ids=lambda f: f.TYPE)
def test_client_frames_round_trip(frame):
    data = encode_frame(frame)
    back = decode_client_frame(data)
    assert back == frame and encode_frame(back) == data


@pytest.mark.parametrize("frame", SERVER_FRAMES, ids=lambda f: f.TYPE)
def test_server_frames_round_trip(frame):
    data = encode_frame(frame)
    back = decode_server_frame(data, schema=SPEC)
    assert back == frame and encode_frame(back) == data


def test_a_32_node_tree_frame_fits_in_256_bytes():
    assert len(encode_frame(tree32())) <= 256
    big_round = TreeFrame(2**31 - 1, tree32().tokens, tree32().parents, tree32().labels)
    assert len(encode_frame(big_round)) <= 256


def test_tree_wire_layout():
    t = decode_client_frame(encode_frame(tree32()))
    assert t.num_nodes == 32 and t.parents[0] == -1 and t.labels[0] == NodeLabel.ROOT
    w = frame_to_wire(tree32())
    assert list(w)[:2] == ["type", "v"] and w["parents"][0] == 0xFF and len(w["tokens"]) == 33 * 4
    assert int.from_bytes(w["tokens"][:4], "little") == 262143


@pytest.mark.parametrize(
    "changes, code",
    [
        (dict(tokens=b"\x01\x00\x00"), "bad_tokens"),
        (dict(tokens=b""), "bad_tokens"),
        (dict(tokens=b"\xff\xff\xff\xff" * 33), "bad_tokens"),
        (
            dict(tokens=b"\x01\x00\x00\x00" * 34, parents=b"\xff" + bytes(33), labels=KeyError),
            "too_many_nodes",
        ),
        (dict(parents=b"\x00" * 33), "bad_parents"),
        (dict(parents=b"\xff" + bytes(31)), "bad_parents"),
        (dict(parents=b"\xff\x00\x02" + bytes(30)), "bad_parents"),
        (dict(parents=[255] + [0] * 32), "bad_field_type"),
        (dict(labels=b"\x01" * 33), "bad_labels"),
        (dict(labels=b"\x00" + b"\x05" * 32), "bad_labels"),
        (dict(labels=b"\x00" * 3), "bad_labels"),
        (dict(round=-1), "bad_field_value"),
        (dict(round=1.0), "bad_field_type"),
        (dict(round=KeyError), "missing_field"),
        (dict(session="x"), "unknown_field"),
        (dict(v=1), "unsupported_version"),
        (dict(v=4), "unsupported_version"),
        (dict(values=b"\x00" * 33), "bad_field_value"),
        (dict(values=b"\xff" * 3), "bad_field_value"),
        (dict(values=[255] * 33), "bad_field_type"),
        (dict(schema=b"\x00" * 16), "bad_field_value"),
        (dict(type="verdict"), "unknown_type"),
        (dict(type=None), "bad_field_type"),
    ],
)
def test_tree_defects(changes, code):
    err(decode_client_frame, raw(tree32(), **changes), code)


def _q(tree, rows):
    """draft_q bytes for ``rows`` of ``tree``: each row's own token plus one other id."""
    out = b""
    for r in rows:
        ids = [tree.tokens[r], tree.tokens[r] + 1]
        out += bytes((r, 2)) + np.asarray(ids, "<u4").tobytes() + np.asarray([3, 1], "<u2").tobytes()
    return out


def test_draft_q_round_trips_and_its_defects_say_what_to_fix():
    t = tree32()
    chain = [2, next(r for r in range(3, 33) if t.parents[r] == 2)]  # a node and one child of it
    frame = decode_client_frame(raw(t, draft_q=_q(t, chain)))
    assert frame.draft_q.rows == tuple(chain) and frame.draft_q.prob(0, t.tokens[2]) == 0.75
    assert decode_client_frame(encode_frame(frame)) == frame
    siblings = [r for r in range(1, 33) if t.parents[r] == 0][:2]
    bad = {
        "share parent": _q(t, siblings),
        "must ascend": _q(t, chain[::-1]),
        "not among the ids": bytes((1, 1)) + np.asarray([t.tokens[1] + 1], "<u4").tobytes() + b"\x01\x00",
        "weight below 1": bytes((1, 1)) + np.asarray([t.tokens[1]], "<u4").tobytes() + b"\x00\x00",
        "needs 6 bytes": bytes((1, 1)) + b"\x00",
        "empty": b"",
    }
    for words, blob in bad.items():
        e = err(decode_client_frame, raw(t, draft_q=blob), "bad_draft_q")
        assert words in str(e), (words, str(e))


def test_tree_node_limit_follows_the_limits():
    err(decode_client_frame, encode_frame(tree32()), "too_many_nodes", limits=WireLimits(max_node_budget=16))


def test_parent_error_message_says_what_to_fix():
    msg = err(decode_client_frame, raw(tree32(), parents=b"\xff\x00\x05" + bytes(30)), "bad_parents")
    assert "parents[2] = 5" in msg and "insertion order" in msg


START = CLIENT_FRAMES[0]


@pytest.mark.parametrize(
    "changes, code",
    [
        (dict(endpoint="embeddings"), "bad_field_value"),
        (dict(request=KeyError), "bad_request"),
        (dict(request={**CHAT, "stream": False}), "bad_request"),
        (dict(request={"messages": []}), "bad_request"),
        (dict(request={"messages": [{"content": "x"}]}), "bad_request"),
        (dict(request={"messages": "hi"}), "bad_request"),
        (dict(request={"messages": [{"role": "user", "content": "x" * 2000}]}), "request_too_large"),
        (
            dict(hyco={"mode": "exact", "epsilon": 0.1, "capabilities": ClientCapabilities().to_wire()}),
            "bad_hyco",
        ),
        (
            dict(hyco={"mode": "epsilon", "epsilon": 1.0, "capabilities": ClientCapabilities().to_wire()}),
            "bad_hyco",
        ),
        (
            dict(hyco={"mode": "epsilon", "epsilon": 0, "capabilities": ClientCapabilities().to_wire()}),
            "bad_field_type",
        ),
        (dict(hyco={"mode": "lossy", "capabilities": ClientCapabilities().to_wire()}), "bad_field_value"),
        (dict(hyco={"mode": "exact"}), "missing_field"),
        (
            dict(
                hyco={
                    "mode": "exact",
                    "capabilities": {**ClientCapabilities().to_wire(), "handoff_schemas": []},
                }
            ),
            "bad_hyco",
        ),
        (
            dict(
                hyco={
                    "mode": "exact",
                    "capabilities": {**ClientCapabilities().to_wire(), "max_message_bytes": 10},
                }
            ),
            "bad_field_value",
        ),
        (dict(hyco={**HycoOptions().to_wire(), "keep_set_hash": b""}), "bad_hyco"),
        (dict(hyco={**HycoOptions().to_wire(), "fingerprint": b"x" * 15}), "bad_hyco"),
        (
            dict(
                hyco={
                    **HycoOptions().to_wire(),
                    "resume": {"session_id": b"x", "last_round": 0, "need_seed": False},
                }
            ),
            "bad_field_type",
        ),
        *[
            (
                dict(
                    hyco={
                        **HycoOptions().to_wire(),
                        "resume": {"session_id": sid, "last_round": 0, "need_seed": False},
                    }
                ),
                "bad_hyco",
            )
            for sid in ("x", SID.upper(), "-r." + "0" * 32, SID + "0", "r1" + "0" * 33, "a" * 33 + "." + "0" * 32)
        ],
        (dict(hyco={**HycoOptions().to_wire(), "resume": ResumeRequest(SID, 0).to_wire()}), "bad_request"),
    ],
)
def test_start_defects(changes, code):
    err(decode_client_frame, raw(START, **changes), code, limits=WireLimits(max_prompt_bytes=1000))


def test_completions_start_needs_a_prompt():
    frame = StartFrame("completions", {"prompt": ""}, HycoOptions())
    err(decode_client_frame, encode_frame(frame), "bad_request")


@pytest.mark.parametrize(
    "kw, code",
    [
        (dict(bonus=8), "bad_verdict"),
        (dict(tokens=(7, 9)), "bad_verdict"),
        (dict(path=(3, 1)), "bad_verdict"),
        (dict(path=(0, 1)), "bad_verdict"),
        (dict(node_budget=0), "bad_verdict"),
        (dict(handoff=None), "bad_verdict"),
        (dict(handoff_ref=HandoffRef(2, 10, 8, bytes(32))), "bad_verdict"),
        (dict(handoff=HandoffPayload.make_dummy(SPEC, 10, 13, bonus_token=5)), "bad_verdict"),
        (
            dict(
                bonus=None,
                tokens=(7,),
                chunk=openai_chunk("chat.completion.chunk", "c", "m", "", "stop", created=1),
            ),
            "bad_verdict",
        ),
        (dict(chunk={"id": "c"}), "missing_field"),
        (
            dict(chunk={**openai_chunk("text_completion", "c", "m", "x", created=1), "choices": []}),
            "bad_field_value",
        ),
        (
            dict(
                chunk={
                    **openai_chunk("text_completion", "c", "m", "x", created=1),
                    "object": "chat.completion",
                }
            ),
            "bad_field_value",
        ),
    ],
)
def test_verdict_defects(kw, code):
    err(decode_server_frame, encode_frame(verdict(**kw)), code, schema=SPEC)


def test_an_inline_handoff_needs_the_session_schema():
    err(decode_server_frame, encode_frame(verdict()), "bad_verdict")
    other = HandoffSpec(bytes(16), 4, SPEC.layers[:1], bytes(16))  # one layer: the kv list does not fit
    err(decode_server_frame, encode_frame(verdict()), "bad_handoff", schema=other)


def test_verdicts_carry_no_session_id_and_no_header():
    w = frame_to_wire(verdict())
    assert "sid" not in w and list(w["handoff"]) == ["span", "bonus", "e", "h", "kv"]


@pytest.mark.parametrize(
    "changes, code",
    [
        (dict(sid=bytes(16)), "bad_field_type"),
        (dict(sid="r1.short"), "bad_field_value"),
        (dict(schema_hash=bytes(8)), "bad_field_value"),
        (dict(last_round=-2), "bad_field_value"),
        (dict(budget=33), "bad_field_value"),
        (dict(schema={**SPEC.to_wire(), "version": 1}), "handoff_version"),
        (dict(schema={**SPEC.to_wire(), "hidden": 0}), "bad_field_value"),
        (dict(schema={**SPEC.to_wire(), "layers": []}), "bad_handoff"),
        (dict(schema={**SPEC.to_wire(), "span": [0, 1]}), "unknown_field"),
        (dict(schema_hash=KeyError), "missing_field"),
    ],
)
def test_session_frame_defects(changes, code):
    err(decode_server_frame, raw(SessionFrame(SID, -1, 32, SPEC), **changes), code)


def test_schema_hash_is_of_the_schema_encoding():
    import hashlib

    assert SPEC.schema_hash == hashlib.sha256(msgpack.packb(SPEC.to_wire(), use_bin_type=True)).digest()[:8]
    other = HandoffSpec(b"\x01" * 16, 4, SPEC.layers, bytes(16))
    assert other.schema_hash != SPEC.schema_hash and HandoffSpec.from_wire(other.to_wire()) == other


def test_older_frames_get_an_unsupported_version_answer_they_can_read():
    from vllm_hyco.handoff.frames import reply_version

    v1 = raw(tree32(), v=1)
    msg = err(decode_client_frame, v1, "unsupported_version")
    assert "version 3" in msg and "upgrade the phone app" in msg
    assert "upgrade the phone app" in err(decode_client_frame, raw(tree32(), v=2), "unsupported_version")
    assert reply_version(v1) == 1 and reply_version(raw(tree32(), v=2)) == 2
    assert reply_version(b"\xc1") == 3 and reply_version(raw(tree32(), v=7)) == 3
    answer = encode_frame(ErrorFrame("unsupported_version", msg, True), version=1)
    assert msgpack.unpackb(answer)["v"] == 1
    assert decode_server_frame(answer).code == "unsupported_version"  # error frames decode in every version
    with pytest.raises(ValueError):
        encode_frame(SessionFrame(SID, -1, 32, SPEC), version=1)
    err(decode_server_frame, raw(SessionFrame(SID, -1, 32, SPEC), v=1), "unsupported_version")


def test_verdict_passes_extra_openai_fields_through():
    chunk = {**openai_chunk("chat.completion.chunk", "c", "m", "x", created=1), "system_fingerprint": "fp"}
    back = decode_server_frame(encode_frame(verdict(chunk=chunk)), schema=SPEC)
    assert back.chunk["system_fingerprint"] == "fp"


@pytest.mark.parametrize(
    "frame, changes, code",
    [
        (HandoffRef(2, 10, 8, bytes(32)), dict(chunks=3), "bad_field_value"),
        (HandoffRef(2, 10, 8, bytes(32)), dict(sha256=b"x"), "bad_field_value"),
    ],
)
def test_handoff_ref_defects(frame, changes, code):
    v = verdict(handoff=None, handoff_ref=frame)
    obj = frame_to_wire(v)
    obj["handoff_ref"].update(changes)
    err(decode_server_frame, msgpack.packb(obj, use_bin_type=True), code, schema=SPEC)


@pytest.mark.parametrize(
    "frame, changes, code",
    [
        (SERVER_FRAMES[3], dict(index=2), "bad_field_value"),
        (SERVER_FRAMES[3], dict(data=b""), "bad_field_value"),
        (SERVER_FRAMES[4], dict(code=""), "bad_field_value"),
        (SERVER_FRAMES[4], dict(fatal=1), "bad_field_type"),
        (
            SERVER_FRAMES[6],
            dict(usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 4}),
            "bad_field_value",
        ),
        (
            SERVER_FRAMES[6],
            dict(stats={"rounds": 1, "mat": float("nan"), "bytes_up": 1, "bytes_down": 1}),
            "bad_field_value",
        ),
        (SERVER_FRAMES[6], dict(type="tree"), "unknown_type"),
    ],
)
def test_other_server_frame_defects(frame, changes, code):
    err(decode_server_frame, raw(frame, **changes), code)


def test_frame_size_limits_per_direction():
    err(
        decode_client_frame,
        encode_frame(tree32()),
        "frame_too_large",
        limits=WireLimits(max_client_frame_bytes=100),
    )
    big = encode_frame(HandoffChunkFrame(0, 0, 1, b"x" * 5000))
    err(
        decode_server_frame,
        big,
        "frame_too_large",
        limits=WireLimits(max_server_frame_bytes=4096, chunk_bytes=1024),
    )


def test_limits_are_validated():
    for bad in (dict(max_node_budget=0), dict(max_node_budget=300), dict(chunk_bytes=4 << 20), dict(max_round=True)):
        with pytest.raises(ConfigError):
            WireLimits(**bad)


def test_decoded_tree_feeds_the_semantic_validator():
    tree_mod = pytest.importorskip("vllm_hyco.spec_decode.tree")
    frame = decode_client_frame(encode_frame(tree32()))
    tree = tree_mod.TokenTree.from_wire(frame.tree_dict(), vocab_size=262144)
    assert list(tree.tokens.tolist()) == list(frame.tokens)
    dup = TreeFrame.from_lists(0, [5, 6, 6], [-1, 0, 0])  # structurally fine, semantically not (D3)
    with pytest.raises(tree_mod.TreeValidationError):
        tree_mod.TokenTree.from_wire(decode_client_frame(encode_frame(dup)).tree_dict(), vocab_size=100)
