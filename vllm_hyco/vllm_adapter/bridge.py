"""Async bridge from the API-server process to the engine core (adapter, matches vLLM 0.32 ``AsyncLLM``).

A session is one long-lived request added with ``engine_client.generate`` (``SamplingParams.extra_args
["hyco"] = {"sid", "eps", "seed"}``, output kind DELTA); a task pumps its RequestOutputs (committed ids and
detokenized text, stop strings applied by vLLM's frontend) into a queue. Rounds go through the utility
methods of :mod:`vllm_hyco.vllm_adapter.core_utils` (``call_utility_async``), which run in the engine core
between steps: submit the tree, wait for the round's output, take the raw verdict.

Example (inside the server's event loop)::

    bridge = EngineBridge(engine_client, model_name="tiny")
    s = await bridge.open("chat.completions", {"messages": [...], "max_tokens": 64}, eps=None)
    r = await bridge.round(s, 0, tokens=[s.root, a, b], parents=[-1, 0, 1])
    r.raw["path_rows"], r.token_ids, r.text, r.finish_reason
    await bridge.close(s)
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vllm_hyco.vllm_adapter.api import check_fields
from vllm_hyco.errors import FrameError, HycoError, RequestFieldError, SessionError

# OpenAI body keys that do not change generation (or are checked elsewhere) and are simply accepted
PASSIVE_FIELDS = frozenset({"model", "messages", "prompt", "stream", "stream_options", "user", "n", "echo",
                            "max_completion_tokens", "add_generation_prompt", "skip_special_tokens",
                            "chat_template_kwargs"})
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "ignore_eos", "min_tokens")
logger = logging.getLogger("vllm.hyco")
POLL_S = 0.005
ROUND_TIMEOUT_S = 600.0


class BridgeError(HycoError):
    """A refusal from the engine, with the engine's code (``too_many_sessions``, ``bad_root``...)."""

    code = "internal_error"


@dataclass
class EngineSession:
    sid: str  # hex, the engine's session key
    req_id: str
    prompt_ids: list[int]
    root: int  # round 0's root: the prompt's last token
    max_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    pump: asyncio.Task | None = None
    finished: bool = False


@dataclass
class RoundResult:
    raw: dict[str, Any]  # the engine's verdict (path_rows, bonus, committed, handoff, num_rows, hits, ...)
    token_ids: list[int]  # what vLLM's frontend reports committed this round
    text: str
    finish_reason: str | None


class EngineBridge:
    def __init__(self, engine_client: Any, model_name: str, max_model_len: int, vocab_size: int):
        self.client, self.model_name, self.max_model_len = engine_client, model_name, max_model_len
        self.vocab_size = vocab_size

    async def call(self, name: str, *args) -> Any:
        return await self.client.engine_core.call_utility_async(name, *args)

    # -- prompts and parameters ------------------------------------------------------------------------
    def prompt_ids(self, endpoint: str, request: dict) -> list[int]:
        tok = self.client.get_tokenizer()
        if endpoint == "chat.completions":
            text = tok.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True)
            return list(tok.encode(text, add_special_tokens=False))
        prompt = request["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [int(t) for t in prompt]
        if not isinstance(prompt, str):
            raise FrameError("start.request.prompt must be one string or one list of token ids",
                             code="bad_request")
        return list(tok.encode(prompt, add_special_tokens=True))

    def sampling_fields(self, request: dict, num_prompt: int) -> dict[str, Any]:
        fields = {k: v for k, v in request.items() if k not in PASSIVE_FIELDS}
        if request.get("n", 1) not in (1, None):
            raise RequestFieldError("n", "HyCo sessions generate one choice (n = 1)")
        if request.get("max_completion_tokens") is not None and fields.get("max_tokens") is None:
            fields["max_tokens"] = request["max_completion_tokens"]
        check_fields(fields)  # RequestFieldError naming the first field sessions cannot honour
        out = {k: fields[k] for k in SAMPLING_FIELDS if fields.get(k) is not None}
        out.setdefault("temperature", 1.0)
        room = self.max_model_len - num_prompt
        if room < 1:
            raise FrameError(f"the prompt has {num_prompt} tokens; the model's context is {self.max_model_len}",
                             code="bad_request")
        out["max_tokens"] = min(int(out.get("max_tokens", room)), room)
        return out

    # -- sessions --------------------------------------------------------------------------------------
    async def open(self, endpoint: str, request: dict, eps: float | None) -> EngineSession:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        ids = self.prompt_ids(endpoint, request)
        if len(ids) < 2:
            raise FrameError("a HyCo session needs a prompt of at least 2 tokens", code="bad_request")
        fields = self.sampling_fields(request, len(ids))
        seed = fields.pop("seed", None)
        sid = uuid.uuid4().hex
        try:
            params = SamplingParams(**fields, output_kind=RequestOutputKind.DELTA,
                                    extra_args={"hyco": {"sid": sid, "eps": eps, "seed": seed}})
        except (ValueError, TypeError) as e:
            raise FrameError(f"bad sampling parameters: {e}", code="bad_request") from None
        s = EngineSession(sid, f"hyco-{sid}", ids, ids[-1], fields["max_tokens"])
        s.pump = asyncio.create_task(self._pump(s, {"prompt_token_ids": ids}, params))
        info = await self._wait_state(s, ("parked", "finished"))
        if info is None or info["state"] == "finished":
            await self.close(s)
            code = (info or {}).get("finish_code") or "internal_error"
            if code == "too_many_sessions":
                raise SessionError("the engine holds its maximum number of sessions", code=code)
            raise BridgeError(f"the engine ended the session during its prefill ({code})")
        return s

    async def _pump(self, s: EngineSession, prompt: dict, params) -> None:
        try:
            async for out in self.client.generate(prompt, params, s.req_id):
                s.queue.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the round that waits
            s.queue.put_nowait(e)
        finally:
            s.queue.put_nowait(None)

    async def _wait_state(self, s: EngineSession, states: tuple[str, ...], timeout_s: float = ROUND_TIMEOUT_S):
        deadline, info = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            info = await self.call("hyco_srv_info", s.sid)
            if info is not None and info["state"] in states:
                return info
            if s.pump is not None and s.pump.done() and info is None:
                return None
            await asyncio.sleep(POLL_S)
        return info

    async def round(self, s: EngineSession, round_: int, tokens: list[int], parents: list[int],
                    labels: list[int] | None = None, values: list[float] | None = None) -> RoundResult:
        """Verify one tree; raises BridgeError (engine refusal, with its code) or SessionError. ``labels``
        and ``values`` (per row, optional) feed the engine's node budget (docs/engine.md)."""
        ack = await self.call("hyco_srv_submit", s.sid, round_, tokens, parents, labels, values)
        if "error" in ack:
            raise BridgeError(ack["message"], code=ack["error"])
        ids, text, reason = await self._round_output(s)
        raw = None
        for _ in range(200):
            raw = await self.call("hyco_srv_take", s.sid, round_)
            if not (isinstance(raw, dict) and "error" in raw):
                break
            await asyncio.sleep(POLL_S)
        if raw is None or "error" in raw:
            raise BridgeError(f"no verdict for round {round_}: {raw}")
        if reason is not None:
            s.finished = True
        return RoundResult(raw, ids, text, reason)

    async def _round_output(self, s: EngineSession) -> tuple[list[int], str, str | None]:
        ids: list[int] = []
        text, reason = "", None
        while True:
            wait = ROUND_TIMEOUT_S if not ids else 0.0
            try:
                out = await asyncio.wait_for(s.queue.get(), wait) if wait else s.queue.get_nowait()
            except asyncio.QueueEmpty:
                return ids, text, reason
            except asyncio.TimeoutError:
                raise BridgeError("the engine produced no output for this round") from None
            if out is None or isinstance(out, Exception):
                s.finished = True
                if ids:
                    return ids, text, reason or "abort"
                raise SessionError(f"the engine ended the session ({out!r})", code="session_finished")
            if out.outputs:
                c = out.outputs[0]
                ids += list(c.token_ids)
                text += c.text
                if out.finished:
                    reason = str(c.finish_reason or "stop")
            if out.finished:
                s.finished = True
                return ids, text, reason or "stop"

    async def close(self, s: EngineSession) -> None:
        try:
            await self.call("hyco_srv_close", s.sid)
            await self.client.abort(s.req_id)
        except Exception as e:  # noqa: BLE001 - closing a session the engine already ended
            logger.debug("HyCo close of %s: %s", s.sid, e)
        if s.pump is not None and not s.pump.done():
            s.pump.cancel()

    async def stats(self) -> dict[str, int]:
        return await self.call("hyco_srv_stats")
