"""Drive one configuration's requests through the link proxy and turn them into records.

* ``cloud`` configurations (and ordinary requests): streaming chat completions with the official
  ``openai`` client; time to first token = the first content chunk; tokens from the usage chunk.
* ``phone`` configurations: one simulated phone per prompt (``phones.load_phone``), a
  ``RecordingSession`` over ``/v1/hyco/session``, modelled device time per round (``BenchClient``).

Both run ``concurrency`` requests at a time on one event loop, through one ``LinkProxy`` per pass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyco_lab.bench import phones
from hyco_lab.bench.configs import BenchConfig
from hyco_lab.bench.linkproxy import LinkModel, LinkProxy
from hyco_lab.bench.metrics import RequestRecord
from hyco_lab.bench.server import MODEL_NAME


@dataclass(frozen=True)
class Sampling:
    """The requests' sampling (docs/decisions.md D4: the paper's T = 1, top-k 64, top-p 0.95 by default)."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 64
    top_p: float = 0.95

    def body(self, seed: int) -> dict[str, Any]:
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": seed}
        if self.temperature > 0:
            if self.top_k > 0:
                out["top_k"] = self.top_k
            if self.top_p < 1.0:
                out["top_p"] = self.top_p
        return out


async def _cloud_one(client, config: str, run: int, prompt: dict, sampling: Sampling, seed: int) -> RequestRecord:
    rec = RequestRecord(config, run, prompt["id"])
    body = sampling.body(seed)
    extra = {k: body.pop(k) for k in ("top_k",) if k in body}
    t0 = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=prompt["messages"], stream=True,
            stream_options={"include_usage": True}, extra_body=extra, **body)
        parts: list[str] = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                if rec.ttft_ms is None:
                    rec.ttft_ms = (time.perf_counter() - t0) * 1e3
            if chunk.usage is not None:
                rec.tokens = chunk.usage.completion_tokens
        rec.text = "".join(parts)
    except Exception as e:  # noqa: BLE001 - recorded, not raised: errors are a metric of the sweep
        rec.error = f"{type(e).__name__}: {e}"[:300]
    rec.wall_ms = (time.perf_counter() - t0) * 1e3
    return rec


async def run_cloud(url: str, config: str, run: int, prompts: list[dict], sampling: Sampling, *,
                    concurrency: int = 1, link: LinkModel, seed0: int = 0) -> tuple[list[RequestRecord], dict]:
    from openai import AsyncOpenAI

    async with LinkProxy(_target(url), link) as proxy:
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="bench", max_retries=0,
                             timeout=600.0)
        sem = asyncio.Semaphore(concurrency)

        async def one(i, p):
            async with sem:
                return await _cloud_one(client, config, run, p, sampling, seed0 + i)

        records = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        await client.close()
        return list(records), {"up": proxy.bytes_up, "down": proxy.bytes_down}


def _target(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)
    return host, int(port)


async def _phone_one(url: str, cfg: BenchConfig, run: int, prompt: dict, ids: list[int], bundle: Path,
                     sampling: Sampling, seed: int, frame_timeout_s: float,
                     gate: phones.RoundGate | None = None, slot: int = 0) -> RequestRecord:
    from mobile_client.client import Timeouts
    from mobile_client.session import SessionOptions

    rec = RequestRecord(cfg.name, run, prompt["id"])
    name = f"{run}:{prompt['id']}:{seed}"
    if gate is not None:
        gate.join(name)  # before loading: the first phone loaded must not find the gate open to it alone
    try:
        drafter, spec, opts, rows, _ = await asyncio.to_thread(phones.load_phone, bundle, cfg)
        request = {"messages": prompt["messages"], **sampling.body(seed)}
        session = phones.recording_session_class()(drafter, prompt_tokens=ids, request=request,
                                                   endpoint="chat.completions", spec=spec,
                                                   options=SessionOptions(**opts),
                                                   acceptance=phones.acceptance_of(cfg.name, slot))
        rows.context = session.before_root
        client = phones.bench_client_class()(url, config=cfg, session=session, gate=gate, gate_name=name,
                                             timeouts=Timeouts(frame_s=frame_timeout_s), max_retries=2)
        if gate is not None:  # start together: the sessions' prompts reach the engine in one burst, as the
            await gate.wait(name)  # Cloud+MTP requests do, not one prefill step per phone as each loads
        started = gate.waited_s.get(name, 0.0) if gate is not None else 0.0
        t0 = time.perf_counter()
        try:
            result = await client.run(session)
        finally:
            rec.wall_ms = (time.perf_counter() - t0) * 1e3
            if gate is not None:
                rec.wall_ms -= 1e3 * (gate.waited_s.get(name, 0.0) - started)  # held for the others: not its own
        rec.tokens = len(result.token_ids)
        rec.text = result.text
        rec.trees = [session.bench_trees[k] for k in sorted(session.bench_trees)]  # not a field: not in records
        rec.token_ids = list(result.token_ids)
        if session.bench_first_token is not None:
            rec.ttft_ms = (session.bench_first_token - t0) * 1e3
        rec.rounds = phones.round_records(session, result)
        # delivery = measured server + link, modelled device: drafting slower than the model on this CPU
        # (the client pads only when it is faster) is taken out of the wall time
        rec.wall_ms_measured = rec.wall_ms
        rec.wall_ms -= phones.cpu_overrun_ms(rec.rounds)
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        rec.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        if gate is not None:
            gate.leave(name)
    return rec


async def run_phones(url: str, cfg: BenchConfig, run: int, prompts: list[dict], ids: list[list[int]],
                     bundle: Path, sampling: Sampling, *, concurrency: int = 1, link: LinkModel, seed0: int = 0,
                     frame_timeout_s: float = 300.0, phase_lock: bool = False) -> tuple[list[RequestRecord], dict]:
    """``phase_lock``: the phones send their trees in lock step (``phones.RoundGate``); the returned dict
    then counts the gate's openings (``locked_rounds``)."""
    gate = phones.RoundGate() if phase_lock else None
    async with LinkProxy(_target(url), link) as proxy:
        sem = asyncio.Semaphore(concurrency)
        base = f"http://127.0.0.1:{proxy.port}"

        async def one(i, p):
            async with sem:
                return await _phone_one(base, cfg, run, p, ids[i], bundle, sampling, seed0 + i, frame_timeout_s,
                                        gate, slot=i)

        records = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        info = {"up": proxy.bytes_up, "down": proxy.bytes_down}
        if gate is not None:
            info["locked_rounds"] = gate.opened
        return list(records), info


# -- one request at a time, for closed-loop clients (hyco_lab.bench.mixed) --------------------------------
@asynccontextmanager
async def cloud_caller(url: str, config: str, run: int, sampling: Sampling, *, link: LinkModel
                       ) -> AsyncIterator[Callable[[dict, int], Awaitable[RequestRecord]]]:
    """``call(prompt, seed)``: one streaming ``openai`` request of ``config`` through this caller's link
    proxy, as ``run_cloud`` makes them."""
    from openai import AsyncOpenAI

    async with LinkProxy(_target(url), link) as proxy:
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="bench", max_retries=0,
                             timeout=600.0)
        try:
            yield lambda prompt, seed: _cloud_one(client, config, run, prompt, sampling, seed)
        finally:
            await client.close()


@asynccontextmanager
async def phone_caller(url: str, cfg: BenchConfig, run: int, bundle: Path, sampling: Sampling, *,
                       link: LinkModel, frame_timeout_s: float = 300.0
                       ) -> AsyncIterator[Callable[[dict, list[int], int, int], Awaitable[RequestRecord]]]:
    """``call(prompt, ids, seed, slot)``: one phone session of ``cfg`` (a fresh drafter; ``slot``: the phone,
    whose acceptance model carries over its requests) through this caller's link proxy, as ``run_phones``
    makes them."""
    async with LinkProxy(_target(url), link) as proxy:
        base = f"http://127.0.0.1:{proxy.port}"
        yield lambda prompt, ids, seed, slot: _phone_one(base, cfg, run, prompt, ids, bundle, sampling, seed,
                                                          frame_timeout_s, slot=slot)


@dataclass
class Timed:
    """A closed-loop request: when it was issued and when it returned (``perf_counter`` seconds), its record,
    and what the loop's ``probe`` read when it returned."""

    start: float
    end: float
    record: RequestRecord
    probe: Any = None


class ClosedLoop:
    """``clients`` clients, each issuing its next request (``call(client, k)``, its ``k``-th) as soon as its last
    one returns: a constant load while they run. ``stop()`` (or ``limit`` requests issued) ends the issuing;
    requests in flight finish. ``warm`` is set once every client has had a request return.

    >>> async def call(c, k):
    ...     await asyncio.sleep(0.01 * (c + 1))
    ...     return RequestRecord("x", 0, f"{c}.{k}", tokens=1)
    >>> done = asyncio.run(ClosedLoop(call, 2, limit=5).run())
    >>> len(done), sorted(t.record.prompt_id for t in done)[:3]
    (5, ['0.0', '0.1', '0.2'])
    """

    #: a client whose request failed waits this long before its next one (no hot loop on a refusing server)
    ERROR_PAUSE_S = 0.2

    def __init__(self, call: Callable[[int, int], Awaitable[RequestRecord]], clients: int, *,
                 limit: int | None = None, probe: Callable[[], Any] | None = None):
        self.call, self.clients, self.limit, self.probe = call, clients, limit, probe
        self.done: list[Timed] = []  # in the order they returned
        self.issued = 0
        self.warm = asyncio.Event()
        self._stopping = False
        self._returned: set[int] = set()

    def stop(self) -> None:
        self._stopping = True

    def _more(self) -> bool:
        return not self._stopping and (self.limit is None or self.issued < self.limit)

    async def _client(self, c: int) -> None:
        k = 0
        while self._more():
            self.issued += 1
            t0 = time.perf_counter()
            rec = await self.call(c, k)
            self.done.append(Timed(t0, time.perf_counter(), rec, self.probe() if self.probe else None))
            self._returned.add(c)
            if len(self._returned) == self.clients:
                self.warm.set()
            k += 1
            if rec.error is not None:
                await asyncio.sleep(self.ERROR_PAUSE_S)

    async def run(self) -> list[Timed]:
        await asyncio.gather(*(self._client(c) for c in range(self.clients)))
        self.warm.set()  # nobody waits forever on a loop that ended before every client returned once
        return self.done
