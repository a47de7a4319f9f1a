"""A HyCo engine checks its CPU KV layout at startup, not at the first phone round.

On an AMX host in bf16, vLLM's CPU attention picks its ``amx`` KV layout, which the plugin has never verified
(``kv_view.VERIFIED_CPU_ISAS``). The runner builds every layer's KV view when it sets up the KV cache, so
such a server stops before serving anything, with a message that says what to do. The test makes this
host's layout unverified and asserts that building the engine fails with that message.
"""

from __future__ import annotations

import pytest


def test_an_unverified_cpu_kv_layout_stops_the_engine_at_startup(fixtures_dir, make_llm, monkeypatch):
    from vllm.platforms import current_platform

    from vllm_hyco.vllm_adapter.worker import kv_view

    if not current_platform.is_cpu():
        pytest.skip("the CPU_ATTN KV view is the CPU build's")
    monkeypatch.setattr(kv_view, "VERIFIED_CPU_ISAS", ())
    with pytest.raises(Exception, match="was never verified by vllm_hyco") as err:
        make_llm(fixtures_dir / "verifier", max_num_seqs=2, speculative_config={"method": "hyco"})
    assert "--dtype float32" in str(err.value)
