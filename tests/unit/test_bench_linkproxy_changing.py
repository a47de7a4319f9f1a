"""The changing link (issue 33's link sweep): the ``bad`` preset, parsing ``changing`` forms, the link in force
at each second of a connection, and the proxy's pipes switching models (numbers, not timings)."""

from __future__ import annotations

import asyncio

import pytest

from hyco_lab.bench.linkproxy import CHANGING_STEPS, PRESETS, LinkModel, LinkProxy, LinkSchedule, _Pipe, parse_link
from vllm_hyco.errors import ConfigError


def test_bad_preset_and_the_old_forms_still_parse():
    bad = LinkModel.parse("bad")
    assert bad is PRESETS["bad"] and (bad.rtt_ms, bad.up_mbps, bad.down_mbps) == (300.0, 1.0, 1.0)
    for text in ("lan", "lte", "5g", "bad", "rtt=20,down=100"):
        assert parse_link(text) == LinkModel.parse(text)
    assert parse_link("LTE") is PRESETS["lte"] and LinkModel.parse("lte").at(123.0) is PRESETS["lte"]
    assert PRESETS["lte"].changes == 0
    # a 2.2 KB tree up on the bad link: 17.6 ms serialization + 150 ms
    assert bad.one_way_s("up", 2200) * 1e3 == pytest.approx(167.6)


def test_changing_forms():
    plain = parse_link("changing")
    assert isinstance(plain, LinkSchedule) and plain.starts == tuple(t for t, _ in CHANGING_STEPS) == (0.0, 0.5, 4.5)
    assert [x.name for x in plain.links] == ["lan", "bad", "lan"] and plain.changes == 2
    symmetric = parse_link("Changing:2.5")
    assert symmetric.starts == (0.0, 2.5, 5.0) and [x.name for x in symmetric.links] == ["lan", "bad", "lan"]
    three = parse_link("changing:lan@0,lte@1.5,bad@3")
    assert three.starts == (0.0, 1.5, 3.0) and [x.name for x in three.links] == ["lan", "lte", "bad"]
    custom = parse_link("changing:rtt=20,up=5@0;bad@2")
    assert custom.links[0] == LinkModel(rtt_ms=20.0, up_mbps=5.0, down_mbps=PRESETS["lte"].down_mbps)
    assert custom.links[1] is PRESETS["bad"] and custom.starts == (0.0, 2.0)
    assert three.to_dict()["steps"][1] == {"at_s": 1.5, **PRESETS["lte"].to_dict()}
    assert three.to_dict()["clock"] == "connection" and three.to_dict()["changes"] == 2
    for wrong in ("changing:lan@1", "changing:lan@0,bad@0", "changing:wifi@0", "changing:lan@x", "changing:x",
                  "changes"):
        with pytest.raises(ConfigError):
            LinkSchedule.parse(wrong)
    with pytest.raises(ConfigError):
        LinkSchedule((0.0, 1.0), (PRESETS["lan"],))


def test_the_link_in_force_at_each_second():
    s = parse_link("changing:3")
    got = [s.at(t).name for t in (0.0, 2.999, 3.0, 5.9, 6.0, 1e6)]
    assert got == ["lan", "lan", "bad", "bad", "lan", "lan"]
    assert [s.changes_before(t) for t in (1.0, 3.0, 3.5, 6.5)] == [0, 0, 1, 2]
    assert PRESETS["bad"].changes_before(1e6) == 0


def test_pipe_switches_models_on_the_connection_clock():
    # connection opened at loop time 100; the link is bad from 2 s to 4 s after it
    pipe = _Pipe(parse_link("changing:2"), "down", None, t0=100.0)
    lan = pipe.stamp(101.0, 1000)  # 1000 B at 1000 Mbit/s: 8 us + 0.25 ms
    bad = pipe.stamp(102.0, 1000)  # 8 ms at 1 Mbit/s + 150 ms
    queued = pipe.stamp(102.001, 1000)  # behind the last bytes: leaves at 102.016
    back = pipe.stamp(104.5, 1000)  # lan again
    assert [round((x - t) * 1e3, 4) for x, t in ((lan, 101.0), (bad, 102.0), (queued, 102.0), (back, 104.5))] == [
        0.258, 158.0, 166.0, 0.258]


def test_a_switch_keeps_bytes_in_order():
    # bytes stamped on the bad link just before the change arrive after the lan ones stamped just after it,
    # but they are queued first: the writer delivers in stamp order, so the stream is never reordered
    pipe = _Pipe(parse_link("changing:lan@0,bad@1,lan@2"), "up", None, t0=0.0)
    late = pipe.stamp(1.999, 100)
    early = pipe.stamp(2.0, 100)
    assert late > early  # order is the queue's, not the stamps'
    assert (round(late, 7), round(early, 7)) == (round(1.999 + 0.0008 + 0.15, 7), round(2.0 + 8e-7 + 2.5e-4, 7))


def test_proxy_pipes_start_the_clock_at_the_connection():
    proxy = LinkProxy(("127.0.0.1", 1), parse_link("changing:1"))
    up, down = proxy.pipes(50.0)
    assert (up.t0, down.t0, up.direction, down.direction) == (50.0, 50.0, "up", "down")
    assert up.link.at(1.0 - 0.001).name == "lan" and down.link.at(1.0).name == "bad"


async def _echo(reader, writer):
    while data := await reader.read(4096):
        writer.write(data)
        await writer.drain()
    writer.close()


def test_proxy_forwards_through_a_changing_link():
    async def go():
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        payload = bytes(range(256)) * 8
        fast = LinkModel(rtt_ms=1, up_mbps=100, down_mbps=100)
        async with LinkProxy(("127.0.0.1", port), LinkSchedule((0.0, 0.001), (fast, fast))) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            got = b""
            for i in range(0, len(payload), 512):
                writer.write(payload[i:i + 512])
                await writer.drain()
                while len(got) < i + 512:
                    got += await asyncio.wait_for(reader.read(65536), 30)
            writer.close()
            counts = (proxy.bytes_up, proxy.bytes_down, proxy.connections)
        server.close()
        await server.wait_closed()
        return payload, got, counts

    payload, got, counts = asyncio.run(go())
    assert got == payload and counts == (len(payload), len(payload), 1)
