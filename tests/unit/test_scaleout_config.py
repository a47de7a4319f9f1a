"""Issue 17 items 1, 3 and 4 without vLLM: the topologies a HyCo server refuses say why and what to use
instead, tensor parallelism is not refused, and ``replica_id`` (the replica's routing key, the prefix of
its session ids) is validated."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hyco.config import HycoConfig
from vllm_hyco.errors import ConfigError
from vllm_hyco.vllm_adapter.api_server.expansion import REFUSALS, expand_engine_args


def _args(**overrides):
    base = dict(speculative_config="hyco", tensor_parallel_size=1, pipeline_parallel_size=1,
                data_parallel_size=1, _api_process_count=1, async_scheduling=None, scheduler_cls=None,
                worker_cls="auto", additional_config={})
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("overrides, flag, why, instead", [
    (dict(pipeline_parallel_size=2), "--pipeline-parallel-size 2", "every layer", "replicas behind a proxy"),
    (dict(decode_context_parallel_size=2), "--decode-context-parallel-size 2", "by token position",
     "replicas behind a proxy"),
    (dict(prefill_context_parallel_size=2), "--prefill-context-parallel-size 2", "one rank's cache",
     "replicas behind a proxy"),
    (dict(data_parallel_size=2), "--data-parallel-size 2", "lockstep", "one replica per GPU"),
    (dict(_api_process_count=3), "--api-server-count 3", "one API server's session table",
     "replicas behind a proxy"),
    (dict(async_scheduling=True), "--async-scheduling", "custom_class", "remove --async-scheduling"),
])
def test_refusals_name_the_flag_why_and_what_instead(overrides, flag, why, instead):
    with pytest.raises(ConfigError) as err:
        expand_engine_args(_args(**overrides), is_cpu=True)
    msg = str(err.value)
    assert f"cannot run with {flag}:" in msg and why in msg and "Instead, " in msg and instead in msg
    assert "docs/deploy.md" in msg


def test_every_refusal_has_a_reason_and_an_alternative():
    assert set(REFUSALS) == {"--pipeline-parallel-size", "--decode-context-parallel-size",
                             "--prefill-context-parallel-size", "--data-parallel-size", "--api-server-count",
                             "--async-scheduling"}
    assert all(why and instead for why, instead in REFUSALS.values())


@pytest.mark.parametrize("is_cpu", [True, False])
def test_tensor_parallelism_is_not_refused(is_cpu):
    """Each rank verifies trees on its KV heads and the hand-off gathers them (the engine side:
    tests/e2e/test_e2e_tensor_parallel.py)."""
    args = _args(tensor_parallel_size=2)
    expand_engine_args(args, is_cpu=is_cpu)
    assert args.tensor_parallel_size == 2 and args.speculative_config["method"] == "custom_class"


def test_replica_id_is_validated_and_kept():
    cfg = HycoConfig.parse('{"method": "hyco", "replica_id": "eu-1"}')
    assert cfg.replica_id == "eu-1" and HycoConfig.from_dict(cfg.to_dict()) == cfg
    assert HycoConfig.parse("hyco").replica_id is None
    for bad in ("R0", "", "x" * 33, "-r", "r.0", 3, True):
        with pytest.raises(ConfigError, match="replica_id"):
            HycoConfig(replica_id=bad)


def test_a_resume_naming_another_replica_gets_unknown_session():
    import asyncio

    from test_serving_session_frames import resume, service, start

    from vllm_hyco.handoff.frames import decode_server_frame
    from vllm_hyco.serving.service import WireError

    async def scenario():
        svc = service()  # routing key "r7"
        s, frames = await svc.open(start(), owner="c1")
        sid = decode_server_frame(frames[0]).session_id
        key, rand = sid.split(".")
        svc.table._by_sid["r8." + rand] = s  # even a table that held it under a foreign prefix answers no
        for forged in ("r8." + rand, key + "." + "0" * len(rand)):
            with pytest.raises(WireError) as e:
                await svc.resume(resume(forged, -1), owner="c2")
            assert (e.value.code, e.value.fatal) == ("unknown_session", True)
        s2, _ = await svc.resume(resume(sid, -1), owner="c3")
        assert s2 is s

    asyncio.run(scenario())
