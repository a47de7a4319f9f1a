"""The server's side of protocol version 2 without an engine (HycoService over a fake bridge): every start and
resume is answered by a ``session`` frame (routing key, budget, the model's schema and hash), the first tree
after it must confirm the hash (``missing_field``), a wrong hash ends the session (``schema_mismatch``), and
the per-round hand-offs read with the stated schema. The engine paths are in tests/e2e/test_e2e_resume.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from vllm_hyco.engine_contract import EngineStats, Handoff, HandoffSeed, KVRows, RoundVerdict, TreeVerdict
from vllm_hyco.handoff.client_frames import HycoOptions, ResumeRequest, StartFrame, TreeFrame
from vllm_hyco.handoff.frames import decode_server_frame
from vllm_hyco.handoff.golden import golden_scales, golden_spec
from vllm_hyco.handoff.server_frames import SessionFrame, VerdictFrame
from vllm_hyco.handoff.server_model import ServerModel
from vllm_hyco.handoff.session_id import route_key
from vllm_hyco.serving.engine_port import RoundResult
from vllm_hyco.serving.service import HycoService, WireError
from vllm_hyco.vllm_adapter.api_server.engine_client import EngineSession

PROMPT = [1, 2, 3, 4, 5]


class FakeBridge:
    """Accepts no draft node: each round commits the bonus 100 + round (the hand-off rows are zeros)."""

    model_name, vocab_size = "toy", 4096

    def __init__(self, spec):
        self.spec, self.closed = spec, 0

    async def open(self, endpoint, request, eps):
        return EngineSession("e" * 32, "req", list(PROMPT), PROMPT[-1], 8)

    async def close(self, es):
        self.closed += 1

    async def stats(self):
        return EngineStats(1, 0, 8, 64, phone_ms_per_token=4.5, server_ms_per_token=3.9)

    def _rows(self, n):
        zeros = {layer.kind: np.zeros((n, layer.kv_heads, layer.head_dim), np.int8) for layer in self.spec.layers}
        return {kind: KVRows(z, z) for kind, z in zeros.items()}  # the engine sends int8

    async def round(self, es, tree):
        round_ = tree.round
        position = len(PROMPT) - 1 + round_  # the root's position (no node is ever accepted)
        seed = HandoffSeed(0, position + 1, self._rows(position + 1)) if round_ == 0 else None
        h = Handoff(position=position, start=position, e_bonus=np.ones(self.spec.hidden_size, np.int8), h=None,
                    layers={}, kv=self._rows(1), seed=seed)
        tree_verdict = TreeVerdict(round=round_, path_rows=(), bonus=100 + round_, hits=0, num_rows=len(tree.tokens),
                                   root_pos=position, samples=(), handoff=h, host_s=0.0)
        verdict = RoundVerdict(tree_verdict, committed=(100 + round_,), finish_reason=None, node_budget=32)
        return RoundResult(verdict, [100 + round_], f"<{100 + round_}>", None)


def service():
    spec = golden_spec()
    return HycoService(FakeBridge(spec), ServerModel(spec, golden_scales(), 128, False), route_key="r7")


def start():
    return StartFrame("completions", {"prompt": "x"}, HycoOptions())


def resume(sid, last_round):
    return StartFrame("completions", None, HycoOptions(resume=ResumeRequest(sid, last_round)))


def test_session_frames_and_the_schema_confirmation():
    svc, spec = service(), golden_spec()

    async def scenario():
        s, frames = await svc.open(start(), owner="c1")
        ack = decode_server_frame(frames[0])
        assert isinstance(ack, SessionFrame) and len(frames) == 1
        assert route_key(ack.session_id) == "r7" and ack.last_round == -1 and ack.node_budget == 32
        assert ack.schema == spec and ack.schema_hash == spec.schema_hash
        tree = TreeFrame.from_lists(0, [PROMPT[-1]], [-1])
        with pytest.raises(WireError) as e:
            await svc.tree(s, tree)
        assert (e.value.code, e.value.fatal) == ("missing_field", False)
        out = await svc.tree(s, dataclasses.replace(tree, schema=ack.schema_hash))
        v0 = decode_server_frame(out[0], schema=ack.schema)
        assert isinstance(v0, VerdictFrame) and v0.handoff.header.span_start == 0
        out = await svc.tree(s, TreeFrame.from_lists(1, [100], [-1]))  # confirmed: the hash may be omitted
        v1 = decode_server_frame(out[0], schema=ack.schema)
        assert v1.handoff.header.num_positions == 1 and v1.bonus == 101

        s2, frames = await svc.resume(resume(ack.session_id, 1), owner="c2")
        again = decode_server_frame(frames[0])
        assert s2 is s and again == SessionFrame(ack.session_id, 1, 32, spec, "phone", 2, False) and frames[1:] == out
        with pytest.raises(WireError) as e:  # the resumed connection confirms again
            await svc.tree(s, TreeFrame.from_lists(2, [101], [-1]))
        assert e.value.code == "missing_field"
        with pytest.raises(WireError) as e:
            await svc.tree(s, TreeFrame.from_lists(2, [101], [-1], schema=bytes(8)))
        assert (e.value.code, e.value.fatal) == ("schema_mismatch", True)
        assert svc.table.get(ack.session_id) is None and svc.bridge.closed == 1  # the session is over
        with pytest.raises(WireError) as e:
            await svc.resume(resume(ack.session_id, 1), owner="c3")
        assert e.value.code == "unknown_session"

    asyncio.run(scenario())


def test_the_route_key_is_validated():
    from vllm_hyco.errors import ConfigError

    spec = golden_spec()
    for bad in ("", "R1", "-r", "a" * 33, "r.1"):
        with pytest.raises(ConfigError):
            HycoService(FakeBridge(spec), ServerModel(spec, golden_scales(), 128, False), route_key=bad)
