"""Issue 17 items 1-2 on real servers: two HyCo replicas (``vllm-hyco serve … --speculative-config
'{"method": "hyco", "replica_id": "r0"|"r1"}'``) behind nginx (Debian's package, started here on 127.0.0.1
from ``deploy/nginx-hyco.conf``), tiny trained fp32 fixtures, greedy exact mode.

* 8 phones through nginx: every phone's text and token ids equal plain greedy decoding (the OpenAI
  completions route through the same proxy), and their sessions land on both replicas;
* a phone whose connection drops resumes on its own replica (same session id, no failover, the replica's
  ``resumed`` counter moves);
* a forged routing key (another replica's prefix, an id nobody issued, a key that disagrees with the
  resume frame) gets ``unknown_session``, and the real id still resumes afterwards;
* last (it kills a replica): a phone with the real drafters (MTP head + SLM) whose replica is killed
  mid-answer finishes on the other one with the same text, no committed token lost or repeated.

The two replicas start together (one OpenMP thread each, so each has a core) and are shared by the cases;
without nginx on the PATH the module skips (``scripts/setup_env.sh`` installs it as root).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest
from test_e2e_phone_support import (
    API_KEY,
    MODEL,
    RawPhone,
    http_get,
    make_client,
    make_phone,
    metric_values,
    pipe,
    plain_greedy,
    resume_frame,
    start_frame,
    tree_frame,
)

from hyco_lab.bench.server import cli, free_port
from vllm_hyco.handoff.server_frames import ErrorFrame, SessionFrame, VerdictFrame
from vllm_hyco.handoff.session_id import route_key

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "nginx-hyco.conf"
REPLICAS = ("r0", "r1")
PROMPTS = ["In the beginning God created", "And the LORD said unto Moses,", "Blessed are the",
           "The LORD is my shepherd;", "For God so loved", "Jesus wept. And", "Let there be light:",
           "Thou shalt not"]
MAX_TOKENS = 24
STARTUP_TIMEOUT_S = 600

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None,
                                reason="nginx is not installed: apt-get install -y nginx-light "
                                       "(scripts/setup_env.sh does it when run as root)")


def render_nginx(listen: str, upstreams: dict[str, str], access_log: str) -> str:
    """``deploy/nginx-hyco.conf`` with its placeholders filled in."""
    text = TEMPLATE.read_text()
    for name, value in {"LISTEN": listen, "R0": upstreams["r0"], "R1": upstreams["r1"],
                        "ACCESS_LOG": access_log}.items():
        text = text.replace("{{" + name + "}}", value)
    assert "{{" not in text, "a placeholder of deploy/nginx-hyco.conf was not filled"
    return text


class Cluster:
    """Two replicas and nginx, started once for the module; processes run in their own groups."""

    def __init__(self, fixtures_dir: Path):
        self.dir = Path(tempfile.mkdtemp(prefix="hyco-replicas-"))
        self.fixtures_dir = fixtures_dir
        self.ports = {r: free_port() for r in REPLICAS}
        self.procs: dict[str, subprocess.Popen] = {}
        self.proxy_port = free_port()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def replica_url(self, r: str) -> str:
        return f"http://127.0.0.1:{self.ports[r]}"

    def _popen(self, name: str, args: list[str], env: dict) -> subprocess.Popen:
        with open(self.dir / f"{name}.log", "wb") as log:
            return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def log_tail(self, name: str) -> str:
        try:
            return (self.dir / f"{name}.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def _start_replica(self, r: str, env: dict) -> None:
        hyco = {"method": "hyco", "replica_id": r, "max_sessions": 16, "session_idle_timeout_s": 30}
        args = [*cli(), "serve", str(self.fixtures_dir / "verifier"), "--host", "127.0.0.1", "--port",
                str(self.ports[r]), "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len",
                "1024", "--max-num-seqs", "16", "--enforce-eager", "--distributed-executor-backend", "uni",
                "--api-key", API_KEY, "--speculative-config", json.dumps(hyco)]
        self.procs[r] = self._popen(r, args, env)

    def _wait_healthy(self, name: str, url: str, deadline: float, restart=None) -> None:
        """Poll ``/health``; a process that exits is restarted once by ``restart`` (two servers starting
        at once on a busy box can race for a free port), else its log is raised."""
        while True:
            proc = self.procs[name]
            if proc.poll() is not None:
                tail = self.log_tail(name) + (self.log_tail("nginx-error") if name == "nginx" else "")
                if restart is not None:
                    (self.dir / f"{name}.log").rename(self.dir / f"{name}.first.log")
                    restart()
                    restart = None
                    continue
                self.stop(keep_logs=True)
                raise RuntimeError(f"{name} exited with {proc.returncode} (logs in {self.dir}):\n{tail}")
            try:
                if http_get(f"{url}/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail(name)
                self.stop(keep_logs=True)
                raise RuntimeError(f"{name} not healthy after {STARTUP_TIMEOUT_S} s (logs in {self.dir}):\n"
                                   f"{tail}")
            time.sleep(1.0)

    def start(self) -> Cluster:
        env = dict(os.environ)
        env.pop("VLLM_PLUGINS", None)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core in its own process, as deployed
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        for r in REPLICAS:  # together: on 2 cores each has one
            self._start_replica(r, env)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for r in REPLICAS:
            def again(r=r):
                self.ports[r] = free_port()
                self._start_replica(r, env)
            self._wait_healthy(r, self.replica_url(r), deadline, restart=again)
        conf = self.dir / "hyco.conf"
        conf.write_text(render_nginx(f"127.0.0.1:{self.proxy_port}",
                                     {r: f"127.0.0.1:{p}" for r, p in self.ports.items()},
                                     str(self.dir / "access.log")))
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.dir / sub).mkdir(mode=0o777, exist_ok=True)
        d = self.dir
        (d / "nginx.conf").write_text(
            f"worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log info;\n"
            f"events {{ worker_connections 512; }}\n"
            f"http {{\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n"
            f"  fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n"
            f"  include {conf};\n}}\n")
        self.procs["nginx"] = self._popen("nginx", ["nginx", "-e", f"{d}/nginx-error.log", "-p", str(d), "-c",
                                                    str(d / "nginx.conf")], env)
        self._wait_healthy("nginx", self.base, time.monotonic() + 60)
        return self

    def kill(self, name: str) -> None:
        """SIGKILL a replica's whole process group (API server and engine core), as a crash would."""
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def stop(self, keep_logs: bool = False) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        if not keep_logs:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(fixtures_dir):
    c = Cluster(fixtures_dir).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def tok(fixtures_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(fixtures_dir / "verifier"))


@pytest.fixture(scope="module")
def plain(cluster):
    """Plain greedy decoding of every prompt through the proxy's OpenAI completions route."""
    return plain_greedy(cluster.base, PROMPTS, MAX_TOKENS)


def _body(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True}


def _phone(tok, prompt, reference, seed):
    return make_phone(tok.encode(prompt), prompt, MAX_TOKENS, reference[1], len(tok), seed=seed,
                      request=_body(prompt))


def _resumed(cluster, r: str) -> float:
    return sum(v for k, v in metric_values(cluster.replica_url(r), "vllm_hyco_sessions_total").items()
               if 'outcome="resumed"' in k)


def test_eight_phones_spread_over_both_replicas(cluster, tok, plain):
    async def phones():
        sessions = [_phone(tok, p, plain[p], seed=20 + i) for i, p in enumerate(PROMPTS)]
        async with aiohttp.ClientSession() as http:
            client = make_client(cluster.base, http=http)
            await asyncio.gather(*(client.run(s) for s in sessions))
        return sessions

    sessions = asyncio.run(phones())
    for prompt, s in zip(PROMPTS, sessions):
        assert "".join(s.text_parts) == plain[prompt][0], prompt
        assert s.tokens == plain[prompt][1] and s.failovers == 0
    owners = [route_key(s.sid) for s in sessions]
    assert set(owners) == set(REPLICAS), owners


class CutProxy:
    """A TCP proxy in front of nginx whose open connections ``cut()`` aborts (a phone losing its link)."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").split(":")
        self.up, self.conns, self.cuts = (host, int(port)), [], 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    def cut(self) -> None:
        self.cuts += 1
        for w in self.conns:
            w.transport.abort()
        self.conns.clear()

    async def _conn(self, reader, writer):
        ur, uw = await asyncio.open_connection(*self.up)
        self.conns += [writer, uw]

        await asyncio.gather(pipe(reader, uw), pipe(ur, writer), return_exceptions=True)


def _act_before_round(session, drafter, rnd: int, action) -> None:
    """Run ``action(session)`` once, when the drafter is asked for round ``rnd``'s tree (the verdicts before
    it are committed; the tree is sent on the connection ``action`` breaks)."""
    propose, done = drafter.propose, []

    def wrapped(context, node_budget):
        if session.round == rnd and not done and session.failovers == 0:
            done.append(True)
            action(session)
        return propose(context, node_budget)

    drafter.propose = wrapped


def test_dropped_phone_resumes_on_its_own_replica(cluster, tok, plain):
    prompt = PROMPTS[3]
    before = {r: _resumed(cluster, r) for r in REPLICAS}

    async def run():
        async with CutProxy(cluster.base) as proxy:
            session = _phone(tok, prompt, plain[prompt], seed=7)
            sids = []
            _act_before_round(session, session.drafter, 2, lambda s: (sids.append(s.sid), proxy.cut()))
            await make_client(proxy.base).run(session)
            return session, sids, proxy.cuts

    session, sids, cuts = asyncio.run(run())
    assert cuts == 1 and session.resumes >= 1 and session.failovers == 0
    assert session.sid == sids[0]  # the same session, so the same replica
    owner = route_key(session.sid)
    assert _resumed(cluster, owner) >= before[owner] + 1
    assert session.tokens == plain[prompt][1] and "".join(session.text_parts) == plain[prompt][0]


def _raw(http, base: str, route: str | None = None) -> RawPhone:
    phone = RawPhone(http, base)
    if route is not None:
        phone.url += f"?route={route}"
    return phone


def test_forged_routing_key_gets_unknown_session(cluster, tok):
    prompt = PROMPTS[6]
    root = tok.encode(prompt)[-1]

    async def run():
        async with aiohttp.ClientSession() as http:
            async with _raw(http, cluster.base) as phone:
                await phone.send(start_frame(prompt, max_tokens=8))
                ack = await phone.recv()
                assert isinstance(ack, SessionFrame), ack
                await phone.send(tree_frame(0, root))
                v = await phone.recv()
                assert isinstance(v, VerdictFrame), v
            sid = ack.session_id
            owner, rand = sid.split(".")
            other = next(r for r in REPLICAS if r != owner)
            tries = {  # (the handshake's ?route=, the resume frame's session id)
                "another replica's prefix": (other, f"{other}.{rand}"),
                "an id nobody issued": (owner, f"{owner}.{'0' * len(rand)}"),
                "key and frame disagree": (other, sid),
            }
            answers = {}
            for why, (route, forged) in tries.items():
                async with _raw(http, cluster.base, route) as phone:
                    await phone.send(resume_frame(forged, 0))
                    answers[why] = await phone.recv()
            async with _raw(http, cluster.base, owner) as phone:  # the real key still resumes
                await phone.send(resume_frame(sid, 0))
                again = await phone.recv()
                replay = await phone.recv()
            return answers, again, replay, sid

    answers, again, replay, sid = asyncio.run(run())
    for why, frame in answers.items():
        assert isinstance(frame, ErrorFrame) and frame.code == "unknown_session" and frame.fatal, (why, frame)
    assert isinstance(again, SessionFrame) and again.session_id == sid and again.last_round == 0
    assert isinstance(replay, VerdictFrame) and replay.round == 0


def test_killed_replica_fails_over_with_the_same_text(cluster, tok, plain, fixtures_dir):
    """Runs last: one replica is gone afterwards."""
    from mobile_client.cli import load_bundle
    from mobile_client.session import PhoneSession, SessionOptions

    if not (fixtures_dir / "handoff_scales.npz").exists():
        pytest.skip("the fixtures have no hand-off scales (random weights): no MTP head to reseed")
    prompt = PROMPTS[0]
    bundle = load_bundle(fixtures_dir)
    session = PhoneSession(bundle.drafter, prompt_tokens=tok(prompt)["input_ids"], request=_body(prompt),
                           endpoint="completions", spec=bundle.spec,
                           options=SessionOptions(keep_set_hash=bundle.keep_set_hash))
    killed = []

    def kill_owner(s):
        killed.append(route_key(s.sid))
        cluster.kill(killed[0])

    _act_before_round(session, bundle.drafter, 2, kill_owner)
    asyncio.run(make_client(cluster.base).run(session))
    assert killed and session.failovers == 1
    assert route_key(session.sid) not in (None, killed[0])  # finished on the other replica
    assert session.tokens == plain[prompt][1]  # nothing lost, nothing repeated
    assert "".join(session.text_parts) == plain[prompt][0]
    assert session.result().mat > 1.0  # the reopened session drafts with the new seed hand-off
