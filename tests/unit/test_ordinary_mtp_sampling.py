"""The pieces of ordinary requests' MTP in a step with trees (``worker/ordinary_mtp.py``), without an engine:
the rejection sampler's metadata cut to the ordinary drafts, and the sampler output widened to the trees'
width with its logprobs rows (the engine test is tests/integration/test_engine_ordinary_mtp.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_hyco.vllm_adapter.worker.ordinary_mtp import draft_rows, sub_metadata, widen


def _full_metadata(counts: list[int]):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    md = SpecDecodeMetadata.make_dummy([[100 * (b + 1) + j for j in range(n)] for b, n in enumerate(counts)], "cpu")
    return md


def test_tree_requests_enter_the_rejection_sampler_as_requests_with_no_draft():
    md = _full_metadata([2, 3, 0, 1])  # request 1 is a tree: its 3 "drafts" are tree rows
    rows, counts, drafts = draft_rows(md, trees={1})
    assert rows == [0, 1, 2, 3, 7, 8, 9] and counts == [2, 0, 0, 1]
    sub = sub_metadata(md, counts, drafts)
    assert sub.num_draft_tokens == [2, 0, 0, 1] and sub.max_spec_len == 2
    assert sub.draft_token_ids.tolist() == [100, 101, 400]  # the ordinary drafts only, in batch order
    # as vLLM's own metadata for these counts: drafts at their rows, each request's bonus after them
    assert sub.target_logits_indices.tolist() == [0, 1, 5]
    assert sub.bonus_logits_indices.tolist() == [2, 3, 4, 6]
    assert sub.cu_num_draft_tokens.tolist() == [2, 2, 2, 3]
    assert sub.cu_num_sampled_tokens.tolist() == [3, 4, 5, 7]


def test_widen_pads_samples_and_logprobs_rows_together():
    from vllm.v1.outputs import LogprobsTensors, SamplerOutput

    ids = torch.tensor([[5, 6], [7, -1]], dtype=torch.int32)
    lp = LogprobsTensors(logprob_token_ids=torch.arange(8).reshape(4, 2), logprobs=torch.ones(4, 2),
                         selected_token_ranks=torch.arange(4))
    out = widen(SamplerOutput(sampled_token_ids=ids, logprobs_tensors=lp), 4)
    assert out.sampled_token_ids.tolist() == [[5, 6, -1, -1], [7, -1, -1, -1]]
    wl = out.logprobs_tensors
    assert wl.logprob_token_ids.shape == (8, 2) and wl.selected_token_ranks.tolist() == [0, 1, 0, 0, 2, 3, 0, 0]
    valid = (out.sampled_token_ids != -1).flatten()
    assert wl.logprob_token_ids[valid].tolist() == [[0, 1], [2, 3], [4, 5]]  # what vLLM's parse_output keeps
    assert widen(out, 3) is out


def test_a_step_without_ordinary_drafts_keeps_one_row_per_request():
    rows, counts, drafts = draft_rows(SimpleNamespace(num_draft_tokens=[0, 32, 0]), trees={1})
    assert (rows, counts, drafts) == ([0, 1, 34], [0, 0, 0], [])
