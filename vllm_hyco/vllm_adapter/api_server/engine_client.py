"""The engine client of HyCo sessions (API-server process, vLLM 0.32 ``AsyncLLM``): the one place that turns a
request into a session and a tree into a verdict. It implements the phone route's engine port
(``vllm_hyco.serving.engine_port.EngineClient``); the in-process harness of tests and benchmarks
(``vllm_adapter/api_server/inprocess.py`` ``HycoEngine``) uses the same request checks (:func:`check_fields`,
:data:`SAMPLING_FIELDS`, :func:`session_params`, ``vllm_hyco.config.resolve_session_eps``) and the same
engine-core methods (``vllm_adapter/patches/engine_core_methods.py``), whose results it decodes into the
engine contract's types (``vllm_hyco.engine_contract``).

A session is one long-lived request added with ``engine_client.generate`` (``SamplingParams.extra_args
["hyco"] = {"sid", "eps", "seed"}``, output kind DELTA); a task pumps its RequestOutputs (committed ids and
detokenized text, stop strings applied by vLLM's frontend) into a queue. Rounds go through the engine
core's ``hyco_*`` methods (``call_utility_async``), which run between steps: submit the tree, wait for
the round's output, take the verdict.

Client mistakes are typed before anything reaches the engine, with the field named, as vLLM's OpenAI
routes answer them: a field sessions cannot honour -> ``unsupported_field``; a value vLLM's own
validation rejects (``SamplingParams``, the input processor: negative temperature, ``top_k`` -2, a prompt
longer than the context, ids outside the vocabulary...) -> ``bad_request``; another model's name ->
``model_not_found``. ``max_tokens`` beyond the context is cut to the room left, as the OpenAI routes do.

Example (inside the server's event loop)::

    bridge = EngineBridge(engine_client, model_name="tiny", max_model_len=1024, vocab_size=4096)
    s = await bridge.open("chat.completions", {"messages": [...], "max_tokens": 64}, eps=None)
    r = await bridge.round(s, TreeSubmission(s.sid, 0, tokens=(s.root, a, b), parents=(-1, 0, 1)))
    r.verdict.tree.path_rows, r.token_ids, r.text, r.finish_reason
    await bridge.close(s)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vllm_hyco.engine_contract import EngineStats, RoundVerdict, SessionInfo, TreeSubmission, decode_result
from vllm_hyco.errors import EngineError, FrameError, HycoError, RequestFieldError, SessionError
from vllm_hyco.serving.engine_port import Decoded, RoundResult

#: the sampling fields a HyCo session honours (every other generation field changes the tree decision)
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "ignore_eos", "min_tokens")
# OpenAI body keys that do not change generation (or are checked here) and are simply accepted
PASSIVE_FIELDS = frozenset({"model", "messages", "prompt", "stream", "stream_options", "user", "n", "echo",
                            "max_completion_tokens", "add_generation_prompt", "skip_special_tokens",
                            "chat_template_kwargs"})
_NUMBER, _INT, _BOOL = "a number", "an integer", "true or false"
_FIELD_TYPES = {"temperature": _NUMBER, "top_p": _NUMBER, "top_k": _INT, "seed": _INT, "max_tokens": _INT,
                "min_tokens": _INT, "ignore_eos": _BOOL}
logger = logging.getLogger("vllm.hyco")
POLL_S = 0.005
ROUND_TIMEOUT_S = 600.0


# -- request checks (shared with the in-process harness) ----------------------------------------------------
def check_fields(fields: dict[str, Any]) -> None:
    """RequestFieldError ``unsupported_field`` naming the first field sessions cannot honour."""
    for name, value in fields.items():
        if name not in SAMPLING_FIELDS and value not in (None, False, [], {}):
            raise RequestFieldError(name, f"field {name!r} is not supported for HyCo sessions; "
                                          f"allowed: {', '.join(SAMPLING_FIELDS)}")


def _bad(name: str, message: str) -> RequestFieldError:
    return RequestFieldError(name, f"{name}: {message}", code="bad_request")


def check_values(fields: dict[str, Any]) -> None:
    """RequestFieldError ``bad_request`` for a sampling field of the wrong type (vLLM's SamplingParams
    would fail on it with an untyped error, or accept it and fail in the engine)."""
    for name, value in fields.items():
        if value is None:
            continue
        kind = _FIELD_TYPES.get(name)
        if kind == _BOOL and not isinstance(value, bool):
            raise _bad(name, f"must be {kind}, got {value!r}")
        if kind in (_INT, _NUMBER) and (isinstance(value, bool) or not isinstance(value, (int, float))
                                        or (kind == _INT and not isinstance(value, int))):
            raise _bad(name, f"must be {kind}, got {value!r}")
        if kind == _NUMBER and not math.isfinite(value):
            raise _bad(name, f"must be a finite number, got {value!r}")
        if name == "seed" and not -(1 << 63) <= value < (1 << 64):
            raise _bad(name, f"must fit in 64 bits, got {value}")
        if name == "stop" and not (isinstance(value, str) or (
                isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value))):
            raise _bad(name, f"must be a string or an array of strings, got {value!r}")


def _field_of(e: Exception, default: str) -> str:
    name = getattr(e, "parameter", None)
    if name:
        return str(name)
    first = str(e).split(" ", 1)[0]
    return first if first in SAMPLING_FIELDS else default


def session_params(fields: dict[str, Any], sid: str, eps: float | None):
    """The SamplingParams of a session, checked by vLLM's own validation (a rejection is a typed
    ``bad_request`` naming the field). The seed travels in ``extra_args``, not ``SamplingParams.seed``:
    the session's tree decision draws from its own generator, and vLLM 0.32's CPU runner cannot rewind a
    seeded generator after the discarded sample of a partial prefill."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMError
    from vllm.sampling_params import RequestOutputKind

    check_fields(fields)
    check_values(fields)
    fields = {k: v for k, v in fields.items() if v is not None}
    seed = fields.pop("seed", None)
    try:
        return SamplingParams(**fields, output_kind=RequestOutputKind.DELTA,
                              extra_args={"hyco": {"sid": sid, "eps": eps, "seed": seed}})
    except (ValueError, TypeError, VLLMError) as e:  # VLLMValidationError is a VLLMError, not a ValueError
        raise _bad(_field_of(e, "request"), str(e)) from None


def client_error(e: BaseException) -> HycoError | None:
    """The typed client error for an exception vLLM's frontend raised on a request (what its OpenAI
    routes answer with 4xx), or None when it is not the client's fault."""
    from vllm.exceptions import VLLMClientError, VLLMNotFoundError

    cause = e.__cause__ if e.__cause__ is not None and not isinstance(e, (ValueError, VLLMClientError)) else e
    if isinstance(cause, VLLMNotFoundError):
        return RequestFieldError("model", str(cause), code="model_not_found")
    if isinstance(cause, (VLLMClientError, ValueError)):
        return _bad(_field_of(cause, "prompt"), str(cause))
    return None



# -- the async client ---------------------------------------------------------------------------------------
@dataclass
class EngineSession:
    sid: str  # hex, the engine's session key
    req_id: str
    prompt_ids: list[int]
    root: int  # round 0's root: the prompt's last token
    max_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    pump: asyncio.Task | None = None
    error: BaseException | None = None  # what ended the request stream with an exception
    finished: bool = False


class EngineBridge:
    def __init__(self, engine_client: Any, model_name: str, max_model_len: int, vocab_size: int,
                 served_names: tuple[str, ...] = ()):
        self.client, self.model_name, self.max_model_len = engine_client, model_name, max_model_len
        self.vocab_size = vocab_size
        self.served_names = frozenset((model_name, *served_names))

    async def call(self, name: str, *args: Any) -> Any:
        """One engine-core method, its result decoded into the contract's type; a typed error it returned
        is raised here with its class and code."""
        return decode_result(name, await self.client.engine_core.call_utility_async(name, *args))

    # -- prompts and parameters ------------------------------------------------------------------------
    def prompt_ids(self, endpoint: str, request: dict) -> list[int]:
        tok = self.client.get_tokenizer()
        if endpoint == "chat.completions":
            try:
                text = tok.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - the template's only input is the phone's messages
                raise _bad("messages", f"the chat template cannot render them: {type(e).__name__}: {e}") from None
            return list(tok.encode(text, add_special_tokens=False))
        prompt = request["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            return [int(t) for t in prompt]
        if not isinstance(prompt, str):
            raise FrameError("start.request.prompt must be one string or one list of token ids",
                             code="bad_request")
        return list(tok.encode(prompt, add_special_tokens=True))

    def sampling_fields(self, request: dict, num_prompt: int) -> dict[str, Any]:
        model = request.get("model")
        if model is not None and model not in self.served_names:
            raise RequestFieldError("model", f"model: the model {model!r} does not exist here; this server "
                                             f"serves {self.model_name!r}", code="model_not_found")
        n = request.get("n", 1)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise _bad("n", f"must be an integer of at least 1, got {n!r}")
        if n not in (1, None):
            raise RequestFieldError("n", "HyCo sessions generate one choice (n = 1)")
        fields = {k: v for k, v in request.items() if k not in PASSIVE_FIELDS}
        if request.get("max_completion_tokens") is not None and fields.get("max_tokens") is None:
            fields["max_tokens"] = request["max_completion_tokens"]
        check_fields(fields)  # RequestFieldError naming the first field sessions cannot honour
        check_values(fields)
        out = {k: fields[k] for k in SAMPLING_FIELDS if fields.get(k) is not None}
        out.setdefault("temperature", 1.0)
        room = self.max_model_len - num_prompt
        if room < 1:
            name = "messages" if "messages" in request else "prompt"
            raise _bad(name, f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                             f"has {num_prompt}, leaving no room for output; shorten it")
        if out.get("max_tokens", room) >= 1:  # below 1: vLLM's own check names max_tokens
            out["max_tokens"] = min(int(out.get("max_tokens", room)), room)  # as the OpenAI routes clamp
        return out

    # -- sessions --------------------------------------------------------------------------------------
    async def open(self, endpoint: str, request: dict, eps: float | None) -> EngineSession:
        ids = self.prompt_ids(endpoint, request)
        if len(ids) < 2:
            raise _bad("messages" if endpoint == "chat.completions" else "prompt",
                       "a HyCo session needs a prompt of at least 2 tokens")
        fields = self.sampling_fields(request, len(ids))
        sid = uuid.uuid4().hex
        params = session_params(fields, sid, eps)
        s = EngineSession(sid, f"hyco-{sid}", ids, ids[-1], fields["max_tokens"])
        s.pump = asyncio.create_task(self._pump(s, {"prompt_token_ids": ids}, params))
        info = await self._wait_state(s, ("parked", "finished"))
        if info is None or info.state == "finished":
            await self.close(s)
            if info is None and s.error is not None:
                typed = client_error(s.error)
                if typed is not None:
                    raise typed
            code = (info.finish_code if info is not None else None) or "internal_error"
            if code == "too_many_sessions":
                raise SessionError("the engine holds its maximum number of sessions", code=code)
            raise EngineError(f"the engine ended the session during its prefill ({code}; "
                              f"{type(s.error).__name__ if s.error else 'no error'}: {s.error})")
        return s

    async def _pump(self, s: EngineSession, prompt: dict, params) -> None:
        try:
            async for out in self.client.generate(prompt, params, s.req_id):
                s.queue.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the round that waits (or to open)
            s.error = e
            s.queue.put_nowait(e)
        finally:
            s.queue.put_nowait(None)

    async def info(self, sid: str) -> SessionInfo | None:
        """The engine's session info, or None when it does not know the sid."""
        try:
            return await self.call("hyco_session_info", sid)
        except SessionError as e:
            if e.code == "unknown_session":
                return None
            raise

    async def _wait_state(self, s: EngineSession, states: tuple[str, ...],
                          timeout_s: float = ROUND_TIMEOUT_S) -> SessionInfo | None:
        deadline, info = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            info = await self.info(s.sid)
            if info is not None and info.state in states:
                return info
            if s.pump is not None and s.pump.done() and info is None:
                return None
            await asyncio.sleep(POLL_S)
        return info

    async def round(self, s: EngineSession, tree: TreeSubmission) -> RoundResult:
        """Verify one tree of session ``s`` (``tree.sid`` is ``s.sid``); raises the engine's typed refusal
        (``server_busy``, ``bad_root``, an ended session's code...) or EngineError. The tree's labels and
        values (per row, optional) feed the engine's node budget (docs/engine.md)."""
        if tree.sid != s.sid:
            raise EngineError(f"round {tree.round}: the tree names engine session {tree.sid!r}, not {s.sid!r}")
        await self.call("hyco_submit_tree", tree.to_wire())
        ids, text, reason = await self._round_output(s)
        verdict: RoundVerdict | None = None
        last = None
        for _ in range(200):
            try:
                verdict = await self.call("hyco_take_verdict", s.sid, tree.round)
                break
            except SessionError as e:  # the verdict can trail the round's output by a step
                if e.code != "no_verdict":
                    raise
                last = e
                await asyncio.sleep(POLL_S)
        if verdict is None:
            raise EngineError(f"no verdict for round {tree.round}: {last}")
        if reason is not None:
            s.finished = True
        return RoundResult(verdict, ids, text, reason)

    async def _round_output(self, s: EngineSession) -> tuple[list[int], str, str | None]:
        try:
            return await self._outputs(s, ROUND_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineError("the engine produced no output for this round") from None

    async def _outputs(self, s: EngineSession, first_wait_s: float) -> tuple[list[int], str, str | None]:
        """The session's outputs since the last take: waits up to ``first_wait_s`` for the first token
        (``asyncio.TimeoutError``), then takes what else is queued, up to the request's end. A stream that
        ended with nothing taken raises SessionError ``session_finished``."""
        ids: list[int] = []
        text, reason = "", None
        while True:
            if ids:  # then only what is queued already
                try:
                    out = s.queue.get_nowait()
                except asyncio.QueueEmpty:
                    return ids, text, reason
            else:  # an output with no token (none taken yet) is waited past
                out = await asyncio.wait_for(s.queue.get(), first_wait_s)
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

    # -- server mode ---------------------------------------------------------------------------------
    async def set_mode(self, s: EngineSession, mode: str, round_: int) -> SessionInfo:
        info: SessionInfo = await self.call("hyco_set_mode", s.sid, mode, round_)
        return info

    async def decoded(self, s: EngineSession, timeout_s: float) -> Decoded | None:
        """The outputs that reached the session's queue (``_outputs``); None when none came in ``timeout_s``. A
        stream that ended cleanly with nothing more is an aborted end (``abort``), one that ended with an
        error raises."""
        try:
            return Decoded(*await self._outputs(s, timeout_s))
        except asyncio.TimeoutError:
            return None
        except SessionError:
            if s.error is not None:
                raise
            return Decoded([], "", "abort")

    async def close(self, s: EngineSession) -> None:
        try:
            await self.call("hyco_close", s.sid, True)
        except HycoError as e:  # closing a session the engine already ended (or never knew)
            logger.debug("HyCo close of %s: %s", s.sid, e)
        try:
            await self.client.abort(s.req_id)
        except Exception as e:  # noqa: BLE001 - aborting a request the frontend already dropped
            logger.debug("HyCo abort of %s: %s", s.sid, e)
        if s.pump is not None and not s.pump.done():
            s.pump.cancel()

    async def stats(self) -> EngineStats:
        stats: EngineStats = await self.call("hyco_stats")
        return stats
