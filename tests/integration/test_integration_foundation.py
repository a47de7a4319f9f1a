"""The foundation inside a real vLLM 0.32 engine (CPU, fp32, eager, in-process) on the tiny fixtures.

Plain greedy decoding is the reference. vLLM's built-in MTP with the fixture's gemma4_assistant head (the
baseline later work compares against) and a ``--speculative-config hyco`` engine (NullProposer: no MTP
head runs) must produce exactly the same tokens.
"""

from __future__ import annotations

import pytest

PROMPTS = ["def hello(world):", "In the beginning God created", "import os\nimport sys\n",
           "The quick brown fox"]
MAX_TOKENS = 32


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _spec_counters(llm) -> dict[str, float]:
    return {m.name: getattr(m, "value", 0) for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode")}


@pytest.fixture(scope="module")
def reference(fixtures_dir):
    from conftest import _LLMFactory

    factory = _LLMFactory()
    try:
        return _greedy(factory(fixtures_dir / "verifier"))
    finally:
        factory.close_all()


def test_reference_is_well_formed(reference):
    assert len(reference) == len(PROMPTS) and all(len(toks) == MAX_TOKENS for toks in reference)


def test_builtin_mtp_equals_plain_greedy(fixtures_dir, reference, make_llm):
    llm = make_llm(fixtures_dir / "verifier", disable_log_stats=False,
                   speculative_config={"method": "mtp", "model": str(fixtures_dir / "assistant"),
                                       "num_speculative_tokens": 4})
    assert llm.llm_engine.vllm_config.speculative_config.method == "mtp"
    assert _greedy(llm) == reference
    counters = _spec_counters(llm)
    assert counters.get("vllm:spec_decode_num_draft_tokens", 0) > 0  # the MTP head really drafted


def test_hyco_engine_equals_plain_greedy_and_runs_no_head(fixtures_dir, reference, make_llm):
    from vllm_hyco.config import HycoConfig
    from vllm_hyco.vllm_adapter import CPU_WORKER, NULL_PROPOSER, SCHEDULER

    llm = make_llm(fixtures_dir / "verifier", disable_log_stats=False,
                   speculative_config={"method": "hyco", "node_budget": 32})
    vc = llm.llm_engine.vllm_config
    assert (vc.speculative_config.method, vc.speculative_config.model) == ("custom_class", NULL_PROPOSER)
    assert vc.speculative_config.num_speculative_tokens == 32
    assert (vc.scheduler_config.scheduler_cls, vc.parallel_config.worker_cls) == (SCHEDULER, CPU_WORKER)
    assert not vc.scheduler_config.async_scheduling
    assert HycoConfig.from_vllm_config(vc) == HycoConfig()
    core = llm.llm_engine.engine_core.engine_core  # in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    assert type(core.scheduler).__name__ == "HycoScheduler" and core.scheduler.hyco.config == HycoConfig()
    runner = core.model_executor.driver_worker.worker.model_runner
    assert type(runner).__name__ == "HycoCPUModelRunner"
    assert _greedy(llm) == reference
    assert _spec_counters(llm).get("vllm:spec_decode_num_draft_tokens", 0) == 0  # nothing drafted server-side


def test_api_server_without_plugin_env_is_refused(fixtures_dir, monkeypatch):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from vllm_hyco.errors import ConfigError

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    args = AsyncEngineArgs(model=str(fixtures_dir / "verifier"), speculative_config="hyco")
    with pytest.raises(ConfigError, match="VLLM_PLUGINS=hyco"):
        args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


@pytest.mark.parametrize("extra, needle", [({"pipeline_parallel_size": 2}, "--pipeline-parallel-size"),
                                           ({"decode_context_parallel_size": 2}, "--decode-context-parallel-size"),
                                           ({"async_scheduling": True}, "--async-scheduling")])
def test_unsupported_topology_refused_through_vllm(fixtures_dir, extra, needle):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_hyco.errors import ConfigError

    args = EngineArgs(model=str(fixtures_dir / "verifier"), speculative_config={"method": "hyco"}, **extra)
    with pytest.raises(ConfigError, match=needle):
        args.create_engine_config()


def test_agreeing_pair_accepts_every_mtp_draft(agree_fixtures_dir, make_llm):
    """The --agree fixtures are plumbing only: verifier and head both always predict id 0."""
    llm = make_llm(agree_fixtures_dir / "verifier", disable_log_stats=False,
                   speculative_config={"method": "mtp", "model": str(agree_fixtures_dir / "assistant"),
                                       "num_speculative_tokens": 4})
    assert all(toks == [0] * MAX_TOKENS for toks in _greedy(llm))
    counters = _spec_counters(llm)
    drafted = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    assert drafted > 0 and counters.get("vllm:spec_decode_num_accepted_tokens", 0) == drafted
