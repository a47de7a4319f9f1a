"""A phone link on 127.0.0.1: an asyncio TCP proxy that applies round-trip time and up/down bandwidth.

The benchmark's simulated phones talk to the real server through this proxy, so the delays apply to the
real bytes on the wire (WebSocket frames, HTTP requests and streamed chunks alike). Each direction is a
FIFO pipe: a chunk that arrives at ``t`` leaves the sender's side once the link is free and its bytes are
serialized (``n * 8 / bandwidth``), and reaches the other side half a round trip later. So a 2.2 KB tree
on a 10 Mbit/s uplink costs 1.8 ms of serialization plus RTT/2, and back-to-back chunks queue behind each
other as they would on a real bottleneck link. No loss, no jitter: the link is a model (docs/decisions.md D8,
"simulated"), not a measurement.

    >>> LinkModel.parse("lte").rtt_ms, LinkModel.parse("rtt=20,up=5,down=50").up_mbps
    (50.0, 5.0)
    >>> round(LinkModel(rtt_ms=50, up_mbps=10, down_mbps=40).one_way_s("up", 2200) * 1e3, 2)
    26.76

Usage::

    async with LinkProxy(("127.0.0.1", server_port), LinkModel.parse("lte")) as proxy:
        url = f"http://127.0.0.1:{proxy.port}"      # talk to the server through the link
        ...
        proxy.bytes_up, proxy.bytes_down             # bytes that crossed the link, all connections
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Self

from vllm_hyco.errors import ConfigError

READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class LinkModel:
    """Round-trip time and bandwidth of one phone link (``up`` = phone to server)."""

    rtt_ms: float
    up_mbps: float
    down_mbps: float
    name: str = "custom"

    def __post_init__(self):
        if not (self.rtt_ms >= 0 and self.up_mbps > 0 and self.down_mbps > 0):
            raise ConfigError(f"link: need rtt_ms >= 0 and positive bandwidths, got rtt_ms={self.rtt_ms}, "
                              f"up_mbps={self.up_mbps}, down_mbps={self.down_mbps}")

    def serialize_s(self, direction: str, nbytes: int) -> float:
        mbps = self.up_mbps if direction == "up" else self.down_mbps
        return nbytes * 8 / (mbps * 1e6)

    def one_way_s(self, direction: str, nbytes: int) -> float:
        """Time for ``nbytes`` sent on an idle link to arrive: serialization + RTT / 2."""
        return self.serialize_s(direction, nbytes) + self.rtt_ms / 2e3

    def to_dict(self) -> dict:
        return {"name": self.name, "rtt_ms": self.rtt_ms, "up_mbps": self.up_mbps, "down_mbps": self.down_mbps}

    @classmethod
    def parse(cls, text: str) -> LinkModel:
        """A preset name (``lan``, ``lte``, ``5g``) or ``rtt=MS,up=MBPS,down=MBPS`` (any subset; the rest
        from ``lte``)."""
        key = text.strip().lower()
        if key in PRESETS:
            return PRESETS[key]
        fields = {"rtt": "rtt_ms", "up": "up_mbps", "down": "down_mbps"}
        values = PRESETS["lte"].to_dict()
        try:
            for part in filter(None, key.split(",")):
                name, value = part.split("=")
                values[fields[name.strip()]] = float(value)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"--link {text!r}: use one of {sorted(PRESETS)} or 'rtt=MS,up=MBPS,down=MBPS'"
                              ) from e
        values["name"] = "custom"
        return cls(**values)


#: Presets. LTE sits in the paper's 40-58 ms of network + serialization per round (Appendix G); 5G NSA a
#: little lower; ``lan`` is a near-zero link (a phone on the server's own network, or no phone at all).
PRESETS = {
    "lan": LinkModel(rtt_ms=0.5, up_mbps=1000.0, down_mbps=1000.0, name="lan"),
    "lte": LinkModel(rtt_ms=50.0, up_mbps=10.0, down_mbps=40.0, name="lte"),
    "5g": LinkModel(rtt_ms=30.0, up_mbps=50.0, down_mbps=200.0, name="5g"),
}


class _Pipe:
    """One direction of one connection: reads, stamps delivery times, writes in order."""

    def __init__(self, link: LinkModel, direction: str, proxy: LinkProxy):
        self.link, self.direction, self.proxy = link, direction, proxy
        self.free_at = 0.0  # when the sender's side of the link is idle again (loop time)
        self.queue: asyncio.Queue = asyncio.Queue()

    def stamp(self, now: float, nbytes: int) -> float:
        """When ``nbytes`` handed to the link at ``now`` arrive: after the bytes queued before them and
        their own serialization, plus RTT / 2.

        >>> p = _Pipe(LinkModel(rtt_ms=10, up_mbps=8, down_mbps=8), "up", None)
        >>> [round(p.stamp(0.0, 1000) * 1e3, 3), round(p.stamp(0.0, 1000) * 1e3, 3)]  # 1 ms each, queued
        [6.0, 7.0]
        """
        start = max(now, self.free_at)
        self.free_at = start + self.link.serialize_s(self.direction, nbytes)
        return self.free_at + self.link.rtt_ms / 2e3

    async def read(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await reader.read(READ_CHUNK)
                if not data:
                    break
                self.proxy._count(self.direction, len(data))
                await self.queue.put((self.stamp(loop.time(), len(data)), data))
        except (ConnectionError, OSError):
            pass
        finally:
            await self.queue.put((None, b""))

    async def write(self, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                at, data = await self.queue.get()
                if at is None:
                    break
                delay = at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            _close(writer)


def _close(writer: asyncio.StreamWriter) -> None:
    try:
        if writer.can_write_eof():
            writer.write_eof()
        else:
            writer.close()
    except (ConnectionError, OSError, RuntimeError):
        pass


class LinkProxy:
    """Listens on 127.0.0.1 (``port``, chosen by the OS unless given) and forwards every connection to
    ``target`` through ``link``. Counts the bytes each way (``bytes_up``, ``bytes_down``)."""

    def __init__(self, target: tuple[str, int], link: LinkModel, *, port: int = 0):
        self.target, self.link, self.port = target, link, port
        self.bytes_up = self.bytes_down = 0
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    def _count(self, direction: str, n: int) -> None:
        if direction == "up":
            self.bytes_up += n
        else:
            self.bytes_down += n

    async def start(self) -> Self:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()
            return
        up, down = _Pipe(self.link, "up", self), _Pipe(self.link, "down", self)
        jobs = [up.read(c_reader), up.write(s_writer), down.read(s_reader), down.write(c_writer)]
        tasks = [asyncio.ensure_future(j) for j in jobs]
        self._tasks.update(tasks)
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # the proxy closed with this connection still open (keep-alive)
            pass
        finally:
            self._tasks.difference_update(tasks)
            for w in (s_writer, c_writer):
                w.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

