"""Ordinary requests' MTP on a hyco server: the vLLM keys passed through, the ones refused by name, the
drafter checked against the verifier's family, all at startup (no engine; the engine side is
tests/integration/test_engine_ordinary_mtp.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vllm_hyco.config import VLLM_KEYS, VLLM_REFUSED_KEYS, HycoConfig
from vllm_hyco.errors import ConfigError
from vllm_hyco.vllm_adapter import NULL_PROPOSER
from vllm_hyco.vllm_adapter.api_server.expansion import expand_engine_args, spec_slots
from vllm_hyco.vllm_adapter.engine_core.ordinary_mtp import mtp_lookup


def _args(tmp_path, spec, *, drafter_type="gemma4_assistant"):
    verifier, drafter = tmp_path / "verifier", tmp_path / "assistant"
    for folder, kind in ((verifier, "gemma4_text"), (drafter, drafter_type)):
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"model_type": kind}))
    spec = {"method": "hyco", **{k: (str(drafter) if v == "DRAFTER" else v) for k, v in spec.items()}}
    return SimpleNamespace(model=str(verifier), speculative_config=spec, tensor_parallel_size=1,
                           pipeline_parallel_size=1, data_parallel_size=1, _api_process_count=1,
                           async_scheduling=None, scheduler_cls=None, worker_cls="auto", additional_config={})


def test_the_one_word_switch_keeps_vllm_mtp_for_ordinary_requests(tmp_path):
    args = _args(tmp_path, {"model": "DRAFTER", "num_speculative_tokens": 4, "draft_sample_method": "probabilistic"})
    cfg = expand_engine_args(args, is_cpu=True)
    assert args.speculative_config == {"method": "mtp", "model": cfg.model, "num_speculative_tokens": 32,
                                       "draft_sample_method": "probabilistic"}
    assert (cfg.mtp_depth, cfg.node_budget, spec_slots(cfg)) == (4, 32, 32)
    assert "ordinary requests: vLLM's MTP, K 4" in cfg.describe()


def test_spec_slots_cover_the_deeper_of_tree_and_chain():
    assert spec_slots(HycoConfig(node_budget=2, model="m", num_speculative_tokens=6)) == 6
    assert spec_slots(HycoConfig(node_budget=8, model="m", num_speculative_tokens=6, ordinary_mtp=False)) == 8


def test_without_model_ordinary_requests_are_not_speculated_and_the_log_says_so(tmp_path, caplog, monkeypatch):
    import logging

    caplog.set_level("INFO", logger="vllm.hyco")
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    args = _args(tmp_path, {})
    expand_engine_args(args, is_cpu=True)
    assert args.speculative_config["model"] == NULL_PROPOSER
    assert any("will NOT be speculated" in r.getMessage() for r in caplog.records)
    args = _args(tmp_path, {"model": "DRAFTER", "num_speculative_tokens": 4, "ordinary_mtp": False})
    assert expand_engine_args(args, is_cpu=True).mtp_depth == 0
    assert args.speculative_config["method"] == "custom_class"


@pytest.mark.parametrize("key", VLLM_REFUSED_KEYS)
def test_vllm_keys_not_passed_through_are_refused_by_name(key):
    with pytest.raises(ConfigError) as err:
        HycoConfig.from_dict({"model": "m", "num_speculative_tokens": 4, key: 1})
    assert f"'{key}'" in str(err.value) and "num_speculative_tokens" in str(err.value)


def test_every_vllm_speculative_option_is_passed_or_refused_by_name():
    """A vLLM upgrade that adds an option fails here: decide whether a hyco server passes it through."""
    from vllm.config import SpeculativeConfig

    fields = set(SpeculativeConfig.__dataclass_fields__)
    assert set(VLLM_KEYS) | set(VLLM_REFUSED_KEYS) | {"method"} == fields
    assert not set(VLLM_KEYS) & set(VLLM_REFUSED_KEYS)


@pytest.mark.parametrize("spec, needle", [
    ({"model": "m"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 4}, "needs \"model\""),
    ({"draft_sample_method": "greedy"}, "needs \"model\""),
    ({"model": "m", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"model": "m", "num_speculative_tokens": 33}, "[1, 32]"),
    ({"model": "m", "num_speculative_tokens": 4, "draft_sample_method": "top"}, "'greedy', 'probabilistic'"),
    ({"model": "m", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[2, 8, 2]]}, "from 1"),
    ({"model": "m", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 8, 5]]}, "[0,"),
    ({"model": "m", "num_speculative_tokens": 4, "ordinary_mtp": "yes"}, "ordinary_mtp"),
    ({"model": "", "num_speculative_tokens": 4}, "model=''"),
])
def test_bad_vllm_keys_refused_at_startup_with_what_to_use(spec, needle):
    with pytest.raises(ConfigError) as err:
        HycoConfig.from_dict(spec)
    assert needle in str(err.value)


def test_a_model_that_is_not_an_mtp_drafter_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        expand_engine_args(_args(tmp_path, {"model": "DRAFTER", "num_speculative_tokens": 4},
                                 drafter_type="gemma4_text"), is_cpu=True)
    assert "not an MTP drafter" in str(err.value) and "gemma4_assistant" in str(err.value)
    with pytest.raises(ConfigError) as err:
        expand_engine_args(_args(tmp_path, {"model": str(tmp_path / "nowhere"), "num_speculative_tokens": 4}),
                           is_cpu=True)
    assert "no MTP drafter checkpoint there" in str(err.value)


def test_per_batch_size_k_round_trips_and_becomes_the_lookup():
    cfg = HycoConfig.parse(json.dumps({"method": "hyco", "model": "m", "num_speculative_tokens": 4,
                                       "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 16, 2]]}))
    assert HycoConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert mtp_lookup(cfg, 4) == [0, 4, 4, 2, 2]


def test_server_mode_options():
    assert HycoConfig().server_mode == "allow" and HycoConfig(max_sessions=8).server_session_cap == 8
    assert HycoConfig(max_server_sessions=2).server_session_cap == 2
    for spec, needle in (({"server_mode": "sometimes"}, "'allow', 'forbid'"), ({"max_server_sessions": 0}, "[1,")):
        with pytest.raises(ConfigError) as err:
            HycoConfig.from_dict(spec)
        assert needle in str(err.value)


def test_a_verifier_no_family_serves_is_refused_before_vllm_builds_the_engine(tmp_path):
    args = _args(tmp_path, {})
    (tmp_path / "verifier" / "config.json").write_text(json.dumps({"model_type": "glm4_moe"}))
    with pytest.raises(ConfigError) as err:
        expand_engine_args(args, is_cpu=True)
    assert "'glm4_moe'" in str(err.value) and "gemma4" in str(err.value) and "deepseek_v3" in str(err.value)


def test_an_mla_family_runs_on_cpu_mla_and_is_refused_on_gpu(tmp_path):
    """DeepSeek-V3 (MLA): the CPU build's reference CPU_MLA backend, which HyCo overrides (an AMX host would
    pick AMX_MLA unless told); another backend asked for is refused, and so is a GPU engine."""
    def mla_args():
        args = _args(tmp_path, {})
        (tmp_path / "verifier" / "config.json").write_text(json.dumps(
            {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 8, "num_nextn_predict_layers": 1}))
        return args

    args = mla_args()
    expand_engine_args(args, is_cpu=True)
    assert args.attention_backend == "CPU_MLA"
    args = mla_args()
    args.attention_config = {"backend": "CPU_MLA"}  # vLLM refuses both flags: the expansion adds none
    args.attention_backend = None
    expand_engine_args(args, is_cpu=True)
    assert args.attention_backend is None
    for is_cpu, backend, words in ((False, None, "CPU build only"), (True, "AMX_MLA", "remove --attention-backend")):
        args = mla_args()
        args.attention_backend = backend
        with pytest.raises(ConfigError, match=words):
            expand_engine_args(args, is_cpu=is_cpu)
