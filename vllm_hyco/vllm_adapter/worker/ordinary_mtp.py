"""Ordinary requests keep vLLM's MTP in a step that also verifies phone trees (worker process, vLLM 0.32).

With ``"model"`` in the hyco spec the runner holds vLLM's own MTP proposer (``self.drafter``; for Gemma 4
``Gemma4Proposer``) and rejection sampler, built by vLLM exactly as for ``"method": "mtp"``. A step with no
phone session in its batch runs vLLM's code unchanged. In a step with sessions, two things differ
(docs/engine.md, "Ordinary requests keep vLLM's MTP"):

* **Sampling** (:func:`sample_around_trees`). vLLM's ``_sample`` runs the rejection sampler once, on the
  ordinary requests' drafts only: every tree request enters it as a request with no drafts (its root row
  only, the bonus row of a draft-less request, as vLLM treats a prefill beside decodes), because vLLM's
  sampling metadata (penalties, logits processors, generators) is indexed by batch row and cannot be cut to
  a sub-batch. That root row's sample is overwritten by the tree's verdict, as before. The rejection
  sampler's output is then widened to the trees' width (:func:`widen`, logprobs rows too) so that the
  runner can write each tree's ``[path..., bonus]`` into its row.
* **Drafting** (:func:`propose`). vLLM's proposer would run its MTP forward over every row of the batch,
  33 rows per tree; a phone session must cost the server no head work. The runner computes vLLM's own
  next tokens and rejected counts for the whole batch (``prepare_next_token_ids_padded`` /
  ``prepare_inputs_padded``), cuts the inputs and the attention metadata to the ordinary requests' rows,
  and calls ``drafter.propose`` on that sub-batch; its drafts are scattered back (zeros for sessions, whose
  drafts the scheduler drops). The tree-attention override is off by then (the runner clears the step's
  trees before drafting), so the drafter's attention over the shared KV layers is vLLM's own.

Only synchronous scheduling (the expansion forces it), vLLM's padded drafter batch (its default) and text
inputs are handled here: in a step with sessions the drafter gets no multimodal embeddings, which can lower
an ordinary multimodal request's acceptance in that step, never its output (the verifier decides).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from vllm_hyco.vllm_adapter import surface


def session_rows(runner: Any, server_reqs: frozenset[str] = frozenset()) -> set[int]:
    """Batch rows of this step's phone-mode session requests (``extra_args["hyco"]``); a session in server
    mode (``SchedulerOutput.hyco_server_reqs``) is drafted as an ordinary request."""
    rows = set()
    for b, req_id in enumerate(runner.input_batch.req_ids):
        state = runner.requests.get(req_id)
        extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
        if isinstance(extra.get("hyco"), dict) and req_id not in server_reqs:
            rows.add(b)
    return rows


# -- sampling ---------------------------------------------------------------------------------------------------
def draft_rows(md: Any, trees: Iterable[int]) -> tuple[list[int], list[int], list[int]]:
    """For the full step metadata ``md`` and the tree requests' batch rows: (the logits rows the rejection
    sampler reads, each request's draft count there, the indices of the ordinary drafts in
    ``md.draft_token_ids``). A tree request keeps its root row only, with no draft.

    >>> from types import SimpleNamespace
    >>> draft_rows(SimpleNamespace(num_draft_tokens=[2, 3, 0]), trees={1})
    ([0, 1, 2, 3, 7], [2, 0, 0], [0, 1])
    """
    trees = set(trees)
    logits_rows, counts, drafts = [], [], []
    lo = d = 0
    for b, n in enumerate(md.num_draft_tokens):
        n = int(n)
        keep = 0 if b in trees else n
        logits_rows.extend(range(lo, lo + keep + 1))
        drafts.extend(range(d, d + keep))
        counts.append(keep)
        lo, d = lo + n + 1, d + n
    return logits_rows, counts, drafts


def sub_metadata(md: Any, counts: list[int], drafts: list[int]) -> Any:
    """vLLM's ``SpecDecodeMetadata`` for the kept rows (logits already cut to them, request after request)."""
    device = md.draft_token_ids.device
    n = torch.tensor(counts, dtype=torch.int32)
    cu_draft = n.cumsum(0).to(torch.int32)
    cu_sampled = (n + 1).cumsum(0).to(torch.int32)
    starts = cu_sampled - n - 1  # first kept row of each request
    target = torch.cat([torch.arange(int(s), int(s) + int(k), dtype=torch.int32) for s, k in zip(starts, n)]) \
        if counts else torch.zeros(0, dtype=torch.int32)
    return type(md)(
        draft_token_ids=md.draft_token_ids[torch.tensor(drafts, dtype=torch.long, device=device)],
        num_draft_tokens=list(counts), cu_num_draft_tokens=cu_draft.to(device),
        cu_num_sampled_tokens=cu_sampled.to(device), target_logits_indices=target.to(device),
        bonus_logits_indices=(cu_sampled - 1).to(device),
        logits_indices=torch.arange(int(cu_sampled[-1]), dtype=torch.int32, device=device))


def sample_around_trees(runner: Any, sample: Any, logits: torch.Tensor, md: Any, trees: Iterable[int]) -> Any:
    """vLLM's sampling for the step with each tree request cut to its root row: the rejection sampler on the
    ordinary drafts when there are any (``sample`` is vLLM's ``_sample``), else the plain sampler on one row
    per request. Returns vLLM's ``SamplerOutput`` ([num_reqs, 1 + most ordinary drafts])."""
    trees = set(trees)
    rows, counts, drafts = draft_rows(md, trees)
    keep = torch.tensor(rows, dtype=torch.long, device=logits.device)
    if not any(counts):
        return sample(logits[keep], None)
    sm = runner.input_batch.sampling_metadata
    saved = sm.spec_token_ids
    if saved is not None:  # penalties read each request's spec tokens: a tree request has none here
        sm.spec_token_ids = [[] if b in trees else s for b, s in enumerate(saved)]
    try:
        return sample(logits[keep], sub_metadata(md, counts, drafts))
    finally:
        sm.spec_token_ids = saved


def widen(output: Any, width: int, placeholder: int = -1) -> Any:
    """``SamplerOutput`` padded to ``width`` tokens per request: sampled ids with ``placeholder``, logprobs rows
    (request-major, one per token) with zeros, so vLLM's bookkeeping cuts both by the same valid mask."""
    ids = output.sampled_token_ids
    num_reqs, w0 = ids.shape
    if w0 >= width:
        return output
    out = ids.new_full((num_reqs, width), placeholder)
    out[:, :w0] = ids
    lp = output.logprobs_tensors
    if lp is not None:
        def pad(t: torch.Tensor) -> torch.Tensor:
            t = t.reshape(num_reqs, w0, *t.shape[1:])
            full = t.new_zeros((num_reqs, width, *t.shape[2:]))
            full[:, :w0] = t
            return full.reshape(num_reqs * width, *t.shape[2:])

        lp = lp._replace(logprob_token_ids=pad(lp.logprob_token_ids), logprobs=pad(lp.logprobs),
                         selected_token_ranks=pad(lp.selected_token_ranks), cu_num_generated_tokens=None)
    return dataclasses.replace(output, sampled_token_ids=out, logprobs_tensors=lp)


# -- drafting ---------------------------------------------------------------------------------------------------
def propose(runner: Any, scheduler_output: Any, sampled_token_ids: torch.Tensor, sampling_metadata: Any,
            hidden_states: torch.Tensor, spec_decode_metadata: Any, cad: Any, slot_mappings: Any,
            sessions: set[int]) -> torch.Tensor:
    """vLLM's MTP drafts for the step's ordinary requests, the sessions' rows left out of the drafter's forward.
    Returns ``[num_reqs, K]`` (zeros on session rows) and caches the drafter's probabilities by request id."""
    drafter = runner.drafter
    num_reqs = runner.input_batch.num_reqs
    k = int(scheduler_output.num_spec_tokens_to_schedule)
    ordinary = [b for b in range(num_reqs) if b not in sessions]
    surface.set_draft_probs(runner, None, None)
    if not ordinary:
        return torch.zeros((num_reqs, k), dtype=torch.int64, device=sampled_token_ids.device)
    next_ids, valid = drafter.prepare_next_token_ids_padded(sampled_token_ids, runner.requests, runner.input_batch,
                                                            runner.discard_request_mask.gpu)
    sample_at = rejected = None
    if spec_decode_metadata is not None:
        cad, sample_at, rejected = drafter.prepare_inputs_padded(cad, spec_decode_metadata, valid)
    qsl = cad.query_start_loc_cpu[:num_reqs + 1].to(torch.int64)
    pick = torch.tensor(ordinary, dtype=torch.long)
    lens = (qsl[1:] - qsl[:-1])[pick]
    rows_cpu = torch.cat([torch.arange(int(qsl[b]), int(qsl[b + 1])) for b in ordinary])
    sub_qsl_cpu = torch.zeros(len(ordinary) + 1, dtype=torch.int32)
    sub_qsl_cpu[1:] = lens.cumsum(0)
    device = next_ids.device
    pick_d, rows = pick.to(device), rows_cpu.to(device)
    sub_qsl = sub_qsl_cpu.to(device)
    sub_cad = _sub_attn_metadata(cad, pick_d, rows, sub_qsl, sub_qsl_cpu, int(lens.max()))
    if sample_at is not None:  # flattened-batch row -> the sub-batch's row
        sample_at = (sample_at[pick_d] - cad.query_start_loc[pick_d] + sub_qsl[:-1]).to(torch.int32)
    temperature = sampling_metadata.temperature
    sub_sampling = sampling_metadata if temperature is None else dataclasses.replace(
        sampling_metadata, temperature=temperature[pick_d])
    with surface.drafter_batch_rows(drafter, pick_d):
        drafts = drafter.propose(
            num_speculative_tokens=k, target_token_ids=runner.input_ids.gpu[rows],
            target_positions=surface.runner_positions(runner, rows), target_hidden_states=hidden_states[rows],
            next_token_ids=next_ids[pick_d], token_indices_to_sample=sample_at, common_attn_metadata=sub_cad,
            sampling_metadata=sub_sampling, mm_embed_inputs=None,
            num_rejected_tokens_gpu=None if rejected is None else rejected[pick_d], slot_mappings=slot_mappings)
    probs = drafter.take_last_draft_probs() if hasattr(drafter, "take_last_draft_probs") else None
    if probs is not None:
        surface.set_draft_probs(runner, probs, [runner.input_batch.req_ids[b] for b in ordinary])
    full = drafts.new_zeros((num_reqs, drafts.shape[1]))
    full[pick_d] = drafts
    return full


def _sub_attn_metadata(cad: Any, pick: torch.Tensor, rows: torch.Tensor, qsl: torch.Tensor, qsl_cpu: torch.Tensor,
                       max_query_len: int) -> Any:
    """vLLM's ``CommonAttentionMetadata`` cut to the requests ``pick`` (their token ``rows``)."""
    per_request = {name: value[pick.to(value.device)] for name in
                   ("seq_lens_cpu_upper_bound", "dcp_local_seq_lens", "dcp_local_seq_lens_cpu_upper_bound",
                    "is_prefilling") if (value := getattr(cad, name, None)) is not None}
    return dataclasses.replace(
        cad, query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, seq_lens=cad.seq_lens[pick], num_reqs=len(pick),
        num_actual_tokens=len(rows), max_query_len=max_query_len, block_table_tensor=cad.block_table_tensor[pick],
        slot_mapping=cad.slot_mapping[rows], positions=None if cad.positions is None else cad.positions[rows],
        logits_indices_padded=None, num_logits_indices=None, req_idx=None, **per_request)
