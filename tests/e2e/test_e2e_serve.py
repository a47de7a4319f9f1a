"""`vllm-hyco serve DIR/verifier --speculative-config ...` as a real server on 127.0.0.1.

One server for the module (started from the console script with VLLM_PLUGINS unset, to show the CLI
brings up the phone routes by itself), killed by PID at the end. Its spec is an MTP deployment's with the
method changed to ``hyco`` (``SPEC``): ordinary requests keep vLLM's MTP. The official ``openai`` client
talks to it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import urllib.request
from pathlib import Path

import pytest

from hyco_lab.bench.server import cli, free_port, stop_process, wait_healthy

STARTUP_TIMEOUT_S = 300
MODEL = "tiny"


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    return env


def _serve_args(verifier: Path, port: int, spec: str) -> list[str]:
    return [*cli(), "serve", str(verifier), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "1024",
            "--max-num-seqs", "4", "--enforce-eager", "--distributed-executor-backend", "uni",
            "--speculative-config", spec]


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read()


def _spec(fixtures_dir: Path, **extra) -> str:
    """The one-word switch: ``{"method": "mtp", "model": ..., "num_speculative_tokens": 4}`` with ``hyco``."""
    return json.dumps({"method": "hyco", "model": str(fixtures_dir / "assistant"), "num_speculative_tokens": 4,
                       **extra})


@pytest.fixture(scope="module")
def server(fixtures_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_serve_args(fixtures_dir / "verifier", port, _spec(fixtures_dir)), env=_server_env(),
                                stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log_path, STARTUP_TIMEOUT_S)
        yield base
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0)


def test_hyco_routes_exist(server):
    status, body = _get(f"{server}/v1/hyco/info")
    info = json.loads(body)
    assert status == 200 and info["enabled"] and info["vllm"].startswith("0.32")
    assert info["config"]["method"] == "hyco" and info["config"]["node_budget"] == 32
    assert info["config"]["epsilon"] is None  # exact by default

    async def session_frame():
        import aiohttp

        from vllm_hyco.handoff.frames import decode_server_frame

        async with aiohttp.ClientSession() as http, http.ws_connect(
                f"{server.replace('http', 'ws')}/v1/hyco/session") as ws:
            await ws.send_bytes(b"\xc1")  # never valid msgpack: the route answers with an error frame
            return decode_server_frame(await ws.receive_bytes(timeout=30))

    frame = asyncio.run(session_frame())  # the phone protocol itself is covered by test_e2e_phone*.py
    assert frame.code == "bad_msgpack" and not frame.fatal


def test_openai_client_streams_chat(client):
    messages = [{"role": "user", "content": "Write a line about tests."}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert len([p for p in pieces if p]) > 1 and finish == "length"
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert "".join(pieces) == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 16


def test_ordinary_requests_are_drafted_by_vllms_mtp(server, client):
    from hyco_lab.bench.server import parse_prometheus, spec_counters

    def counters():
        return spec_counters(parse_prometheus(_get(f"{server}/metrics")[1].decode()))

    before = counters()
    client.completions.create(model=MODEL, prompt="In the beginning", max_tokens=24, temperature=0,
                              extra_body={"ignore_eos": True})
    after = counters()
    assert after["draft_tokens"] > before["draft_tokens"] and after["accepted"] >= before["accepted"]


def test_completions_stream_and_not(client):
    kwargs = dict(model=MODEL, prompt="def hello(world):", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs)
    chunks = client.completions.create(stream=True, **kwargs)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert plain.usage.completion_tokens == 12 and streamed == plain.choices[0].text


def test_ignored_sampling_fields_get_400_naming_them(client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"min_p": 0.1})
    assert err.value.status_code == 400 and "min_p" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       logit_bias={"5": 10})
    assert err.value.status_code == 400 and "logit_bias" in str(err.value)


def test_bad_hyco_option_refused_at_startup(fixtures_dir):
    spec = json.dumps({"method": "hyco", "node_budgt": 3})
    proc = subprocess.run(_serve_args(fixtures_dir / "verifier", free_port(), spec), env=_server_env(),
                          capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S)
    assert proc.returncode != 0
    assert "unknown hyco option 'node_budgt'" in proc.stderr and "node_budget" in proc.stderr


def test_a_model_that_is_not_an_mtp_drafter_is_refused_at_startup(fixtures_dir):
    spec = _spec(fixtures_dir, model=str(fixtures_dir / "verifier"))
    proc = subprocess.run(_serve_args(fixtures_dir / "verifier", free_port(), spec), env=_server_env(),
                          capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S)
    assert proc.returncode != 0
    assert "not an MTP drafter" in proc.stderr and "gemma4_assistant" in proc.stderr
