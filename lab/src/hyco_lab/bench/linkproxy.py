"""A phone link on 127.0.0.1: an asyncio TCP proxy that applies round-trip time and up/down bandwidth.

The benchmark's simulated phones talk to the real server through this proxy, so the delays apply to the
real bytes on the wire (WebSocket frames, HTTP requests and streamed chunks alike). Each direction is a
FIFO pipe: a chunk that arrives at ``t`` leaves the sender's side once the link is free and its bytes are
serialized (``n * 8 / bandwidth``), and reaches the other side half a round trip later. So a 2.2 KB tree
on a 10 Mbit/s uplink costs 1.8 ms of serialization plus RTT/2, and back-to-back chunks queue behind each
other as they would on a real bottleneck link. No loss, no jitter: the link is a model (docs/decisions.md D8,
"simulated"), not a measurement.

**A link that changes mid-answer** (``LinkSchedule``, issue 33's link sweep): a sequence of links, each from a
given second on, e.g. ``changing:lan@0,bad@4,lan@8`` (``;`` between steps also works, and is needed when a
step is a custom ``rtt=..,up=..`` link). Its clock starts **when the proxy accepts a connection**, for each
connection on its own: a phone session is one WebSocket connection, so every session sees the same change at
the same second after it opened, mid-answer when the answer takes longer than the first step (a reconnect
would start the clock again; the bench's lossless links do not drop). Each chunk is stamped with the link of
the second it reaches the proxy; bytes already on the link keep their times, and the order is kept.
``changing:T`` is ``lan@0, bad@T, lan@2T``. The plain ``changing`` is ``lan@0, bad@0.5, lan@4.5``
(``CHANGING_STEPS``): the first change lands mid-answer for every session of the link sweep (its fastest, a
256-token server-mode answer on lan, took about 1 s on the 2-CPU bench machine), the bad stretch lasts 4 s
(about ten phone rounds, room for the mode rule's hysteresis of 1 s and 3 rounds) and the phone-mode answers
(about 7 s on lan) see the way back to lan too.

    >>> LinkModel.parse("lte").rtt_ms, LinkModel.parse("rtt=20,up=5,down=50").up_mbps
    (50.0, 5.0)
    >>> round(LinkModel(rtt_ms=50, up_mbps=10, down_mbps=40).one_way_s("up", 2200) * 1e3, 2)
    26.76
    >>> [x.name for x in parse_link("changing:lan@0,bad@3").links], parse_link("changing:2").starts
    (['lan', 'bad'], (0.0, 2.0, 4.0))
    >>> parse_link("changing").starts
    (0.0, 0.5, 4.5)

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

    def at(self, t_s: float) -> LinkModel:
        """The link ``t_s`` seconds after a connection opened: always this one (see ``LinkSchedule``)."""
        return self

    @property
    def changes(self) -> int:
        return 0

    def changes_before(self, t_s: float) -> int:
        return 0

    @classmethod
    def parse(cls, text: str) -> LinkModel:
        """A preset name (``lan``, ``lte``, ``5g``) or ``rtt=MS,up=MBPS,down=MBPS`` (any subset; the rest
        from ``lte``; ``;`` may stand for ``,``, as in the link sweep's comma-separated list)."""
        key = text.strip().lower()
        if key in PRESETS:
            return PRESETS[key]
        fields = {"rtt": "rtt_ms", "up": "up_mbps", "down": "down_mbps"}
        values = PRESETS["lte"].to_dict()
        try:
            for part in filter(None, key.replace(";", ",").split(",")):
                name, value = part.split("=")
                values[fields[name.strip()]] = float(value)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"--link {text!r}: use one of {sorted(PRESETS)} or 'rtt=MS,up=MBPS,down=MBPS'"
                              ) from e
        values["name"] = "custom"
        return cls(**values)


#: Presets. LTE sits in the paper's 40-58 ms of network + serialization per round (Appendix G); 5G NSA a
#: little lower; ``lan`` is a near-zero link (a phone on the server's own network, or no phone at all); ``bad``
#: a poor cell or congested link, 300 ms round trip and 1 Mbit/s each way.
PRESETS = {
    "lan": LinkModel(rtt_ms=0.5, up_mbps=1000.0, down_mbps=1000.0, name="lan"),
    "lte": LinkModel(rtt_ms=50.0, up_mbps=10.0, down_mbps=40.0, name="lte"),
    "5g": LinkModel(rtt_ms=30.0, up_mbps=50.0, down_mbps=200.0, name="5g"),
    "bad": LinkModel(rtt_ms=300.0, up_mbps=1.0, down_mbps=1.0, name="bad"),
}

#: the plain ``changing`` link: (from second, preset) steps (module docstring)
CHANGING_STEPS = ((0.0, "lan"), (0.5, "bad"), (4.5, "lan"))
CHANGING = "changing"


@dataclass(frozen=True)
class LinkSchedule:
    """Links that take over from one another at given seconds after a connection opened (module docstring).
    ``starts[0]`` is 0 and the starts increase; ``links[i]`` holds from ``starts[i]`` until ``starts[i + 1]``."""

    starts: tuple[float, ...]
    links: tuple[LinkModel, ...]
    name: str = CHANGING

    def __post_init__(self):
        ok = len(self.starts) == len(self.links) >= 1 and self.starts[0] == 0
        if not (ok and all(b > a for a, b in zip(self.starts, self.starts[1:]))):
            raise ConfigError(f"changing link: the first step at 0 s, then increasing seconds, one link each; got "
                              f"starts {self.starts} for {len(self.links)} links")

    def at(self, t_s: float) -> LinkModel:
        """The link in force ``t_s`` seconds after the connection opened."""
        i = 0
        while i + 1 < len(self.starts) and t_s >= self.starts[i + 1]:
            i += 1
        return self.links[i]

    @property
    def changes(self) -> int:
        """Times the link changes (during a connection that lasts past the last start)."""
        return len(self.links) - 1

    def changes_before(self, t_s: float) -> int:
        """Changes in the first ``t_s`` seconds of a connection."""
        return sum(1 for t in self.starts[1:] if t < t_s)

    def to_dict(self) -> dict:
        return {"name": self.name, "clock": "connection", "changes": self.changes,
                "steps": [{"at_s": t, **x.to_dict()} for t, x in zip(self.starts, self.links)]}

    @classmethod
    def parse(cls, text: str) -> LinkSchedule:
        """``changing`` (``CHANGING_STEPS``), ``changing:T`` (lan@0, bad@T, lan@2T) or
        ``changing:LINK@S,LINK@S,...`` (``;`` between steps when a link is ``rtt=..,up=..,down=..``)."""
        key = text.strip().lower()
        head, _, body = key.partition(":")
        if head != CHANGING:
            raise ConfigError(f"--link {text!r}: a changing link starts with 'changing'")
        try:
            if not body:
                return cls(tuple(t for t, _ in CHANGING_STEPS), tuple(PRESETS[x] for _, x in CHANGING_STEPS), key)
            if "@" not in body:
                t = float(body)
                return cls((0.0, t, 2 * t), (PRESETS["lan"], PRESETS["bad"], PRESETS["lan"]), key)
            steps = [part.rsplit("@", 1) for part in filter(None, body.split(";" if ";" in body else ","))]
            return cls(tuple(float(at) for _, at in steps), tuple(LinkModel.parse(x) for x, _ in steps), key)
        except ValueError as e:
            raise ConfigError(f"--link {text!r}: use 'changing', 'changing:SECONDS' or "
                              f"'changing:LINK@SECONDS,LINK@SECONDS,...' (the first at 0)") from e


def parse_link(text: str) -> LinkModel | LinkSchedule:
    """A fixed link (``LinkModel.parse``'s forms) or a changing one (``LinkSchedule.parse``'s)."""
    if text.strip().lower().startswith(CHANGING):
        return LinkSchedule.parse(text)
    return LinkModel.parse(text)


class _Pipe:
    """One direction of one connection: reads, stamps delivery times, writes in order."""

    def __init__(self, link: LinkModel | LinkSchedule, direction: str, proxy: LinkProxy, t0: float = 0.0):
        self.link, self.direction, self.proxy = link, direction, proxy
        self.t0 = t0  # when the connection opened (loop time): a changing link's clock
        self.free_at = 0.0  # when the sender's side of the link is idle again (loop time)
        self.queue: asyncio.Queue = asyncio.Queue()

    def stamp(self, now: float, nbytes: int) -> float:
        """When ``nbytes`` handed to the link at ``now`` arrive: after the bytes queued before them and
        their own serialization, plus RTT / 2, on the link in force at ``now``.

        >>> p = _Pipe(LinkModel(rtt_ms=10, up_mbps=8, down_mbps=8), "up", None)
        >>> [round(p.stamp(0.0, 1000) * 1e3, 3), round(p.stamp(0.0, 1000) * 1e3, 3)]  # 1 ms each, queued
        [6.0, 7.0]
        """
        link = self.link.at(now - self.t0)
        start = max(now, self.free_at)
        self.free_at = start + link.serialize_s(self.direction, nbytes)
        return self.free_at + link.rtt_ms / 2e3

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
    ``target`` through ``link`` (a ``LinkSchedule``: its clock starts at each connection's accept). Counts the
    bytes each way (``bytes_up``, ``bytes_down``)."""

    def __init__(self, target: tuple[str, int], link: LinkModel | LinkSchedule, *, port: int = 0):
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

    def pipes(self, t0: float) -> tuple[_Pipe, _Pipe]:
        """The two directions of a connection accepted at ``t0`` (loop time)."""
        return _Pipe(self.link, "up", self, t0), _Pipe(self.link, "down", self, t0)

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        t0 = asyncio.get_running_loop().time()
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()
            return
        up, down = self.pipes(t0)
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

