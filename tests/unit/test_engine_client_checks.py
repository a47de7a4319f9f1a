"""The engine client's request checks (vllm_hyco/vllm_adapter/api_server/engine_client.py), without an engine:
every client mistake in a `start` body is a typed error with a client code naming the field (the code the OpenAI
routes' 4xx would carry), never an untyped exception that would reach the phone as ``internal_error``;
both callers (the phone route and the in-process harness) share the one list of sampling fields."""

import pytest

pytest.importorskip("vllm")

from vllm_hyco.errors import ERROR_CODES, FrameError, RequestFieldError
from vllm_hyco.vllm_adapter.api_server import engine_client as bridge
from vllm_hyco.vllm_adapter.api_server import inprocess as api

BASE = {"model": "tiny", "prompt": "x", "max_tokens": 8, "temperature": 0.0}
CASES = [
    ({"temperature": -1.0}, "bad_request", "temperature"),
    ({"temperature": "hot"}, "bad_request", "temperature"),
    ({"temperature": float("inf")}, "bad_request", "temperature"),
    ({"top_k": -2}, "bad_request", "top_k"),
    ({"top_k": True}, "bad_request", "top_k"),
    ({"top_p": 0.0}, "bad_request", "top_p"),
    ({"max_tokens": 0}, "bad_request", "max_tokens"),
    ({"max_tokens": 2.5}, "bad_request", "max_tokens"),
    ({"min_tokens": 50}, "bad_request", "min_tokens"),
    ({"stop": 5}, "bad_request", "stop"),
    ({"stop": ["ok", 3]}, "bad_request", "stop"),
    ({"stop": [""]}, "bad_request", "stop"),
    ({"seed": "x"}, "bad_request", "seed"),
    ({"seed": 1 << 70}, "bad_request", "seed"),
    ({"ignore_eos": 1}, "bad_request", "ignore_eos"),
    ({"n": 3}, "unsupported_field", "n"),
    ({"n": -1}, "bad_request", "n"),
    ({"model": "other"}, "model_not_found", "model"),
    ({"logit_bias": {"1": 2}}, "unsupported_field", "logit_bias"),
]


class _Tok:
    def encode(self, text, add_special_tokens=True):
        return [2] + [5] * len(text.split())

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return " ".join(str(m["content"]) + "" for m in messages)


class _Client:
    def get_tokenizer(self):
        return _Tok()


def _open_checks(b: bridge.EngineBridge, request: dict, endpoint: str = "completions"):
    ids = b.prompt_ids(endpoint, request)
    if len(ids) < 2:
        raise bridge._bad("prompt", "too short")
    return bridge.session_params(b.sampling_fields(request, len(ids)), "sid", None)


@pytest.mark.parametrize(("overrides", "code", "field"), CASES)
def test_every_client_mistake_gets_its_client_code_naming_the_field(overrides, code, field):
    b = bridge.EngineBridge(_Client(), "tiny", max_model_len=64, vocab_size=100)
    with pytest.raises(RequestFieldError) as e:
        _open_checks(b, {**BASE, **overrides})
    assert e.value.code == code and e.value.field == field and field in str(e.value)
    assert ERROR_CODES[code].side == "client"


def test_prompt_limits_and_accepted_edges():
    b = bridge.EngineBridge(_Client(), "tiny", max_model_len=64, vocab_size=100)
    for prompt in ("w " * 80, list(range(3, 90)), [2, 100], [2, -1]):
        with pytest.raises(RequestFieldError) as e:
            _open_checks(b, {**BASE, "prompt": prompt})
        assert e.value.code == "bad_request" and e.value.field == "prompt", prompt
    with pytest.raises(FrameError):
        b.prompt_ids("completions", {"prompt": {"a": 1}})
    p = _open_checks(b, {**BASE, "max_tokens": 1 << 40, "top_k": 0})  # as the OpenAI routes: cut to the room
    assert p.max_tokens == 64 - 2 and p.top_k == 0  # the prompt is 2 tokens
    p = _open_checks(b, {**BASE, "max_tokens": None, "max_completion_tokens": 5, "seed": 7})
    assert p.max_tokens == 5 and p.extra_args["hyco"]["seed"] == 7 and p.seed is None


def test_the_harness_uses_the_same_fields_and_checks():
    assert not hasattr(api, "ALLOWED_FIELDS") and api.session_params is bridge.session_params
    with pytest.raises(RequestFieldError) as e:
        bridge.session_params({"temperature": 0.0, "frequency_penalty": 1.0}, "s", None)
    assert e.value.code == "unsupported_field" and e.value.field == "frequency_penalty"


def test_the_engine_client_implements_the_phone_routes_engine_port():
    """``serving.engine_port.EngineClient`` is the real interface: the adapter's client has every member
    with the port's parameters (the route is written against the port, the adapter passes its client in)."""
    import inspect

    from vllm_hyco.serving.engine_port import EngineClient

    b = bridge.EngineBridge(_Client(), "tiny", max_model_len=64, vocab_size=100)
    for name in ("model_name", "max_model_len", "vocab_size"):
        assert hasattr(b, name), name
    for name in ("open", "round", "close", "stats"):
        port, ours = getattr(EngineClient, name), getattr(bridge.EngineBridge, name)
        assert inspect.iscoroutinefunction(ours), name
        assert list(inspect.signature(ours).parameters)[1:] == list(inspect.signature(port).parameters)[1:], name
