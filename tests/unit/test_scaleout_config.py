"""Issue 17 items 1 and 4 without vLLM: the topologies a HyCo server refuses say why and what to use instead,
``replica_id`` is validated, and session ids name their replica (``vllm_hyco.handoff.session_id``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hyco.config import HycoConfig
from vllm_hyco.errors import ConfigError
from vllm_hyco.handoff.session_id import new_session_id, owned_by, replica_of, routing_key
from vllm_hyco.vllm_adapter.expansion import REFUSALS, expand_engine_args


def _args(**overrides):
    base = dict(speculative_config="hyco", tensor_parallel_size=1, pipeline_parallel_size=1,
                data_parallel_size=1, _api_process_count=1, async_scheduling=None, scheduler_cls=None,
                worker_cls="auto", additional_config={})
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("overrides, flag, why, instead", [
    (dict(tensor_parallel_size=2), "--tensor-parallel-size 2", "KV head", "replicas behind a proxy"),
    (dict(pipeline_parallel_size=2), "--pipeline-parallel-size 2", "every layer", "replicas behind a proxy"),
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
    assert set(REFUSALS) == {"--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size",
                             "--api-server-count", "--async-scheduling"}
    assert all(why and instead for why, instead in REFUSALS.values())


def test_replica_id_is_validated_and_kept():
    cfg = HycoConfig.parse('{"method": "hyco", "replica_id": "eu-1"}')
    assert cfg.replica_id == "eu-1" and HycoConfig.from_dict(cfg.to_dict()) == cfg
    assert HycoConfig.parse("hyco").replica_id is None
    for bad in ("R0", "", "toolong", "-r", "r.0", 3, True):
        with pytest.raises(ConfigError, match="replica_id"):
            HycoConfig(replica_id=bad)


@pytest.mark.parametrize("replica", ["r", "r0", "eu-1", "abcdef"])
def test_session_ids_name_their_replica(replica):
    ids = {new_session_id(replica) for _ in range(200)}
    assert len(ids) == 200 and all(len(s) == 16 for s in ids)
    for sid in ids:
        assert replica_of(sid) == replica and routing_key(sid) == sid.decode()
        assert owned_by(sid, replica) and owned_by(sid, None) and not owned_by(sid, replica + "x")


def test_legacy_ids_name_no_replica():
    sid = new_session_id(None)
    assert len(sid) == 16 and owned_by(sid, None) and not owned_by(sid, "r0")
    assert replica_of(b"r0.not random!!!") is None  # only letters and digits after the dot
    assert routing_key(b"\xff" * 16) == "ff" * 16
