"""Server mode's refusals on the service (HycoService over a fake bridge; the engine paths are in
tests/e2e/test_e2e_server_mode.py): a server that does not draft (no MTP ``model``, or ``server_mode``
"forbid": ``server_places`` 0) refuses with ``server_mode_unavailable``, an engine at its cap with
``server_mode_full``, a round already sent with ``mid_round``, a future one with ``bad_round``; every refusal is
non-fatal, counted, and the session goes on with its next tree. A tree in server mode gets ``wrong_mode``."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_serving_session_frames import PROMPT, FakeBridge, start

from vllm_hyco.engine_contract import SessionInfo
from vllm_hyco.errors import SessionError
from vllm_hyco.handoff.client_frames import TreeFrame
from vllm_hyco.handoff.frames import decode_server_frame
from vllm_hyco.handoff.golden import golden_scales, golden_spec
from vllm_hyco.handoff.mode_frames import AckFrame, ModeAckFrame, ModeFrame, PingFrame, PongFrame
from vllm_hyco.handoff.server_frames import VerdictFrame
from vllm_hyco.handoff.server_model import ServerModel
from vllm_hyco.serving.service import HycoService, WireError


class ModeBridge(FakeBridge):
    def __init__(self, spec, refuse: str | None = None):
        super().__init__(spec)
        self.refuse, self.calls = refuse, []

    async def set_mode(self, es, mode, round_):
        self.calls.append((mode, round_))
        if self.refuse is not None:
            raise SessionError(f"refused ({self.refuse})", code=self.refuse)
        return SessionInfo(es.sid, es.req_id, "server" if mode == "server" else "parked", round_ + (mode == "phone"),
                           None, root=7, root_position=len(PROMPT), mode=mode)


def service(places: int, refuse: str | None = None) -> HycoService:
    spec = golden_spec()
    return HycoService(ModeBridge(spec, refuse), ServerModel(spec, golden_scales(), 128, False), route_key="r7",
                       server_places=places)


async def opened(svc):
    s, frames = await svc.open(start(), owner=None)
    schema = decode_server_frame(frames[0]).schema_hash
    out = await svc.tree(s, TreeFrame.from_lists(0, [PROMPT[-1]], [-1], schema=schema))
    assert isinstance(decode_server_frame(out[0], schema=golden_spec()), VerdictFrame)
    return s


@pytest.mark.parametrize("places, refuse, code", [
    (0, None, "server_mode_unavailable"), (4, "server_mode_full", "server_mode_full"),
    (4, "server_busy", "server_busy"), (4, "server_mode_unavailable", "server_mode_unavailable")])
def test_refusals_are_typed_and_the_session_goes_on(places, refuse, code):
    svc = service(places, refuse)

    async def scenario():
        s = await opened(svc)
        with pytest.raises(WireError) as e:
            await svc.set_mode(s, ModeFrame("server", 1, window=8))
        assert (e.value.code, e.value.fatal, e.value.round) == (code, False, 1)
        assert s.mode == "phone" and s.engine_round == 1
        out = await svc.tree(s, TreeFrame.from_lists(1, [100], [-1]))  # the session goes on
        assert decode_server_frame(out[0], schema=golden_spec()).round == 1
        pong = decode_server_frame(svc.pong(3))
        assert isinstance(pong, PongFrame) and pong.nonce == 3 and pong.offers_server is (places > 0)

    asyncio.run(scenario())


def test_rounds_and_modes_are_checked():
    svc = service(4)

    async def scenario():
        s = await opened(svc)
        for frame, code in ((ModeFrame("server", 0), "mid_round"), (ModeFrame("server", 5), "bad_round"),
                            (ModeFrame("phone", 3), "bad_round")):
            with pytest.raises(WireError) as e:
                await svc.set_mode(s, frame)
            assert (e.value.code, e.value.fatal) == (code, False), frame
        assert svc.bridge.calls == []  # nothing reached the engine
        ack = decode_server_frame((await svc.set_mode(s, ModeFrame("server", 1, window=8)))[0])
        assert isinstance(ack, ModeAckFrame) and (ack.mode, ack.round, ack.tokens, ack.window) == ("server", 1, 1, 8)
        assert ack.exact and svc.bridge.calls == [("server", 1)]
        assert decode_server_frame((await svc.set_mode(s, ModeFrame("server", 1)))[0]) == ack  # idempotent
        with pytest.raises(WireError) as e:
            await svc.tree(s, TreeFrame.from_lists(1, [100], [-1]))
        assert (e.value.code, e.value.fatal) == ("wrong_mode", False)
        with pytest.raises(WireError) as e:
            svc.ack(s, AckFrame(99))
        assert e.value.code == "bad_field_value"

    asyncio.run(scenario())


def test_mode_frames_decode_strictly():
    from vllm_hyco.errors import FrameError
    from vllm_hyco.handoff.frames import decode_client_frame, encode_frame

    assert decode_client_frame(encode_frame(PingFrame(1))) == PingFrame(1)
    bad = dataclasses.replace(ModeFrame("phone", 2), window=4)
    with pytest.raises(FrameError) as e:
        decode_client_frame(encode_frame(bad))
    assert e.value.code == "bad_field_value"


def test_server_mode_only_starts_every_session_in_server_mode_and_refuses_phone_mode():
    spec = golden_spec()
    svc = HycoService(ModeBridge(spec), ServerModel(spec, golden_scales(), 128, False), route_key="r7",
                      server_places=4, phone_mode=False)

    async def scenario():
        s, frames = await svc.open(start(), owner=None)
        ack, mode = (decode_server_frame(f) for f in frames)
        assert (ack.mode, ack.node_budget, mode.mode, mode.round, mode.tokens) == ("server", 0, "server", 0, 0)
        with pytest.raises(WireError) as e:
            await svc.set_mode(s, ModeFrame("phone", 0))
        assert (e.value.code, e.value.fatal) == ("phone_mode_unavailable", False)
        with pytest.raises(WireError) as e:
            await svc.tree(s, TreeFrame.from_lists(0, [PROMPT[-1]], [-1], schema=ack.schema_hash))
        assert e.value.code == "wrong_mode"

    asyncio.run(scenario())


def test_server_mode_only_is_checked_at_startup():
    from vllm_hyco.config import HycoConfig
    from vllm_hyco.errors import ConfigError

    with pytest.raises(ConfigError, match="model"):
        HycoConfig(server_mode="only")
    with pytest.raises(ConfigError, match="max_server_sessions"):
        HycoConfig(server_mode="only", model="m", num_speculative_tokens=2, max_sessions=8, max_server_sessions=4)
    assert HycoConfig(server_mode="only", model="m", num_speculative_tokens=2).server_mode == "only"


def test_the_offer_carries_what_a_token_costs_in_each_mode():
    """The sweeper's ``refresh_costs`` copies the engine's per-mode ledger into the ``session`` and ``pong``
    frames; a server that does not offer server mode does not ask (its figures stay 0: unknown)."""
    for places, costs in ((4, (4.5, 3.9)), (0, (0.0, 0.0))):
        svc = service(places)

        async def scenario(svc=svc, places=places, costs=costs):
            s, frames = await svc.open(start(), owner=None)
            assert (decode_server_frame(frames[0]).phone_ms, decode_server_frame(frames[0]).server_ms) == (0.0, 0.0)
            await svc.refresh_costs()
            pong = decode_server_frame(svc.pong(1))
            assert (pong.phone_ms, pong.server_ms) == costs
            ack = decode_server_frame(svc.session_frame(s))
            assert (ack.offers_server, ack.phone_ms, ack.server_ms) == (places > 0, *costs)

        asyncio.run(scenario())
