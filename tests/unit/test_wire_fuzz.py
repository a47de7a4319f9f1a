"""Fuzz the decoders: >= 10,000 random and mutated frames; they only ever raise the typed errors.

Byte-level (random bytes, flips, truncations, splices, lying length headers, deep nesting) and
structure-level (a random field of a valid frame replaced by a random value, deleted, or joined by an
unknown one) mutations of every golden-style frame of both directions and of a hand-off. A frame that
still decodes must re-encode to bytes that decode and re-encode to the same bytes.
"""

import contextlib
import random

import msgpack
import pytest

from vllm_hyco.errors import FrameError, HandoffSchemaError
from vllm_hyco.handoff.frames import decode_client_frame, decode_server_frame, encode_frame
from vllm_hyco.handoff.golden import golden_files, golden_spec
from vllm_hyco.handoff.limits import WireLimits
from vllm_hyco.handoff.schema import decode_handoff, encode_handoff

LIMITS = WireLimits(max_prompt_bytes=4096)
SCHEMA = golden_spec()  # the session schema the golden hand-offs follow
TYPED = (FrameError, HandoffSchemaError)
DECODERS = {
    "client_frame": lambda b: decode_client_frame(b, LIMITS),
    "server_frame": lambda b: decode_server_frame(b, LIMITS, schema=SCHEMA),
    "handoff": lambda b: decode_handoff(b, SCHEMA, limits=LIMITS),
}
ENCODERS = {"client_frame": encode_frame, "server_frame": encode_frame, "handoff": encode_handoff}
SEEDS = [
    (kind, data)
    for name, (kind, data) in sorted(golden_files().items())
    if kind in DECODERS and len(data) < 20000
]


def random_value(rng: random.Random, depth: int = 0):
    choice = rng.randrange(14 if depth < 3 else 10)
    return [
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: rng.randint(-(2**63), 2**64 - 1),
        lambda: rng.choice([0, -1, 1, 255, 256, 2**31, 2**32, -(2**31)]),
        lambda: rng.choice([float("nan"), float("inf"), -0.0, 1e308, 0.5]),
        lambda: "x" * rng.randrange(0, 70),
        lambda: rng.randbytes(rng.randrange(0, 40)),
        lambda: rng.choice(
            ["tree", "start", "session", "verdict", "final", "error", "handoff_chunk", "exact", "full"]
        ),
        lambda: b"\xff" * rng.randrange(0, 40),
        lambda: rng.randrange(0, 40),
        lambda: [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))],
        lambda: {str(rng.randrange(5)): random_value(rng, depth + 1) for _ in range(rng.randrange(0, 3))},
        lambda: [0] * rng.randrange(0, 2000),
        lambda: {"type": "tree", "v": rng.choice([1, 2])},
    ][choice]()


def containers(obj, path=()):
    """Every (container, key) pair inside a decoded msgpack object."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield obj, k
            yield from containers(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield obj, i
            yield from containers(v, path + (i,))


def mutate_structure(rng: random.Random, data: bytes) -> bytes:
    obj = msgpack.unpackb(data, raw=False)
    slots = list(containers(obj))
    for _ in range(rng.randint(1, 3)):
        parent, key = rng.choice(slots)
        op = rng.randrange(4)
        if op == 0 and isinstance(parent, dict):
            parent.pop(key, None)
        elif op == 1 and isinstance(parent, dict):
            parent[rng.choice(["extra", "v", "type", "round", "tokens", "x"])] = random_value(rng)
        else:
            with contextlib.suppress(IndexError):
                parent[key] = random_value(rng)
    return msgpack.packb(obj, use_bin_type=True)


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    op = rng.randrange(6)
    if op == 0:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 1:
        del b[rng.randrange(len(b)) :]
    elif op == 2:
        i = rng.randrange(len(b))
        b[i:i] = rng.randbytes(rng.randint(1, 16))
    elif op == 3:
        i, j = sorted(rng.sample(range(len(b) + 1), 2))
        b += b[i:j]
    elif op == 4:  # a container or bin header that claims far more than the buffer holds
        b = (
            bytearray(
                rng.choice(
                    [
                        b"\xdd\xff\xff\xff\xff",
                        b"\xdf\xff\xff\xff\xff",
                        b"\xc6\xff\xff\xff\xf0",
                        b"\xdb\x7f\xff\xff\xff",
                    ]
                )
            )
            + b
        )
    else:
        b = bytearray(rng.randbytes(rng.randrange(0, 300)))
    return bytes(b)


def check(kind: str, data: bytes, outcomes: dict) -> None:
    try:
        value = DECODERS[kind](data)
    except TYPED as e:
        assert e.code, e
        outcomes["typed"] += 1
        return
    again = ENCODERS[kind](value)
    # bytes, not values: a NaN inside an embedded OpenAI body never equals itself
    assert ENCODERS[kind](DECODERS[kind](again)) == again
    outcomes["ok"] += 1


@pytest.mark.parametrize("seed", range(4))
def test_decoders_only_raise_typed_errors(seed):
    rng = random.Random(seed)
    outcomes = {"typed": 0, "ok": 0}
    for i in range(2600):
        kind, data = SEEDS[i % len(SEEDS)]
        for target in [kind] if i % 5 else list(DECODERS):  # also feed frames to the wrong decoder
            mutated = mutate_structure(rng, data) if i % 2 else mutate_bytes(rng, data)
            check(target, mutated, outcomes)
    assert sum(outcomes.values()) >= 2600
    assert outcomes["typed"] > 1000


def test_pathological_inputs():
    outcomes = {"typed": 0, "ok": 0}
    deep = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    deep_map = b"\x81\xa1a" * 50_000 + b"\xc0"
    for data in (
        deep,
        deep_map,
        b"",
        b"\xc0",
        b"\x80",
        b"\xc1",
        b"\xd4\x01\x02",
        msgpack.packb({1: 2}),
        msgpack.packb({"type": "tree", "v": 1, "round": 0, "tokens": b"\0" * 4, "parents": "\xff"}),
        bytearray(b"\x80"),
        memoryview(b"\x80"),
    ):
        for kind in DECODERS:
            check(kind, data, outcomes)
    for kind in DECODERS:
        for bad in (None, "text", 5, [1]):
            with pytest.raises(TYPED):
                DECODERS[kind](bad)
    assert outcomes["ok"] == 0
