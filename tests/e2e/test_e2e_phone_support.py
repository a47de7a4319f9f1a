"""Shared pieces of the phone e2e modules (no tests here): one real server per pytest process, and the
reference phone of issue 6 item 5.

``phone_server(fixtures_dir)`` starts ``vllm-hyco serve DIR/verifier --speculative-config {...hyco}
--api-key KEY`` on 127.0.0.1 once and returns its base URL; the phone, fuzz, resume and soak modules all
use it (a 2-core CI machine pays ~60 s per server start). It is stopped by PID at interpreter exit.

The reference phone (``PlantedDrafter``) proposes random trees (random tokens, random shapes) and, with
probability ``p_plant``, plants the next tokens of a known continuation along a chain at a random place
among the root's children, behind decoy siblings; the server must commit exactly plain greedy decoding
whatever the phone proposes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import random
import subprocess
import time
import urllib.request
from pathlib import Path

from hyco_lab.bench.server import cli, free_port, stop_process, wait_healthy
from mobile_client.client import HycoClient, Timeouts
from mobile_client.session import PhoneSession, SessionOptions
from mobile_client.tree import DraftTree

API_KEY = "hyco-e2e-key"
MODEL = "tiny"
STARTUP_TIMEOUT_S = 400
IDLE_TIMEOUT_S = 20.0
MAX_SESSIONS = 40
# static: the paper's fixed budget, so raw trees of known size verify whole (tests/integration/test_engine_budget.py
# covers the adaptive policy)
HYCO = {"method": "hyco", "max_sessions": MAX_SESSIONS, "session_idle_timeout_s": IDLE_TIMEOUT_S,
        "budget_policy": "static"}
_SERVER: dict = {}
MTP_K = 4


def hyco_spec(fixtures_dir: Path) -> dict:
    """The shared server's spec: with the family's MTP drafter, so ordinary requests are speculated and
    phone sessions may switch to server mode (issue 33)."""
    return {**HYCO, "model": str(fixtures_dir / "assistant"), "num_speculative_tokens": MTP_K}


def http_get(url: str, timeout: float = 10.0, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def hyco_stats(server: str) -> dict:
    """``GET /v1/hyco/stats``: sessions held by the endpoint, and live/parked sessions and KV in the engine."""
    return json.loads(http_get(f"{server}/v1/hyco/stats", headers={"Authorization": f"Bearer {API_KEY}"})[1])


def wait_drained(server: str, timeout_s: float = IDLE_TIMEOUT_S * 3 + 30) -> dict:
    """Wait until no session is held. The server is shared by the e2e modules, and a phone that dropped
    without closing keeps its session (for a resume) until the idle timeout: tests that count sessions or
    parked requests start from an empty server."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = hyco_stats(server)
        if stats["sessions"] == 0 and stats["engine"]["live"] == 0 and stats["engine"]["parked"] == 0:
            return stats
        assert time.monotonic() < deadline, f"sessions still held after {timeout_s:.0f} s: {stats}"
        time.sleep(1.0)


def phone_server(fixtures_dir: Path) -> str:
    """The base URL of the shared server (started on first use; ``HYCO_E2E_SERVER=URL`` reuses a running one
    started with the same options, for debugging)."""
    if os.environ.get("HYCO_E2E_SERVER"):
        return os.environ["HYCO_E2E_SERVER"].rstrip("/")
    if "base" in _SERVER:
        if _SERVER["proc"].poll() is not None:
            raise RuntimeError(f"the shared server died:\n{Path(_SERVER['log']).read_text()[-4000:]}")
        return _SERVER["base"]
    port = free_port()
    log_path = Path(os.environ.get("HYCO_CACHE", Path(__file__).resolve().parents[2] / ".cache")) / \
        f"e2e-phone-server-{port}.log"
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    # a server's engine core is its own process anyway; with this set (tests/conftest.py sets it for the
    # in-process LLM tests) the engine core's RSS started at 1.8 GB instead of 0.6 GB and grew ~500 MB over
    # the first soak (engine side, reported to the engine owners)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    args = [*cli(), "serve", str(fixtures_dir / "verifier"), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "1024",
            "--max-num-seqs", "32", "--enforce-eager", "--distributed-executor-backend", "uni",
            "--api-key", API_KEY, "--speculative-config", json.dumps(hyco_spec(fixtures_dir))]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    atexit.register(stop_process, proc)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, log_path, STARTUP_TIMEOUT_S)
    _SERVER.update(base=base, proc=proc, log=str(log_path))
    return base


def server_rss_bytes() -> int:
    """Resident memory of the server process and its children (the engine core)."""
    if "proc" not in _SERVER and not os.environ.get("HYCO_E2E_SERVER_PID"):
        return 0
    pid = _SERVER["proc"].pid if "proc" in _SERVER else int(os.environ["HYCO_E2E_SERVER_PID"])
    pids = [pid]
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout.split()
        pids += [int(p) for p in out]
    except OSError:
        pass
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def process_rss_bytes() -> dict[str, int]:
    """Resident memory of the API-server process and, apart, of its engine core (the descendant whose
    command line names ``EngineCore``; with an in-process engine core the API server holds both)."""
    if "proc" not in _SERVER and not os.environ.get("HYCO_E2E_SERVER_PID"):
        return {}
    pid = _SERVER["proc"].pid if "proc" in _SERVER else int(os.environ["HYCO_E2E_SERVER_PID"])
    out = {"api": _rss(pid), "engine_core": 0}
    todo = [pid]
    while todo:
        kids = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True,
                              check=False).stdout.split()
        for k in map(int, kids):
            try:
                name = Path(f"/proc/{k}/cmdline").read_bytes() + Path(f"/proc/{k}/comm").read_bytes()
                if b"EngineCore" in name:
                    out["engine_core"] += _rss(k)
            except OSError:
                continue
            todo.append(k)
    return out


def metric_values(base: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric family from ``/metrics``."""
    _, body = http_get(f"{base}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    out = {}
    for line in body.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


def plain_greedy(base: str, prompts, max_tokens: int) -> dict[str, tuple[str, list[int]]]:
    """Plain greedy decoding of each prompt through ``base``'s OpenAI completions route (the reference of the
    phone tests): ``{prompt: (text, token ids)}``."""
    import openai

    oai = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=300, max_retries=0)
    out = {}
    for p in prompts:
        c = oai.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
        out[p] = (c.text, list(c.model_extra["token_ids"]))
    return out


# -- the reference phone ----------------------------------------------------------------------------------
class PlantedDrafter:
    """Random trees; with probability ``p_plant`` the known continuation is planted as a chain.

    ``target``: token ids of plain greedy decoding after the prompt (a guess is fine: a wrong plant only
    costs acceptance, never correctness). ``session`` is set after the PhoneSession is built.
    """

    def __init__(self, target: list[int], vocab: int, *, seed: int = 0, p_plant: float = 0.8,
                 node_budget: int = 32):
        self.target, self.vocab, self.p_plant = list(target), vocab, p_plant
        self.rng, self.node_budget, self.session = random.Random(seed), node_budget, None

    def propose(self, context, node_budget: int) -> DraftTree:
        budget = min(node_budget, self.node_budget, self.rng.randint(1, self.node_budget))
        tokens, parents = [context.root], [-1]
        children: dict[int, set[int]] = {0: set()}

        def add(parent: int, tok: int) -> int | None:
            if len(tokens) - 1 >= budget or tok in children[parent]:
                return None
            children[parent].add(tok)
            tokens.append(tok)
            parents.append(parent)
            children[len(tokens) - 1] = set()
            return len(tokens) - 1

        done = len(self.session.tokens) if self.session is not None else 0
        nxt = self.target[done:done + self.rng.randint(1, 8)]
        for _ in range(self.rng.randint(0, 3)):  # decoys before the plant
            add(self.rng.randrange(len(tokens)), self.rng.randrange(self.vocab))
        if nxt and self.rng.random() < self.p_plant:
            row = 0
            for tok in nxt:
                row = add(row, tok)
                if row is None:
                    break
        while len(tokens) - 1 < budget:
            add(self.rng.randrange(len(tokens)), self.rng.randrange(self.vocab))
        return DraftTree.make_dummy(tokens, parents, node_budget=self.node_budget)


def make_phone(prompt_ids: list[int], prompt: str | list[int], max_tokens: int, target: list[int],
               vocab: int, seed: int = 0, p_plant: float = 0.8, endpoint: str = "completions",
               request: dict | None = None) -> PhoneSession:
    drafter = PlantedDrafter(target, vocab, seed=seed, p_plant=p_plant)
    body = request or {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    session = PhoneSession(drafter, prompt_tokens=prompt_ids, request=body, endpoint=endpoint,
                           options=SessionOptions(node_budget=32))
    drafter.session = session
    return session


def make_client(base: str, **kw) -> HycoClient:
    return HycoClient(base, API_KEY, timeouts=Timeouts(connect_s=60, frame_s=300, final_s=60), offload=False,
                      **kw)


# -- raw frames -------------------------------------------------------------------------------------------
class RawPhone:
    """A bare WebSocket to the session route: send frames (objects or bytes), receive decoded frames.

    It keeps the schema of the last ``session`` frame received: server frames are decoded with it, and tree
    frame objects sent without ``schema`` get its hash (the confirmation; the server takes it on every tree).
    """

    def __init__(self, http, base: str, key: str | None = API_KEY):
        self.http, self.url, self.key, self.ws = http, base.replace("http", "ws", 1) + "/v1/hyco/session", key, None
        self.schema = None

    async def __aenter__(self):
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        self.ws = await self.http.ws_connect(self.url, headers=headers, max_msg_size=8 << 20)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.ws.close()

    async def send(self, frame) -> None:
        import dataclasses

        from vllm_hyco.handoff.client_frames import TreeFrame
        from vllm_hyco.handoff.frames import encode_frame

        if isinstance(frame, TreeFrame) and frame.schema is None and self.schema is not None:
            frame = dataclasses.replace(frame, schema=self.schema.schema_hash)
        await self.ws.send_bytes(frame if isinstance(frame, (bytes, bytearray)) else encode_frame(frame))

    async def recv_raw(self, timeout: float = 300.0) -> bytes:
        import aiohttp

        msg = await self.ws.receive(timeout=timeout)
        if msg.type != aiohttp.WSMsgType.BINARY:
            raise ConnectionError(f"{msg.type.name}: {msg.data!r}")
        return msg.data

    async def recv(self, timeout: float = 300.0):
        from vllm_hyco.handoff.frames import decode_server_frame
        from vllm_hyco.handoff.server_frames import SessionFrame

        frame = decode_server_frame(await self.recv_raw(timeout), schema=self.schema)
        if isinstance(frame, SessionFrame):
            self.schema = frame.schema
        return frame


    async def recv_verdict(self):
        """The next frame, a verdict, and its hand-off payload, assembled from chunks when it came by
        reference (``None`` when the verdict carries none)."""
        from vllm_hyco.handoff.chunks import HandoffAssembler
        from vllm_hyco.handoff.server_frames import HandoffChunkFrame, VerdictFrame

        v = await self.recv()
        assert isinstance(v, VerdictFrame), v
        handoff = v.handoff
        if v.handoff_ref is not None:
            asm = HandoffAssembler(v.round, v.handoff_ref)
            while not asm.complete:
                chunk = await self.recv()
                assert isinstance(chunk, HandoffChunkFrame)
                asm.add(chunk)
            handoff = asm.payload(self.schema)
        return v, handoff


def start_frame(prompt: str, max_tokens: int = 16, **hyco):
    from vllm_hyco.handoff.client_frames import HycoOptions, StartFrame

    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return StartFrame("completions", body, HycoOptions(**hyco))


def resume_frame(sid: str, last_round: int, need_seed: bool = False):
    from vllm_hyco.handoff.client_frames import HycoOptions, ResumeRequest, StartFrame

    return StartFrame("completions", None, HycoOptions(resume=ResumeRequest(sid, last_round, need_seed)))


def tree_frame(round_: int, root: int, extra: list[int] = (), parents: list[int] | None = None, labels=None,
               schema: bytes | None = None):
    from vllm_hyco.handoff.client_frames import TreeFrame

    tokens = [root, *extra]
    parents = parents if parents is not None else [-1, *range(len(extra))]
    return TreeFrame.from_lists(round_, tokens, parents, labels, schema=schema)


async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Copy one direction of a proxied TCP connection until either side closes (the test proxies use it)."""
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        w.close()


class KillingProxy:
    """A TCP proxy on 127.0.0.1 that cuts connections after a random 0.05-0.3 s (mid-round: the tiny
    server's rounds take tens of milliseconds): the first ``kills`` connections, then each further one with
    probability ``p_kill``."""

    def __init__(self, upstream: str, kills: int, seed: int = 0, p_kill: float = 0.0):
        host, port = upstream.removeprefix("http://").split(":")
        self.up, self.kills, self.rng, self.cut = (host, int(port)), kills, random.Random(seed), 0
        self.p_kill = p_kill

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _conn(self, reader, writer):
        ur, uw = await asyncio.open_connection(*self.up)

        tasks = [asyncio.create_task(pipe(reader, uw)), asyncio.create_task(pipe(ur, writer))]
        if self.cut < self.kills or self.rng.random() < self.p_kill:
            self.cut += 1
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(self.rng.uniform(0.05, 0.3))
            for t in tasks:
                t.cancel()
            writer.transport.abort()
            uw.transport.abort()
        await asyncio.gather(*tasks, return_exceptions=True)
