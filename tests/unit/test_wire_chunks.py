"""Seed hand-offs in chunks: splitting, planning, reassembly with typed errors (vllm_hyco.handoff.chunks)."""

import dataclasses

import pytest

from vllm_hyco.errors import HandoffSchemaError
from vllm_hyco.handoff.chunks import HandoffAssembler, plan_handoff, split_handoff
from vllm_hyco.handoff.frames import decode_server_frame, encode_frame
from vllm_hyco.handoff.limits import WireLimits
from vllm_hyco.handoff.schema import HandoffPayload, HandoffSpec, LayerSpec, encode_handoff
from vllm_hyco.handoff.server_frames import HandoffChunkFrame

SPEC = HandoffSpec(
    bytes(16), 32, (LayerSpec(0, "sliding", 2, 16, 64), LayerSpec(1, "full", 1, 32, 0, True)), bytes(16)
)
SEED = HandoffPayload.make_dummy(SPEC, 0, 64, bonus_token=3)
LIMITS = WireLimits(chunk_bytes=2000, max_server_frame_bytes=4096)


def chunks():
    return split_handoff(encode_handoff(SEED), 0, 2000)


def test_split_sizes_and_reassembly_through_encoded_frames():
    ref, frames = chunks()
    assert ref.chunks == len(frames) == -(-ref.total_bytes // 2000)
    assert all(len(encode_frame(f)) <= LIMITS.max_server_frame_bytes for f in frames)
    asm = HandoffAssembler(0, ref, LIMITS)
    done = [asm.add(decode_server_frame(encode_frame(f), LIMITS)) for f in frames]
    assert done == [False] * (len(frames) - 1) + [True]
    assert asm.payload(SPEC) == SEED


def expect_error(code, feed, finish=False):
    ref, frames = chunks()
    asm = HandoffAssembler(0, ref, LIMITS)
    with pytest.raises(HandoffSchemaError) as e:
        for f in feed(frames):
            asm.add(f)
        if finish:
            asm.payload(SPEC)
    assert e.value.code == code
    return str(e.value)


def test_missing_chunk():
    msg = expect_error("chunk_missing", lambda fs: fs[:-1], finish=True)
    assert "need_seed" in msg


def test_duplicate_chunk():
    expect_error("chunk_duplicate", lambda fs: [fs[0], fs[1], fs[1]])
    expect_error("chunk_duplicate", lambda fs: fs + [fs[-1]])


def test_out_of_order_chunk():
    expect_error("chunk_out_of_order", lambda fs: [fs[0], fs[2]])
    expect_error("chunk_out_of_order", lambda fs: [dataclasses.replace(fs[0], round=1)])


def test_corrupt_chunks():
    expect_error("chunk_corrupt", lambda fs: [dataclasses.replace(fs[0], count=99)])
    expect_error("chunk_corrupt", lambda fs: [dataclasses.replace(fs[0], data=fs[0].data[:-1])])
    flipped = lambda fs: fs[:-1] + [dataclasses.replace(fs[-1], data=b"\x00" + fs[-1].data[1:])]  # noqa: E731
    expect_error("chunk_corrupt", flipped, finish=True)


def test_announced_size_over_the_limit_is_refused_up_front():
    ref, _ = chunks()
    with pytest.raises(HandoffSchemaError):
        HandoffAssembler(0, ref, WireLimits(max_handoff_bytes=100))


def test_plan_inline_when_it_fits_else_chunks_under_the_client_limit():
    small = HandoffPayload.make_dummy(SPEC, 60, 62)
    inline, ref, frames = plan_handoff(small, 5, LIMITS)
    assert inline is small and ref is None and frames == []
    big = HandoffPayload.make_dummy(SPEC, 0, 1024)  # ~131 KB: inline under 1 MiB, chunked under 64 KiB
    assert plan_handoff(big, 0, WireLimits())[0] is big
    inline, ref, frames = plan_handoff(big, 0, WireLimits(), client_max_message_bytes=64 << 10)
    assert inline is None and ref.chunk_bytes == (64 << 10) - 1024 and len(frames) == 3
    assert all(len(encode_frame(f)) <= 64 << 10 for f in frames)
    inline, ref, frames = plan_handoff(SEED, 0, LIMITS)
    assert inline is None and ref.chunks == len(frames) > 1 and frames[0].round == 0


def test_chunk_frame_index_must_be_below_count():
    bad = encode_frame(HandoffChunkFrame(0, 3, 3, b"x"))
    with pytest.raises(HandoffSchemaError.__bases__[0]):  # HycoError
        decode_server_frame(bad)
