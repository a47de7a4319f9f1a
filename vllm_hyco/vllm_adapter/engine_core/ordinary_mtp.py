"""Ordinary requests keep vLLM's MTP on a HyCo engine: the scheduler's side (engine-core process, vLLM 0.32).

vLLM has one ``num_speculative_tokens``. A HyCo engine sets it to its spec slots (``max(node_budget, K)``,
``api_server/expansion.py``, ``spec_slots``) so that a phone's tree of up to the node budget fits a request's
spec slots; ordinary requests must still be drafted K = the hyco option ``num_speculative_tokens`` deep,
which is what an MTP server with that K does. vLLM's own dynamic K carries it: the scheduler hands the runner
``num_spec_tokens_to_schedule`` every step from ``dynamic_sd_lookup`` (batch size -> K), the runner drafts
that many tokens, and a scheduler with a lookup does not pad decodes to ``1 + num_speculative_tokens``. So
:func:`install` gives the scheduler a lookup of K (or vLLM's per-batch-size schedule built against K), and
reserves K lookahead KV slots per request as an MTP server with that K does, not one per spec slot.

Trees do not go through the lookup: a session's tree is its spec tokens (``rounds.submit``), scheduled
whole. The drafts the proposer makes never reach a session (``HycoScheduler.update_draft_token_ids``), and
vLLM's spec-decode stats count ordinary requests only (:func:`drafted_by_vllm`): a tree round is not a
chain, and HyCo reports its rounds itself (``/metrics`` ``hyco_*``).
"""

from __future__ import annotations

from typing import Any

from vllm_hyco.config import HycoConfig
from vllm_hyco.vllm_adapter.engine_core.sessions import SessionState


def mtp_lookup(cfg: HycoConfig, max_num_seqs: int) -> list[int] | None:
    """Batch size -> K for ordinary requests (index 0 unused, as in vLLM); None when they are not drafted.

    >>> mtp_lookup(HycoConfig(model="a", num_speculative_tokens=3), 4)
    [3, 3, 3, 3, 3]
    >>> mtp_lookup(HycoConfig(model="a", num_speculative_tokens=3,
    ...                       num_speculative_tokens_per_batch_size=((1, 2, 3), (3, 8, 1))), 4)
    [0, 3, 3, 1, 1]
    >>> mtp_lookup(HycoConfig(), 4) is None
    True
    """
    if not cfg.drafts_ordinary:
        return None
    if cfg.num_speculative_tokens_per_batch_size is None:
        return [cfg.mtp_depth] * (max_num_seqs + 1)
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    return build_dynamic_sd_schedule_lookup([list(e) for e in cfg.num_speculative_tokens_per_batch_size],
                                            vllm_max_batch_size=max_num_seqs,
                                            vllm_num_speculative_tokens=cfg.mtp_depth)


def install(scheduler: Any, cfg: HycoConfig | None) -> None:
    """Draft K per step for ordinary requests and reserve K lookahead slots each (no change without ``model``)."""
    if cfg is None or not cfg.drafts_ordinary:
        return
    scheduler.dynamic_sd_lookup = mtp_lookup(cfg, scheduler.max_num_running_reqs)
    scheduler.num_lookahead_tokens = min(scheduler.num_lookahead_tokens, cfg.mtp_depth)


def drafted_by_vllm(scheduler: Any, req_id: str) -> bool:
    """Whether a request's MTP drafts are vLLM's (they reach it, and its spec-decode counters count them): an
    ordinary request's and a session's in server mode are; a session's tree is not."""
    s = scheduler.hyco.sessions.by_req(req_id)
    return s is None or s.state is SessionState.SERVER
