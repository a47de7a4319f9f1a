"""MTP Drafter vs vLLM's own Gemma-4 MTP proposer (docs/decisions.md D1's parity reference). SLOW, not CI.

vLLM 0.32 (CPU build, fp32, eager, in-process) generates greedily from the fixture verifier with the fixture
assistant as its MTP head (k = 4); every ``Gemma4Proposer.propose`` call is recorded: the bonus token, the
query position P (the last committed row) and the 4 drafted ids. For each call our drafter gets the same
inputs a hand-off would carry: rows of positions [0, P + 1) of the verifier's last sliding and last full
layer and ``[e(bonus) * sqrt(H) ; h_P]``, captured with transformers' fp32 verifier on the same tokens (its
greedy output equals vLLM's in fp32, docs/vllm-notes.md §7). Contexts run past the sliding window (128).
The chains must be equal (the numerics of two fp32 engines differ in the last bits, so a near-tie could
flip; the test reports the share if one does). Measured on the shipped (issue-18) family: 39/39 proposer
calls equal, contexts up to 163 tokens, about 40 s on this box (vLLM import and engine start dominate).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow


def test_mtp_chain_equals_vllm_gemma4_proposer(fixtures_dir, make_llm):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.v1.spec_decode.gemma4 import Gemma4Proposer

    from mobile_client.drafters.mtp import EmbedLut, MtpDrafter, torch_step
    from mobile_client.quant.capture import head_from_dir, verifier_states

    calls = []
    original = Gemma4Proposer.propose

    def recording(
        self,
        num_speculative_tokens,
        target_token_ids,
        target_positions,
        target_hidden_states,
        next_token_ids,
        token_indices_to_sample,
        common_attn_metadata,
        *args,
        **kwargs,
    ):
        out = original(
            self,
            num_speculative_tokens,
            target_token_ids,
            target_positions,
            target_hidden_states,
            next_token_ids,
            token_indices_to_sample,
            common_attn_metadata,
            *args,
            **kwargs,
        )
        last = (
            int(common_attn_metadata.query_start_loc[1]) - 1
            if token_indices_to_sample is None
            else int(token_indices_to_sample[0])
        )
        calls.append((int(next_token_ids[0]), int(target_positions[last]), out[0].tolist()))
        return out

    Gemma4Proposer.propose = recording
    try:
        llm = make_llm(
            fixtures_dir / "verifier",
            speculative_config={
                "method": "mtp",
                "model": str(fixtures_dir / "assistant"),
                "num_speculative_tokens": 4,
            },
        )
        prompt = [2, 100, 200, 300, 400, 500]
        out = llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
        )
    finally:
        Gemma4Proposer.propose = original
    seq = prompt + list(out[0].outputs[0].token_ids)
    assert calls, "the MTP proposer never ran"

    verifier = AutoModelForCausalLM.from_pretrained(fixtures_dir / "verifier", dtype=torch.float32).eval()
    keep = list(range(verifier.config.vocab_size))
    spec, head = head_from_dir(fixtures_dir / "assistant", keep)
    embed = verifier.get_input_embeddings().weight.detach().float()
    h, kv = verifier_states(verifier, seq)
    drafter = MtpDrafter(
        spec, keep, EmbedLut.from_embedding(embed, keep, bits=None), torch_step(head), window=1024
    )
    same = 0
    calls = [c for c in calls if c[1] + 1 < len(seq)]  # the call after the last token drafts past the output
    for bonus, p, vllm_draft in calls:
        assert seq[p + 1] == bonus, (p, bonus, seq[p - 1 : p + 3])
        t = p + 1
        drafter.t0 = -1
        drafter.apply_handoff(t, 0, {k: (a[:t], b[:t]) for k, (a, b) in kv.items()})
        x_hat = np.concatenate([embed[bonus].numpy() * math.sqrt(spec.backbone), h[p]]).astype(np.float32)
        same += drafter.draft(x_hat).chain == vllm_draft
    assert same == len(calls), f"{same}/{len(calls)} chains equal to vLLM's"
    assert max(p for _, p, _ in calls) > spec.sliding_window
