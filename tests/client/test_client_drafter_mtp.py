"""MTP Drafter parity (real: float torch on CPU, no device).

Reference: transformers' ``Gemma4AssistantForCausalLM`` on the same random HF-layout weights, with the
position convention mapped to vLLM's proposer (docs/decisions.md D1): HF defaults the query to position t, vLLM
(and we) use t - 1, so the reference is called with ``position_ids = t - 1``; HF applies no final soft-cap
while vLLM's LogitsProcessor does, so the reference logits are soft-capped here (argmax is unchanged).
K/V handed to the reference are cut to each layer's window; the drafter keeps the full ring and must mask
to the same window itself. A full vLLM proposer run is not used here (it needs a whole target engine);
the integration tier owns that.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tolerances import tol

from mobile_client.drafters.mtp import EmbedLut, MtpDrafter, MtpHead, dequantize_rows, torch_step
from mobile_client.drafters.spec import FULL, SLIDING, mtp_hf_config, random_mtp_state_dict, toy_mtp_spec

transformers = pytest.importorskip("transformers")

W = 32  # ring columns of the toy twin (the phone uses 1,024); sliding window 16


@pytest.fixture(scope="module")
def toy():
    spec = toy_mtp_spec()
    sd = random_mtp_state_dict(spec, seed=1)
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    cfg = mtp_hf_config(spec)
    hf = Gemma4AssistantForCausalLM(
        Gemma4AssistantConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    )
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    hf.eval()
    g = torch.Generator().manual_seed(7)
    target_embed = torch.randn(spec.vocab, spec.backbone, generator=g)  # the verifier's embed_tokens
    return spec, sd, hf, target_embed


def _kv(spec, n, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        kind: (
            torch.randn(n, a.kv_heads, a.head_dim, generator=g),
            torch.randn(n, a.kv_heads, a.head_dim, generator=g),
        )
        for kind, a in spec.attn.items()
    }


def _hf_step(hf, spec, z, kv, t, window):
    """Reference step: K/V of positions [max(0, t - w), t) per layer, query at t - 1."""
    shared = {}
    for kind in (SLIDING, FULL):
        w = min(window, spec.sliding_window) if kind == SLIDING else window
        k, v = kv[kind]
        lo = max(0, t - w)
        shared[kind] = (k[lo:t].permute(1, 0, 2)[None], v[lo:t].permute(1, 0, 2)[None])
    with torch.no_grad():
        out = hf(
            inputs_embeds=z.reshape(1, 1, -1), position_ids=torch.tensor([[t - 1]]), shared_kv_states=shared
        )
    logits = torch.tanh(out.logits[0, 0] / spec.softcap) * spec.softcap
    return logits, out.last_hidden_state[0, 0]


def _drafter(spec, sd, target_embed, keep, bits=None):
    head = MtpHead.from_hf_state_dict(spec, sd, keep)
    return MtpDrafter(
        spec, keep, EmbedLut.from_embedding(target_embed, keep, bits=bits), torch_step(head), window=W
    )


@pytest.mark.parametrize("t", [1, 5, 16, 17, 32, 45])
def test_mtp_step_matches_transformers(toy, t):
    spec, sd, hf, emb = toy
    keep = list(range(spec.vocab))
    kv = _kv(spec, t, seed=t)
    drafter = _drafter(spec, sd, emb, keep)
    drafter.apply_handoff(t, 0, {k: (a.numpy(), b.numpy()) for k, (a, b) in kv.items()})
    z = torch.randn(2 * spec.backbone, generator=torch.Generator().manual_seed(100 + t))
    logits, h = drafter.step(drafter.feeds(z.numpy()))
    ref_logits, ref_h = _hf_step(hf, spec, z, kv, t, W)
    torch.testing.assert_close(
        torch.from_numpy(logits[0]),
        ref_logits,
        **tol("mtp_step", torch.float32),
        msg=lambda m: f"t={t} W={W}: {m}",
    )
    torch.testing.assert_close(torch.from_numpy(h[0]), ref_h, **tol("mtp_step", torch.float32))


def test_mtp_chain_equals_reference_chain(toy):
    """K = 4 greedy steps with the runner-up at steps <= 2; keep set restricts the output; float LUT."""
    spec, sd, hf, emb = toy
    keep = sorted(set(range(0, spec.vocab, 2)) | {1, 3, 5})
    t = 20
    kv = _kv(spec, t, seed=3)
    drafter = _drafter(spec, sd, emb, keep)
    drafter.apply_handoff(t, 0, {k: (a.numpy(), b.numpy()) for k, (a, b) in kv.items()})
    x_hat = torch.cat([emb[11] * math.sqrt(spec.backbone), torch.randn(spec.backbone)])
    draft = drafter.draft(x_hat.numpy())

    keep_t = torch.tensor(keep)
    z, chain, runners = x_hat, [], []
    for step in range(4):
        logits, h = _hf_step(hf, spec, z, kv, t, W)
        o = logits[keep_t]
        top = torch.topk(o, 2).indices
        chain.append(keep[int(top[0])])
        if step < 2:
            runners.append(keep[int(top[1])])
        z = torch.cat([emb[chain[-1]] * math.sqrt(spec.backbone), h])
    assert draft.chain == chain
    assert draft.runner_ups == runners
    assert all(c in set(keep) for c in draft.chain + draft.runner_ups)


def test_mtp_incremental_handoffs_equal_one_shot(toy):
    """Rings filled round by round (wrapping past W) equal a ring filled once with the last W rows."""
    spec, sd, _, emb = toy
    keep = list(range(spec.vocab))
    t_end = 50
    kv = _kv(spec, t_end, seed=5)
    a = _drafter(spec, sd, emb, keep)
    b = _drafter(spec, sd, emb, keep)
    a.apply_handoff(20, 0, {k: (x[:20].numpy(), y[:20].numpy()) for k, (x, y) in kv.items()})
    for lo, hi in ((20, 23), (23, 31), (31, 50)):
        a.apply_handoff(hi, lo, {k: (x[lo:hi].numpy(), y[lo:hi].numpy()) for k, (x, y) in kv.items()})
    b.apply_handoff(t_end, 0, {k: (x.numpy(), y.numpy()) for k, (x, y) in kv.items()})
    z = np.random.default_rng(0).standard_normal(2 * spec.backbone).astype(np.float32)
    fa, fb = a.feeds(z), b.feeds(z)
    for name in ("mask_sliding", "mask_full"):
        np.testing.assert_array_equal(fa[name], fb[name])
    assert fa["mask_full"].sum() == W and fa["mask_sliding"].sum() == spec.sliding_window
    np.testing.assert_allclose(a.step(fa)[0], b.step(fb)[0], rtol=0, atol=0)
    assert a.draft(z).chain == b.draft(z).chain


def test_mtp_new_request_clears_ring(toy):
    spec, sd, _, emb = toy
    d = _drafter(spec, sd, emb, list(range(spec.vocab)))
    kv = _kv(spec, 10, seed=9)
    d.apply_handoff(10, 0, {k: (x.numpy(), y.numpy()) for k, (x, y) in kv.items()})
    d.apply_handoff(4, 0, {k: (x[:4].numpy(), y[:4].numpy()) for k, (x, y) in kv.items()})  # a != t0: new
    assert d.feeds(np.zeros(2 * spec.backbone, np.float32))["mask_full"].sum() == 4


def test_mtp_int8_rows_and_lut(toy):
    """8-bit wire rows (fixed per-channel scales) and the 8-bit LUT keep the chain on this fixture."""
    spec, sd, _, emb = toy
    keep = list(range(spec.vocab))
    t = 24
    kv = _kv(spec, t, seed=11)
    rows8 = {}
    for kind, (k, v) in kv.items():
        ks, vs = k.abs().amax(0) / 127, v.abs().amax(0) / 127  # [kvh, d] fixed per-channel scales
        kq, vq = torch.round(k / ks).to(torch.int8), torch.round(v / vs).to(torch.int8)
        rows8[kind] = (dequantize_rows(kq.numpy(), ks.numpy()), dequantize_rows(vq.numpy(), vs.numpy()))
    f = _drafter(spec, sd, emb, keep)
    q = _drafter(spec, sd, emb, keep, bits=8)
    f.apply_handoff(t, 0, {k: (a.numpy(), b.numpy()) for k, (a, b) in kv.items()})
    q.apply_handoff(t, 0, rows8)
    x_hat = np.concatenate([q.lut[42], np.random.default_rng(1).standard_normal(spec.backbone)]).astype(
        np.float32
    )
    assert q.lut.table.dtype == np.int8 and q.lut.nbytes == spec.vocab * spec.backbone + 4 * spec.vocab
    lf, lq = f.step(f.feeds(x_hat))[0], q.step(q.feeds(x_hat))[0]
    assert int(np.argmax(lf)) == int(np.argmax(lq))
    torch.testing.assert_close(
        torch.from_numpy(lq), torch.from_numpy(lf), **tol("mtp_step_int8_kv", torch.float32)
    )
    # later steps also read the 8-bit LUT; on random weights they may drift, so only the prefix is pinned
    assert f.draft(x_hat).chain[:2] == q.draft(x_hat).chain[:2]


def test_mtp_on_fixtures_matches_transformers_assistant(fixtures_dir):
    """On the project fixtures: inputs captured from the verifier (transformers, fp32: post-norm h, rotated
    K/V of its last sliding and last full layer), our head loaded from the assistant folder, chain and
    runner-ups equal to transformers' assistant run at position t - 1 on the same window (W = 128)."""
    from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM

    from mobile_client.quant.capture import head_from_dir, verifier_states

    verifier = AutoModelForCausalLM.from_pretrained(fixtures_dir / "verifier", dtype=torch.float32).eval()
    hf = Gemma4AssistantForCausalLM.from_pretrained(fixtures_dir / "assistant", dtype=torch.float32).eval()
    vocab = verifier.config.vocab_size
    keep = list(range(vocab))
    spec, head = head_from_dir(fixtures_dir / "assistant", keep)
    window = spec.sliding_window
    embed = verifier.get_input_embeddings().weight.detach().float()
    tokens = torch.randint(0, vocab, (window + 40,), generator=torch.Generator().manual_seed(0)).tolist()
    h, kv = verifier_states(verifier, tokens)
    drafter = MtpDrafter(
        spec, keep, EmbedLut.from_embedding(embed, keep, bits=None), torch_step(head), window=window
    )
    for t in (3, window // 2, window + 40 - 1):
        lo = max(0, t - window)
        drafter.t0 = -1
        drafter.apply_handoff(t, lo, {k: (a[lo:t], b[lo:t]) for k, (a, b) in kv.items()})
        x_hat = torch.cat([embed[tokens[t]] * math.sqrt(spec.backbone), torch.from_numpy(h[t - 1])])
        draft = drafter.draft(x_hat.numpy())
        ref_kv = {k: (torch.from_numpy(a), torch.from_numpy(b)) for k, (a, b) in kv.items()}
        z, chain, runners = x_hat, [], []
        for step in range(4):
            logits, hh = _hf_step(hf, spec, z, ref_kv, t, window)
            top = torch.topk(logits, 2).indices.tolist()
            chain.append(top[0])
            runners += [top[1]] if step < 2 else []
            z = torch.cat([embed[top[0]] * math.sqrt(spec.backbone), hh])
        assert (draft.chain, draft.runner_ups) == (chain, runners), t
