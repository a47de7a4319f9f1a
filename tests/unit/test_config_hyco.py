"""HycoConfig parsing and validation messages, the engine-argument expansion and its refusals (no engine)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vllm_hyco.config import ADDITIONAL_CONFIG_KEY, HycoConfig
from vllm_hyco.errors import ConfigError
from vllm_hyco.vllm_adapter import CPU_WORKER, GPU_WORKER, NULL_PROPOSER, SCHEDULER
from vllm_hyco.vllm_adapter.api_server.expansion import expand_engine_args, spec_slots


def test_bare_word_is_exact_default():
    cfg = HycoConfig.parse("hyco")
    assert cfg == HycoConfig() and cfg.exact and cfg.node_budget == 32 and cfg.epsilon is None


def test_json_form_carries_options():
    cfg = HycoConfig.parse('{"method": "hyco", "epsilon": 0.005, "node_budget": 16, "window": 1024, '
                           '"max_sessions": 4, "session_idle_timeout_s": 5, "max_session_tokens": 4096}')
    assert (cfg.epsilon, cfg.node_budget, cfg.window, cfg.max_sessions) == (0.005, 16, 1024, 4)
    assert not cfg.exact and spec_slots(cfg) == 16


def test_round_trip_through_dict_and_json():
    cfg = HycoConfig(epsilon=0.01, node_budget=8, window=128)
    assert HycoConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert HycoConfig.parse(cfg) is cfg and HycoConfig.parse(None) == HycoConfig()


def test_unknown_option_named_with_valid_list():
    with pytest.raises(ConfigError) as err:
        HycoConfig.parse({"method": "hyco", "node_budgt": 8})
    msg = str(err.value)
    assert "'node_budgt'" in msg and "node_budget" in msg and "epsilon" in msg and "window" in msg
    assert err.value.code == "bad_config"


@pytest.mark.parametrize("field, value, needle", [
    ("epsilon", 0.0, "(0, 1)"), ("epsilon", 1.0, "(0, 1)"), ("epsilon", -0.1, "(0, 1)"),
    ("epsilon", "0.1", "(0, 1)"), ("epsilon", True, "(0, 1)"), ("epsilon", float("nan"), "(0, 1)"),
    ("node_budget", 0, "[1, 32]"), ("node_budget", 33, "[1, 32]"), ("node_budget", 2.0, "[1, 32]"),
    ("window", 0, "[1,"), ("max_sessions", 0, "[1,"), ("session_idle_timeout_s", 0, "(0.0,"),
    ("max_session_tokens", 1, "[2,"), ("budget_policy", "dynamic", "'adaptive', 'static'"),
    ("budget_policy", None, "'adaptive', 'static'"), ("budget_floor", 0, "[1, 32]"), ("budget_floor", "K", "[1, 32]"),
])
def test_bad_values_name_field_and_range(field, value, needle):
    with pytest.raises(ConfigError) as err:
        HycoConfig.from_dict({field: value})
    assert field in str(err.value) and needle in str(err.value)


def test_other_methods_and_garbage_refused():
    with pytest.raises(ConfigError, match="not HyCo"):
        HycoConfig.from_dict({"method": "mtp"})
    with pytest.raises(ConfigError, match="neither 'hyco' nor valid JSON"):
        HycoConfig.parse("hyc0")
    with pytest.raises(ConfigError, match="JSON object"):
        HycoConfig.parse("[1, 2]")


@pytest.mark.parametrize("value, expected", [
    ("hyco", True), (" hyco ", True), ('{"method": "hyco"}', True),
    ({"method": "hyco", "epsilon": 0.1}, True),
    (HycoConfig(), True), ('{"method": "mtp", "model": "x"}', False), ({"method": "ngram"}, False),
    (None, False), ("{not json", False), ("mtp", False),
])
def test_is_hyco(value, expected):
    assert HycoConfig.is_hyco(value) is expected


def test_from_vllm_config_reads_additional_config():
    cfg = HycoConfig(epsilon=0.005)
    vc = SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: cfg.to_dict(), "other": 1})
    assert HycoConfig.from_vllm_config(vc) == cfg
    assert HycoConfig.maybe_from_vllm_config(SimpleNamespace(additional_config={})) is None
    with pytest.raises(ConfigError, match="not started with --speculative-config hyco"):
        HycoConfig.from_vllm_config(SimpleNamespace(additional_config={}))


def _args(**overrides):
    base = dict(speculative_config="hyco", tensor_parallel_size=1, pipeline_parallel_size=1,
                data_parallel_size=1, _api_process_count=1, async_scheduling=None, scheduler_cls=None,
                worker_cls="auto", additional_config={"keep": 1})
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("is_cpu, worker", [(True, CPU_WORKER), (False, GPU_WORKER)])
def test_expansion_sets_engine_args(is_cpu, worker):
    args = _args(speculative_config={"method": "hyco", "node_budget": 8})
    cfg = expand_engine_args(args, is_cpu=is_cpu)
    assert args.speculative_config == {"method": "custom_class", "model": NULL_PROPOSER,
                                       "num_speculative_tokens": 8}
    assert (args.scheduler_cls, args.worker_cls, args.async_scheduling) == (SCHEDULER, worker, False)
    assert args.additional_config == {"keep": 1, ADDITIONAL_CONFIG_KEY: cfg.to_dict()}
    assert not HycoConfig.is_hyco(args.speculative_config)  # expanding twice is impossible


@pytest.mark.parametrize("overrides, needle", [
    (dict(pipeline_parallel_size=2), "--pipeline-parallel-size"),
    (dict(data_parallel_size=4), "--data-parallel-size"),
    (dict(_api_process_count=2), "--api-server-count"),
    (dict(async_scheduling=True), "--async-scheduling"),
    (dict(scheduler_cls="my.Scheduler"), "--scheduler-cls"),
    (dict(worker_cls="my.Worker"), "--worker-cls"),
])
def test_unsupported_topologies_refused(overrides, needle):
    with pytest.raises(ConfigError) as err:
        expand_engine_args(_args(**overrides), is_cpu=True)
    assert needle in str(err.value)


def test_lossy_mode_logged(caplog, monkeypatch):
    import logging

    caplog.set_level("INFO", logger="vllm.hyco")
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)  # vLLM's logging config turns it off
    expand_engine_args(_args(speculative_config={"method": "hyco", "epsilon": 0.005}), is_cpu=True)
    assert any("LOSSY" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    caplog.clear()
    expand_engine_args(_args(), is_cpu=True)
    assert not any("LOSSY" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_budget_policy_defaults_to_adaptive_and_round_trips():
    assert HycoConfig().budget_policy == "adaptive"
    cfg = HycoConfig.parse('{"method": "hyco", "budget_policy": "static", "node_budget": 8}')
    assert (cfg.budget_policy, cfg.node_budget) == ("static", 8)
    assert HycoConfig.from_dict(cfg.to_dict()) == cfg and "node_budget 8 (static)" in cfg.describe()


def test_budget_floor_reaches_the_policy_and_stays_under_the_budget():
    from vllm_hyco.vllm_adapter.engine_core.state import SchedulerState

    cfg = HycoConfig.parse('{"method": "hyco", "budget_floor": 4}')
    assert HycoConfig().budget_floor == 1 and HycoConfig.from_dict(cfg.to_dict()) == cfg
    assert "(adaptive, floor 4)" in cfg.describe()
    st = SchedulerState.create(cfg, num_kv_blocks=64, max_num_running_reqs=4, on_cpu=True)
    assert (st.budget_policy.floor, st.budget_policy.cap) == (4, 32)
    with pytest.raises(ConfigError, match="budget_floor=8 is above node_budget=4"):
        HycoConfig.from_dict({"budget_floor": 8, "node_budget": 4})
