"""Sampled drafts on the phone (``mobile_client.drafters.sampling``): the MTP chain drawn from the head's
quantized distribution, that distribution carried through the tree (plant, grow, trim, value order) onto the
tree frame's ``draft_q``, the session option that turns it on, and the bench configuration that uses it.

The MTP Drafter runs either the toy head (random weights, float torch) or a fixed-logits step (the drafter
samples host-side after ``step``, so any backend, compiled ones included, draws the same way).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from mobile_client.drafters.base import DraftContext, HybridDrafter
from mobile_client.drafters.mtp import EmbedLut, MtpDrafter, MtpHead, torch_step
from mobile_client.drafters.sampling import MAX_Q_ENTRIES, DraftSampling, draft_distribution, draw, session_rng
from mobile_client.drafters.slm import SlmDrafter
from mobile_client.drafters.spec import random_mtp_state_dict, random_slm_state_dict, toy_mtp_spec, toy_slm_spec
from mobile_client.session import PhoneSession, SessionOptions
from mobile_client.tree import DraftTree, plant_tree, trim, value_order
from vllm_hyco.errors import ConfigError
from vllm_hyco.handoff import TreeFrame
from vllm_hyco.handoff.client_frames import DraftQ
from vllm_hyco.handoff.frames import decode_client_frame, encode_frame

W = 64
MSPEC = toy_mtp_spec()
KEEP = sorted(set(range(0, MSPEC.vocab, 2)) | {1, 3})


def _kv(t: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal((t, a.kv_heads, a.head_dim)).astype(np.float32),
                rng.standard_normal((t, a.kv_heads, a.head_dim)).astype(np.float32))
            for k, a in MSPEC.attn.items()}


def _mtp(step=None) -> tuple[MtpDrafter, np.ndarray]:
    embed = torch.randn(MSPEC.vocab, MSPEC.backbone, generator=torch.Generator().manual_seed(0))
    step = step or torch_step(MtpHead.from_hf_state_dict(MSPEC, random_mtp_state_dict(MSPEC, seed=1), KEEP))
    mtp = MtpDrafter(MSPEC, KEEP, EmbedLut.from_embedding(embed, KEEP), step, window=W)
    mtp.apply_handoff(20, 0, _kv(20))
    rng = np.random.default_rng(5)
    x_hat = np.concatenate([mtp.lut[3], rng.standard_normal(MSPEC.backbone)]).astype(np.float32)
    return mtp, x_hat


def _fixed_step(logits: np.ndarray):
    """A step that always returns ``logits`` (so every chain step has the same distribution)."""
    def run(feeds):
        return logits[None].astype(np.float32), np.zeros((1, MSPEC.backbone), np.float32)
    return run


def _sampling(seed, temperature=1.0, top_k=0, top_p=1.0) -> DraftSampling:
    return DraftSampling(temperature, top_k, top_p, np.random.default_rng(seed))


# --- the quantized distribution ---
def test_distribution_is_cut_quantized_and_best_first():
    o = np.random.default_rng(0).standard_normal(300) * 3
    cols, w = draft_distribution(o, _sampling(0))
    assert len(cols) == MAX_Q_ENTRIES and w.dtype == np.uint16 and w.min() >= 1 and w[0] == 65535
    assert cols.tolist() == np.argsort(-o, kind="stable")[:MAX_Q_ENTRIES].tolist()
    assert np.all(np.diff(w.astype(int)) <= 0)
    cols8, _ = draft_distribution(o, _sampling(0, top_k=8))
    assert cols8.tolist() == cols[:8].tolist()
    ties = np.random.default_rng(1).integers(0, 5, size=300).astype(np.float32)  # ties go to the lower index
    for k in (1, 8, 64):
        assert draft_distribution(ties, _sampling(0, top_k=k))[0].tolist() == \
            np.argsort(-ties, kind="stable")[:k].tolist()
    # top-p: the smallest best-first prefix holding top_p of the (top-k cut) mass
    p = np.exp(np.sort(o)[::-1][:MAX_Q_ENTRIES] - o.max())
    p /= p.sum()
    colsp, _ = draft_distribution(o, _sampling(0, top_p=0.5))
    m = int(np.argmax(np.cumsum(p) >= 0.5)) + 1
    assert len(colsp) == m and colsp.tolist() == cols[:m].tolist()
    # a very low temperature leaves (almost) one token; the best one always stays
    cols_cold, w_cold = draft_distribution(o, _sampling(0, temperature=0.01, top_p=0.9))
    assert cols_cold.tolist() == [int(np.argmax(o))] and w_cold.tolist() == [65535]


def test_draws_follow_the_integer_weights():
    w = np.array([65535, 30000, 5000, 1, 700], np.uint16)
    n = 40000
    rng = np.random.default_rng(123)
    counts = np.bincount([draw(w, rng) for _ in range(n)], minlength=len(w))
    q = w / w.sum()
    sigma = np.sqrt(q * (1 - q) / n)
    assert np.all(np.abs(counts / n - q) <= 5 * sigma + 1e-4), (counts / n, q)


def test_drafter_samples_its_sent_q_over_many_seeds():
    """The chain token of each step is drawn from exactly the (ids, weights) the draft reports."""
    logits = np.full(len(KEEP), -8.0)
    logits[[4, 9, 17, 30]] = [2.0, 1.5, 0.5, 0.0]
    mtp, x_hat = _mtp(_fixed_step(logits))
    n = 3000
    firsts, q0 = [], None
    for seed in range(n):
        d = mtp.draft(x_hat, _sampling(seed, top_k=4))
        assert d.chain_q is not None and len(d.chain_q) == len(d.chain) == 4
        if q0 is None:
            q0 = d.chain_q[0]
        assert all(q == q0 for q in d.chain_q)  # the same logits at every step: the same q
        assert all(y in q[0] for y, q in zip(d.chain, d.chain_q))
        firsts.append(d.chain[0])
    ids, ws = q0
    assert ids == tuple(KEEP[i] for i in (4, 9, 17, 30))
    q = np.asarray(ws) / sum(ws)
    freq = np.array([firsts.count(t) for t in ids]) / n
    assert np.all(np.abs(freq - q) <= 5 * np.sqrt(q * (1 - q) / n) + 1e-3), (freq, q)


def test_sampled_drafts_are_seeded_and_the_runner_up_is_the_best_other_token():
    mtp, x_hat = _mtp()
    a, b = mtp.draft(x_hat, _sampling(7)), mtp.draft(x_hat, _sampling(7))
    assert (a.chain, a.runner_ups, a.chain_q) == (b.chain, b.runner_ups, b.chain_q)
    chains = {tuple(mtp.draft(x_hat, _sampling(s, temperature=2.0)).chain) for s in range(12)}
    assert len(chains) > 1  # different seeds draw different chains
    # runner-up: never the drawn token; the best other token (re-running the steps along the drawn chain)
    d = mtp.draft(x_hat, _sampling(3, temperature=2.0))
    feeds = mtp.feeds(x_hat)
    for step, (y, i) in enumerate(zip(d.chain, d.chain_keep_idx)):
        logits, h = mtp.step(feeds)
        o = logits.reshape(-1).copy()
        if step < mtp.d:
            o[i] = -np.inf
            assert d.runner_ups[step] == KEEP[int(np.argmax(o))] != y
        feeds["z"] = np.concatenate([mtp.lut[i], h.reshape(-1)])[None].astype(np.float32)


def test_greedy_path_is_unchanged():
    mtp, x_hat = _mtp()
    ref = mtp.draft(x_hat)
    for s in (None, _sampling(0, temperature=0.0), _sampling(0, temperature=1e-6)):
        d = mtp.draft(x_hat, s)
        assert (d.chain, d.runner_ups, d.chain_keep_idx, d.chain_q) == (ref.chain, ref.runner_ups,
                                                                       ref.chain_keep_idx, None)
    # and the greedy chain is the argmax chain
    feeds = mtp.feeds(x_hat)
    for y in ref.chain:
        logits, h = mtp.step(feeds)
        i = int(np.argmax(logits.reshape(-1)))
        assert KEEP[i] == y
        feeds["z"] = np.concatenate([mtp.lut[i], h.reshape(-1)])[None].astype(np.float32)


# --- the tree carries q ---
Q = [((10, 11), (3, 1)), ((20, 21, 22), (5, 4, 1)), ((30,), (9,)), ((40, 41), (1, 1))]


def _check(tree: DraftTree) -> DraftQ:
    frame = TreeFrame.from_lists(1, **tree.wire_dict(), draft_q=tree.draft_q_dict())
    q = frame.draft_q
    q.check(frame.tokens, frame.parents)
    for r, (ids, _) in tree.draft_q_dict().items():
        assert tree.tokens[r] in ids and tree.sources[r] == 1  # CHAIN rows only
    return q


def test_q_survives_planting_trimming_and_value_order():
    planted = plant_tree(5, [10, 20, 30, 40], [11, 21], chain_q=Q)  # rows: 5 10 20 30 40 11 21
    assert planted.draft_q_dict() == {1: Q[0], 2: Q[1], 3: Q[2], 4: Q[3]}
    _check(planted)
    cut = trim(planted, 3)  # keeps 10, 20 and the runner-up 11 (score 2a ties 20, which is earlier)
    assert cut.tokens == (5, 10, 20, 11) and cut.draft_q_dict() == {1: Q[0], 2: Q[1]}
    ordered = value_order(planted)  # 5 10 20 11 30 21 40
    assert ordered.tokens == (5, 10, 20, 11, 30, 21, 40)
    assert ordered.draft_q_dict() == {1: Q[0], 2: Q[1], 4: Q[2], 6: Q[3]}
    _check(ordered)
    assert trim(planted, 0).draft_q is None and plant_tree(5, [10], []).draft_q is None
    greedy = DraftTree.make_dummy([5, 10, 20], [-1, 0, 1])
    assert greedy.draft_q_dict() is None


def _hybrid():
    sspec = toy_slm_spec(sliding_window=W // 2)
    slm = SlmDrafter(sspec, random_slm_state_dict(sspec, seed=2), KEEP, window=W)
    slm.prefill([5, 9, 13, 200])
    mtp, x_hat = _mtp()
    return HybridDrafter(mtp, slm), x_hat


@pytest.mark.parametrize("node_budget", [32, 3])
def test_hybrid_tree_sends_a_valid_draft_q(node_budget):
    hybrid, x_hat = _hybrid()
    tree = value_order(hybrid.propose(DraftContext(root=21, x_hat=x_hat, sampling=_sampling(4, 1.5)), node_budget))
    chain, qs = hybrid.last_chain.chain, hybrid.last_chain.chain_q
    q = _check(tree)
    sent = {tree.tokens[r]: (ids, w) for r, ids, w in zip(q.rows, q.ids, q.weights)}
    # every chain row that survived carries its own step's q; a trimmed one dropped it
    path = [0]
    for y, qk in zip(chain, qs):
        kids = [r for r in tree.children(path[-1]) if tree.tokens[r] == y]
        if not kids:
            break
        path.append(kids[0])
        assert tree.draft_q[kids[0]] == qk and sent[y] == qk
    assert len(q.rows) == len(path) - 1 >= 1 and tree.num_nodes <= node_budget
    frame = TreeFrame.from_lists(2, **tree.wire_dict(), draft_q=tree.draft_q_dict())
    assert decode_client_frame(encode_frame(frame)).draft_q == frame.draft_q
    greedy = hybrid.propose(DraftContext(root=21, x_hat=x_hat), node_budget)
    assert greedy.draft_q is None and hybrid.last_chain.chain_q is None


# --- the session option ---
class _Planted:
    """A drafter that plants a sampled chain when the context asks for sampling (no SLM)."""

    def propose(self, context, node_budget):
        self.sampling = context.sampling
        if context.sampling is None:
            return plant_tree(context.root, [context.root + 1], [], node_budget=node_budget)
        i = draw(np.array([3, 1], np.uint16), context.sampling.rng)
        y = (context.root + 1, context.root + 2)[i]
        q = [((context.root + 1, context.root + 2), (3, 1))]
        return plant_tree(context.root, [y], [], node_budget=node_budget, chain_q=q)


def _session(options, **request):
    """A session granted the phone's own node budget (as the server's ``session`` frame would), ready to draft."""
    s = PhoneSession(_Planted(), prompt_tokens=[3, 4], request={"prompt": [3, 4], **request},
                     endpoint="completions", options=options)
    s.node_budget = options.node_budget
    return s


def test_draft_sampling_option_is_checked():
    with pytest.raises(ConfigError, match="draft_sampling.*'greedy', 'probabilistic'"):
        SessionOptions(draft_sampling="sampled")
    assert SessionOptions().draft_sampling == "greedy"


@pytest.mark.parametrize("opt,request_kw,sampled", [
    ("probabilistic", {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 11}, True),
    ("probabilistic", {"temperature": 0.0}, False),
    ("probabilistic", {}, False),  # no temperature: the server's default, so greedy drafts
    ("greedy", {"temperature": 1.0, "seed": 11}, False),
])
def test_session_sends_draft_q_only_for_sampled_requests(opt, request_kw, sampled):
    s = _session(SessionOptions(draft_sampling=opt), **request_kw)
    frame = s.next_tree()
    assert (frame.draft_q is not None) == sampled and (s.drafter.sampling is not None) == sampled
    if sampled:
        frame.draft_q.check(frame.tokens, frame.parents)
        d = s.drafter.sampling
        assert (d.temperature, d.top_k, d.top_p) == (0.8, 20, 0.9)
    assert decode_client_frame(encode_frame(frame)) == frame  # decoding runs the server's DraftQ.check


def test_session_rng_is_seeded_by_request_seed_failovers_and_round():
    a = [session_rng(11, 0, r).integers(1 << 30) for r in range(3)]
    assert a == [session_rng(11, 0, r).integers(1 << 30) for r in range(3)] and len(set(a)) == 3
    assert session_rng(11, 1, 0).integers(1 << 30) != a[0] and session_rng(-3, 0, 0) is not None
    s1 = _session(SessionOptions(draft_sampling="probabilistic"), temperature=1.0, seed=11)
    s2 = _session(SessionOptions(draft_sampling="probabilistic"), temperature=1.0, seed=11)
    r1, r2 = s1.draft_sampling().rng, s2.draft_sampling().rng
    assert r1.integers(1 << 30, size=4).tolist() == r2.integers(1 << 30, size=4).tolist()


def test_snapshot_keeps_the_pending_draft_q():
    s = _session(SessionOptions(draft_sampling="probabilistic"), temperature=1.0, seed=2)
    frame = s.next_tree()
    snap = json.loads(json.dumps(s.snapshot()))
    restored = PhoneSession.restore(_Planted(), snap, options=s.options)
    assert restored.next_tree().draft_q == frame.draft_q
    reopened = dataclasses.replace(frame, round=0)
    assert reopened.draft_q == frame.draft_q


# --- the bench configuration ---
def test_bench_config_hyco_exact_prob():
    from hyco_lab.bench import configs, phones

    prob, exact = configs.CONFIGS["hyco-exact-prob"], configs.CONFIGS["hyco-exact"]
    assert prob.draft_sampling == "probabilistic"
    assert dataclasses.replace(prob, name=exact.name, label=exact.label, draft_sampling="greedy") == exact
    assert prob.server_key() == exact.server_key() and prob.server_spec("a") == exact.server_spec("a")
    assert all(c.draft_sampling == "greedy" for n, c in configs.CONFIGS.items()
               if not n.startswith("hyco-exact-prob"))
    s4 = configs.CONFIGS["hyco-exact-prob-s4"]
    assert s4.draft_sampling == "probabilistic" and s4.server_key() == configs.CONFIGS["hyco-exact-s4"].server_key()
    assert json.loads(phones.describe(prob))["draft_sampling"] == "probabilistic"
    assert "draft_sampling" not in json.loads(phones.describe(exact))
    assert configs.select("hyco-exact-prob") == [prob]


def test_hyco_loop_with_sampled_drafts_against_the_fake_server():
    """Every tree of a sampled session passes the server's frame decoding (DraftQ.check); the fake server
    verifies greedily, so the answer is its greedy text whatever the phone drew."""
    from test_client_loop import PROMPT, greedy, run
    from test_client_loop_hyco import hyco_phone

    phone, _, _ = hyco_phone()
    request = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 3}
    s = PhoneSession(phone, prompt_tokens=PROMPT, request=request, endpoint="completions",
                     options=SessionOptions(draft_sampling="probabilistic"))
    sent = []
    next_tree = s.next_tree
    s.next_tree = lambda: sent.append(next_tree()) or sent[-1]
    result, server = run({}, s)
    assert result.token_ids == greedy(PROMPT, 12) and server.trees >= 2
    assert sent[0].draft_q is None  # round 0: the SLM's tree alone (no hand-off yet)
    assert all(f.draft_q is not None for f in sent[1:])
