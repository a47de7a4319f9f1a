"""SLM Drafter parity (real: float torch on CPU).

Reference: transformers' ``Gemma4ForCausalLM`` forward over a causal chain, on the same random HF-layout
weights of an E2B-shaped toy (per-layer embeddings, KV-shared trailing layers with double-wide MLPs,
sliding + full layers). Our drafter prefills in 32-row chunks through its rings (full-layer ring W, sliding
ring W/2 = the sliding window, so the sliding ring wraps) and then runs 32 rows; logits over the keep set
must equal the reference's (soft-capped, same columns) at every position, as long as the context fits the
full-layer ring (the ring truncates full attention to W tokens by design, paper section 3.4).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import tol

from mobile_client.drafters.slm import SlmDrafter
from mobile_client.drafters.spec import random_slm_state_dict, slm_hf_config, toy_slm_spec
from mobile_client.tree import DraftTree, frontier_plan

pytest.importorskip("transformers")

W = 64


@pytest.fixture(scope="module")
def toy():
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    spec = toy_slm_spec(sliding_window=W // 2)  # the sliding ring (W/2 columns) wraps after 32 positions
    sd = random_slm_state_dict(spec, seed=4)
    cfg = slm_hf_config(spec)
    hf = Gemma4ForCausalLM(
        Gemma4TextConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    )
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    return spec, sd, hf.eval()


def _hf_logits(hf, spec, tokens, keep):
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([tokens])).logits[0]  # already soft-capped by Gemma4ForCausalLM
    return out[:, keep]


def _chain_plan(tokens):
    """A 'tree' that is a chain: root = tokens[0], each row the child of the previous one."""
    tree = DraftTree.make_dummy(list(tokens), [-1] + list(range(len(tokens) - 1)))
    return frontier_plan(tree, rows=range(len(tokens)))


@pytest.mark.parametrize("n_prefill", [0, 20, 31])  # contexts up to 63 <= W tokens
def test_slm_chain_matches_transformers(toy, n_prefill):
    spec, sd, hf = toy
    keep = list(range(0, spec.vocab, 3))
    tokens = torch.randint(
        0, spec.vocab, (n_prefill + 32,), generator=torch.Generator().manual_seed(n_prefill)
    ).tolist()
    d = SlmDrafter(spec, sd, keep, window=W)
    d.prefill(tokens[:n_prefill])
    assert d.committed == n_prefill
    out = d.forward_rows(_chain_plan(tokens[n_prefill:]))
    ref = _hf_logits(hf, spec, tokens, keep)[n_prefill:]
    ours = torch.from_numpy(out.logprobs)
    torch.testing.assert_close(
        ours,
        torch.log_softmax(ref.double(), -1),
        **tol("slm_logits", torch.float32),
        msg=lambda m: f"n_prefill={n_prefill}: {m}",
    )
    np.testing.assert_array_equal(out.ids, keep)


def test_slm_catch_up_rows_and_accept_move_kv(toy):
    """Round 1: root + chain; accept root and 2 path rows (Alg. 1 line 10); round 2: the rest of the
    path as catch-up rows and a new root. Logits equal a plain causal forward over the committed text."""
    spec, sd, hf = toy
    keep = list(range(spec.vocab))
    tokens = torch.randint(0, spec.vocab, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    d = SlmDrafter(spec, sd, keep, window=W)
    d.prefill(tokens[:10])
    d.forward_rows(_chain_plan(tokens[10:15]))  # root tokens[10], chain tokens[11:15]
    assert d.accept([0, 1, 2]) == 3 and d.committed == 13
    # tokens[13] and tokens[14] were accepted without being committed -> catch-up; tokens[15] is the new root
    tree = DraftTree.make_dummy([tokens[15], tokens[16]], [-1, 0])
    out = d.forward_rows(frontier_plan(tree, catch_up=tokens[13:15]))
    assert d.committed == 15  # catch-up rows are committed by the forward
    ref = _hf_logits(hf, spec, tokens[:17], keep)[13:17]
    torch.testing.assert_close(
        torch.from_numpy(out.logprobs),
        torch.log_softmax(ref.double(), -1),
        **tol("slm_logits", torch.float32),
    )


def test_slm_tree_rows_see_only_ancestors(toy):
    """Two siblings under the root get the same logits as two separate chains."""
    spec, sd, _ = toy
    keep = list(range(spec.vocab))
    d = SlmDrafter(spec, sd, keep, window=W)
    d.prefill([5, 6, 7, 8])
    tree = DraftTree.make_dummy([9, 100, 200, 300], [-1, 0, 0, 1])
    out = d.forward_rows(frontier_plan(tree, rows=range(4)))
    d2 = SlmDrafter(spec, sd, keep, window=W)
    d2.prefill([5, 6, 7, 8])
    ref = d2.forward_rows(_chain_plan([9, 200]))
    np.testing.assert_allclose(out.logprobs[2], ref.logprobs[1], atol=1e-5)


def test_slm_on_fixtures_matches_transformers(fixtures_dir):
    """The project's E2B-shaped SLM fixture (PLE, KV sharing, double-wide MLP, V != K): 150 committed tokens
    (the sliding ring, W/2 = the fixture's window 128, wraps), then 32 chain rows."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mobile_client.drafters.spec import SlmSpec

    folder = fixtures_dir / "slm"
    spec = SlmSpec.from_hf_config(json.loads((folder / "config.json").read_text()))
    sd = {k: v.float() for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    keep = list(range(0, spec.vocab, 2))
    tokens = torch.randint(0, spec.vocab, (182,), generator=torch.Generator().manual_seed(1)).tolist()
    d = SlmDrafter(spec, sd, keep, window=2 * spec.sliding_window)
    d.prefill(tokens[:150])
    out = d.forward_rows(_chain_plan(tokens[150:]))
    ref = _hf_logits(hf, spec, tokens, keep)[150:]
    torch.testing.assert_close(
        torch.from_numpy(out.logprobs),
        torch.log_softmax(ref.double(), -1),
        **tol("slm_logits", torch.float32),
    )
