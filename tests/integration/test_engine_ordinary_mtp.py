"""Ordinary requests keep vLLM's MTP on a HyCo engine (``"model"`` in the hyco spec), beside phone trees.

One HyCo engine (``{"method": "hyco", "model": assistant, "num_speculative_tokens": 4}``, static node budget 32,
so every tree is verified whole: trees of the node budget and MTP chains of K in the same steps) and one vLLM
MTP engine with the same drafter and K, the reference for every ordinary request. The test wraps vLLM's
``RejectionSampler.forward`` and the MTP drafter's model ``forward`` itself (not a counter the code under
test keeps) to see what each step hands them.
"""

from __future__ import annotations

import random

import pytest

K = 4
ORDINARY_LEN = 12  # ordinary prompts are short and sessions' long, so a position says whose row it is
SESSION_LEN = 200
MAX_TOKENS = 24


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [2] + [rng.randrange(10, 4000) for _ in range(n - 1)]


@pytest.fixture(scope="module")
def engines(fixtures_dir):
    from tests.conftest import _LLMFactory

    factory = _LLMFactory()
    assistant = str(fixtures_dir / "assistant")
    mtp = factory(fixtures_dir / "verifier", max_num_seqs=8, disable_log_stats=False,
                  speculative_config={"method": "mtp", "model": assistant, "num_speculative_tokens": K})
    hyco = factory(fixtures_dir / "verifier", max_num_seqs=8, disable_log_stats=False,
                   speculative_config={"method": "hyco", "model": assistant, "num_speculative_tokens": K,
                                       "budget_policy": "static"})
    yield mtp, hyco
    factory.close_all()


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def _ordinary_requests():
    """(inputs, params) of the ordinary requests: greedy, seeded sampling with n = 2, a stop string, logprobs,
    a penalty."""
    from vllm import SamplingParams

    rng = random.Random(3)
    base = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, **base),
              SamplingParams(temperature=1.0, top_k=64, top_p=0.95, seed=11, n=2, **base),
              SamplingParams(temperature=0.0, stop=["the"], **base),
              SamplingParams(temperature=0.0, logprobs=3, **base),
              SamplingParams(temperature=0.8, seed=5, repetition_penalty=1.3, **base)]
    return [({"prompt_token_ids": _prompt(rng, ORDINARY_LEN)}, p) for p in params]


def _summary(outputs) -> list[tuple]:
    """Each completion's tokens, text, finish reason and top logprob ids (when asked)."""
    return [(tuple(c.token_ids), c.text, c.finish_reason,
             None if c.logprobs is None else tuple(tuple(sorted(lp)) for lp in c.logprobs))
            for o in outputs for c in o.outputs]


def test_greedy_ordinary_requests_match_vllm_mtp_and_are_speculated(engines):
    from vllm import SamplingParams

    from hyco_lab.fixtures.report import spec_counters

    mtp, hyco = engines
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": _prompt(rng, ORDINARY_LEN)} for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = mtp.generate(prompts, params, use_tqdm=False)
    before = spec_counters(hyco)
    got = hyco.generate(prompts, params, use_tqdm=False)
    after = spec_counters(hyco)
    assert _summary(got) == _summary(ref)
    drafts = after["vllm:spec_decode_num_draft_tokens"] - before["vllm:spec_decode_num_draft_tokens"]
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0 and drafts % K == 0, "ordinary requests were not drafted K deep"
    assert accepted > 0


def test_steps_that_mix_ordinary_mtp_and_phone_trees(engines):
    """Ordinary requests of every kind beside greedy sessions verifying 33-row trees: each ordinary request
    as on the MTP engine; the rejection sampler once per step on the ordinary drafts only (a tree request
    enters with its root row and no draft); the drafter's forward on no session row; the sessions' text is
    plain greedy's."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    mtp, hyco = engines
    requests = _ordinary_requests()
    ref = _summary([mtp.generate([i], p, use_tqdm=False)[0] for i, p in requests])
    rng = random.Random(7)
    session_prompts = [_prompt(rng, SESSION_LEN) for _ in range(2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [list(o.outputs[0].token_ids)
             for o in mtp.generate([{"prompt_token_ids": p} for p in session_prompts], greedy, use_tqdm=False)]

    runner = _runner(hyco)
    sampler_calls, drafter_positions, steps = [], [], [0]
    rs_forward, model_forward = runner.rejection_sampler.forward, runner.drafter.model.forward

    def rejection_forward(metadata, draft_probs, logits, sampling_metadata):
        sampler_calls.append((steps[0], list(metadata.num_draft_tokens), int(logits.shape[0]),
                              [runner.input_batch.req_ids[b] for b in range(runner.input_batch.num_reqs)]))
        return rs_forward(metadata, draft_probs, logits, sampling_metadata)

    def drafter_forward(*args, **kwargs):
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        drafter_positions.append((steps[0], positions.detach().cpu().tolist()))
        return model_forward(*args, **kwargs)

    runner.rejection_sampler.forward = rejection_forward
    runner.drafter.model.forward = drafter_forward
    hy = HycoEngine(hyco)
    step = hy._step

    def counted_step():
        steps[0] += 1
        step()

    hy._step = counted_step
    try:
        delta = []
        for j, (inputs, p) in enumerate(requests):
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            hy.add_request(f"ord-{j}", inputs, p)
            delta.append(f"ord-{j}")
        handles = [hy.open(prompt_token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
                   for p in session_prompts]
        state = {h.sid: [h.root, [], 0, plain[i]] for i, h in enumerate(handles)}
        mixed_steps = set()
        while state:
            batch = []
            for sid, (root, out, rnd, want) in state.items():
                chain = want[len(out):len(out) + 5]
                tokens, parents = [root] + chain, [-1] + list(range(len(chain)))
                while len(tokens) < 33:  # decoys under the root and the chain: a full tree of the node budget
                    tokens.append(rng.randrange(10, 4000))
                    parents.append(rng.randrange(0, len(tokens) - 1))
                batch.append((sid, rnd, tokens, parents))
            first = steps[0]
            for v in hy.submit_many(batch):
                s = state[v.sid]
                s[1] += v.committed
                s[0], s[2] = v.bonus, s[2] + 1
                if v.finished:
                    assert s[1] == s[3], "a session's text is not plain greedy's"
                    del state[v.sid]
            mixed_steps.update(range(first + 1, steps[0] + 1))
        finals = {}
        for _ in range(500):
            for r in delta:
                for o in hy.take_outputs(r):
                    if o.finished:
                        finals[r] = o
            if len(finals) == len(delta):
                break
            hy.step()
    finally:
        runner.rejection_sampler.forward, runner.drafter.model.forward = rs_forward, model_forward
        hy._step = step

    assert _summary([finals[r] for r in delta]) == ref
    per_step = {}
    for st, counts, rows, req_ids in sampler_calls:
        per_step.setdefault(st, []).append((counts, rows, req_ids))
    assert all(len(calls) == 1 for calls in per_step.values()), "the rejection sampler ran twice in a step"
    session_ids = {h.engine_req_id for h in handles}
    tree_steps_with_mtp = 0
    for st, [(counts, rows, req_ids)] in per_step.items():
        in_batch = [r in session_ids for r in req_ids]
        assert all(n == 0 for n, is_session in zip(counts, in_batch) if is_session), "a tree entered as drafts"
        assert rows == sum(n + 1 for n in counts)
        tree_steps_with_mtp += st in mixed_steps and any(in_batch) and any(counts)
    assert tree_steps_with_mtp > 0, "no step verified phone trees and ordinary MTP drafts together"
    mixed_drafts = [pos for st, pos in drafter_positions if st in mixed_steps]
    assert mixed_drafts, "the drafter never ran in a step with trees"
    assert all(p < SESSION_LEN - 1 for pos in mixed_drafts for p in pos), "the drafter's forward saw a session row"


# -- server mode (issue 33): a session drafted by the server's MTP head between its phone rounds -------------
def test_a_session_switched_every_round_commits_plain_greedy(engines):
    """Phone round, a stretch of server mode (vLLM's MTP drafts for it, no tree), phone round again, ...:
    the committed tokens are plain greedy's; the phone round after each stretch gets the window's K/V again
    (the seed) and its round number is the stretch's plus one."""
    from vllm import SamplingParams

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    mtp, hyco = engines
    rng = random.Random(11)
    prompt = _prompt(rng, 40)
    want = list(mtp.generate([{"prompt_token_ids": prompt}],
                             SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids)
    hy = HycoEngine(hyco)
    s = hy.open(prompt_token_ids=prompt, temperature=0.0, max_tokens=40, ignore_eos=True)
    out, root, rnd, seeds, stretches = [], s.root, 0, 0, 0
    while True:
        chain = want[len(out):len(out) + 3]
        tokens, parents = [root] + chain + [rng.randrange(10, 4000)], [-1] + list(range(len(chain))) + [0]
        v = hy.submit(s.sid, rnd, tokens, parents)
        seeds += v.handoff.seed is not None
        out, root, rnd = out + v.committed, v.bonus, rnd + 1
        if v.finished:
            break
        info = hy.set_mode(s.sid, "server")
        assert (info.mode, info.expected_round) == ("server", rnd)
        stretch = hy.decode_server(s.sid, steps=2)
        stretches += 1
        out += stretch.committed
        if stretch.finished:
            break
        info = hy.set_mode(s.sid, "phone")
        assert (info.mode, info.expected_round, info.seed_due) == ("phone", rnd + 1, True)
        assert info.server_tokens >= len(stretch.committed) > 0
        root, rnd = info.root, info.expected_round
    assert out == want
    assert stretches >= 2 and seeds >= stretches  # round 0 and every round after a stretch carried the seed
    ledger = hyco.llm_engine.engine_core.engine_core.scheduler.hyco.mode_cost  # what a token cost in each mode
    assert ledger.seen["phone"] > 0 and ledger.seen["server"] > 0 and min(ledger.seconds.values()) > 0


def test_mode_switch_refusals_are_typed_and_change_nothing(engines):
    from vllm_hyco.errors import SessionError
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    _, hyco = engines
    hy = HycoEngine(hyco)
    s = hy.open(prompt_token_ids=_prompt(random.Random(2), 20), temperature=0.0, max_tokens=8, ignore_eos=True)
    with pytest.raises(SessionError) as err:
        hy.set_mode(s.sid, "cloud")
    assert err.value.code == "bad_mode" and "'phone'" in str(err.value)
    hy.set_mode(s.sid, "server")
    with pytest.raises(SessionError) as err:  # trees wait for phone mode
        hy.submit(s.sid, 0, [s.root, 5], [-1, 0])
    assert err.value.code == "wrong_mode"
    info = hy.set_mode(s.sid, "phone")
    with pytest.raises(SessionError) as err:  # a switch waits for the round boundary
        from vllm_hyco.engine_contract import TreeSubmission

        hy._call("hyco_submit_tree", TreeSubmission(s.sid, info.expected_round, (info.root, 5), (-1, 0)))
        hy._call("hyco_set_mode", s.sid, "server", info.expected_round)
    assert err.value.code == "mid_round"
    hy._step()
    assert hy._info(s.sid).state in ("parked", "finished")
    hy.close(s.sid)


def test_preemption_in_server_mode_loses_nothing(engines):
    """vLLM preempts a session in server mode (its own ``_preempt_request``, as its scheduler does when blocks
    run out): the request re-prefills as any request and decodes on; a switch back to phone mode waits until
    it has a decoded token again (``session_busy``), and the whole answer is still plain greedy's."""
    import time

    from vllm import SamplingParams

    from vllm_hyco.errors import SessionError
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    mtp, hyco = engines
    prompt = _prompt(random.Random(13), 30)
    want = list(mtp.generate([{"prompt_token_ids": prompt}],
                             SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids)
    hy = HycoEngine(hyco)
    sched = hyco.llm_engine.engine_core.engine_core.scheduler
    s = hy.open(prompt_token_ids=prompt, temperature=0.0, max_tokens=30, ignore_eos=True)
    v = hy.submit(s.sid, 0, [s.root, want[0]], [-1, 0])
    out = list(v.committed)
    hy.set_mode(s.sid, "server")
    out += hy.decode_server(s.sid, steps=2).committed
    request = sched.requests[s.engine_req_id]
    sched.running.remove(request)
    sched._preempt_request(request, time.monotonic())
    with pytest.raises(SessionError) as err:
        hy.set_mode(s.sid, "phone")
    assert err.value.code == "session_busy"
    out += hy.decode_server(s.sid, steps=3).committed  # re-prefilled, then decoding again
    assert request.num_preemptions == 1
    info = hy.set_mode(s.sid, "phone")
    root, rnd = info.root, info.expected_round
    while True:
        chain = want[len(out):len(out) + 4]
        v = hy.submit(s.sid, rnd, [root] + chain, [-1] + list(range(len(chain))))
        out, root, rnd = out + v.committed, v.bonus, rnd + 1
        if v.finished:
            break
    assert out == want


def test_exact_sampling_is_lossless_on_a_session_that_switches(engines, fixtures_dir):
    """T = 1, exact mode: a phone round (root only: the server samples one token), a server-mode step (vLLM's MTP
    drafts, its rejection sampler verifies), then a phone round again. The second and the last completion
    tokens, over sessions with different seeds, follow plain sampling's distribution (chi-square against 800
    plain samples, alpha 1e-3, ``tests/unit/distcheck.py``)."""
    import sys
    from collections import Counter
    from pathlib import Path

    import numpy as np
    from vllm import SamplingParams

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from distcheck import chi_square
    from transformers import AutoTokenizer

    mtp, hyco = engines
    tok = AutoTokenizer.from_pretrained(str(fixtures_dir / "verifier"))
    prompt = tok.encode("And the LORD said unto Moses,", add_special_tokens=True)  # a text the family was trained on
    n_ref, n_hy, length = 800, 96, 4
    sampling = dict(temperature=1.0, max_tokens=length, ignore_eos=True)
    ref = mtp.generate([{"prompt_token_ids": prompt}] * n_ref,
                       [SamplingParams(seed=10_000 + i, **sampling) for i in range(n_ref)], use_tqdm=False)
    ref_ids = [list(o.outputs[0].token_ids) for o in ref]
    hy = HycoEngine(hyco)
    got, modes = [], Counter()
    for i in range(n_hy):
        s = hy.open(prompt_token_ids=prompt, seed=i, **sampling)
        v = hy.submit(s.sid, 0, [s.root], [-1])
        out = list(v.committed)
        hy.set_mode(s.sid, "server")
        stretch = hy.decode_server(s.sid, steps=1)
        out += stretch.committed
        modes["server"] += len(stretch.committed)
        while not stretch.finished and len(out) < length:
            info = hy.set_mode(s.sid, "phone")
            v = hy.submit(s.sid, info.expected_round, [info.root], [-1])
            out += v.committed
            modes["phone_after"] += len(v.committed)
            if v.finished:
                break
            hy.set_mode(s.sid, "server")
            stretch = hy.decode_server(s.sid, steps=1)
            out += stretch.committed
        if not (stretch.finished or (out and len(out) >= length)):
            hy.close(s.sid)
        got.append(out[:length])
    assert all(len(o) == length for o in got) and modes["phone_after"] > 0
    tested = 0
    for pos in range(1, length):
        vocab = sorted({r[pos] for r in ref_ids} | {g[pos] for g in got})
        index = {t: k for k, t in enumerate(vocab)}
        probs = np.bincount([index[r[pos]] for r in ref_ids], minlength=len(vocab)) / n_ref
        observed = np.bincount([index[g[pos]] for g in got], minlength=len(vocab)).astype(float)
        big = probs * n_hy >= 5
        if not big.any() or probs[~big].sum() * n_hy < 5:  # under two bins after merging: nothing to test
            continue
        stat, crit = chi_square(observed, probs + 1e-12)
        assert stat < crit, (pos, stat, crit)
        tested += 1
    assert tested >= 2  # the first server-mode token and the phone round's after the stretch
