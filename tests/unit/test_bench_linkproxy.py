"""The link proxy: presets and parsing, the FIFO delivery schedule, bytes pass through intact and counted."""

from __future__ import annotations

import asyncio

import pytest

from hyco_lab.bench.linkproxy import PRESETS, LinkModel, LinkProxy, _Pipe
from vllm_hyco.errors import ConfigError


def test_parse_presets_and_custom():
    assert LinkModel.parse("LTE") is PRESETS["lte"]
    custom = LinkModel.parse("rtt=20,down=100")
    assert (custom.rtt_ms, custom.up_mbps, custom.down_mbps, custom.name) == (20.0, PRESETS["lte"].up_mbps,
                                                                              100.0, "custom")
    for bad in ("wifi", "rtt=abc", "speed=3"):
        with pytest.raises(ConfigError):
            LinkModel.parse(bad)
    with pytest.raises(ConfigError):
        LinkModel(rtt_ms=-1, up_mbps=1, down_mbps=1)


def test_paper_round_costs_on_lte():
    lte = PRESETS["lte"]
    # a 2.2 KB tree up and a 12 KB verdict down on an idle link: RTT plus serialization
    total_ms = (lte.one_way_s("up", 2200) + lte.one_way_s("down", 12000)) * 1e3
    assert total_ms == pytest.approx(50 + 2200 * 8 / 10e3 + 12000 * 8 / 40e3)
    assert 40 <= total_ms <= 58  # the paper's network + serialization per round (Appendix G)


def test_stamps_queue_behind_earlier_bytes():
    pipe = _Pipe(LinkModel(rtt_ms=20, up_mbps=8, down_mbps=8), "down", None)  # 1 byte per microsecond
    a = pipe.stamp(0.0, 1000)  # busy until 1 ms, arrives at 11 ms
    b = pipe.stamp(0.0005, 1000)  # queued: leaves at 2 ms
    c = pipe.stamp(0.010, 1000)  # link idle again
    assert [round(x * 1e3, 6) for x in (a, b, c)] == [11.0, 12.0, 21.0]


async def _echo(reader, writer):
    while data := await reader.read(4096):
        writer.write(data[::-1])
        await writer.drain()
    writer.close()


def test_proxy_forwards_and_counts_bytes():
    async def go():
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        payload = bytes(range(256)) * 40
        async with LinkProxy(("127.0.0.1", port), LinkModel(rtt_ms=2, up_mbps=100, down_mbps=100)) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(payload)
            await writer.drain()
            got = b""
            while len(got) < len(payload):
                got += await asyncio.wait_for(reader.read(65536), 30)
            writer.close()
            counts = (proxy.bytes_up, proxy.bytes_down, proxy.connections)
        server.close()
        await server.wait_closed()
        return payload, got, counts

    payload, got, (up, down, conns) = asyncio.run(go())
    # the echo reverses each read chunk; the proxy may re-chunk, so compare the multiset of bytes and sizes
    assert sorted(got) == sorted(payload) and (up, down, conns) == (len(payload), len(payload), 1)
