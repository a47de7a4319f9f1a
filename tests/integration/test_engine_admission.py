"""Admission and parked-KV limits of HyCo sessions, and per-session state freed when sessions end.

One real vLLM 0.32 engine (CPU, tiny fp32 Gemma-4 MoE, in-process) with ``max_num_seqs=2`` and
``{"method": "hyco", "max_parked_blocks": CAP}``:

* more sessions submit trees than there are batch slots: the extra ones get ``server_busy`` (the same
  typed code from the in-process API and from the WebSocket route's utility method), a resend succeeds,
  and every stream equals plain vLLM greedy;
* the cap reaches the registry from ``--speculative-config``; beyond it the least recently used parked
  session ends with ``session_evicted``, the others keep verifying, and the evicted one reopened with its
  committed text as the prompt (re-prefill) finishes the plain-greedy stream;
* sessions ending every way (max_tokens, close, idle timeout, eviction) leave the registry, vLLM's
  scheduler and frontend, the runner's HyCo state and the API's maps at their baseline sizes.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from test_engine_sessions import VOCAB, _tree, tiny_hyco_llm

from vllm_hyco.config import ADDITIONAL_CONFIG_KEY, HycoConfig
from vllm_hyco.errors import ConfigError, SessionError

CAP = 24  # parked KV blocks: two 90-token sessions (9 blocks each in this model's 4 KV groups) fit, 3 do not
SLOTS = 2


# -- the option (no engine) ---------------------------------------------------------------------------
@pytest.mark.parametrize("value, blocks", [(None, None), (64, 64), (0.25, 250), (1e-6, 1)])
def test_max_parked_blocks_option_in_blocks(value, blocks):
    cfg = HycoConfig.parse({"method": "hyco", "max_parked_blocks": value})
    assert cfg.max_parked_blocks == value and cfg.parked_block_cap(1000) == blocks
    assert HycoConfig.from_dict(cfg.to_dict()) == cfg
    assert "max_parked_blocks" in HycoConfig.valid_options()


@pytest.mark.parametrize("value", [0, -3, 1.0, 1.5, 0.0, float("nan"), True, "16", [4]])
def test_bad_max_parked_blocks_named_with_its_range(value):
    with pytest.raises(ConfigError) as err:
        HycoConfig.from_dict({"max_parked_blocks": value})
    msg = str(err.value)
    assert "max_parked_blocks" in msg and "(0, 1)" in msg and "null" in msg


def test_registry_policy_never_falls_back_silently_on_a_bad_config():
    from vllm_hyco.vllm_adapter.engine_core.state import registry_options, session_kv_blocks

    pool = SimpleNamespace(num_gpu_blocks=101)

    def options(vllm_config):  # what HycoScheduler.__init__ does with an engine of 101 KV blocks
        return registry_options(HycoConfig.maybe_from_vllm_config(vllm_config), session_kv_blocks(pool))

    good = SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: HycoConfig(
        session_idle_timeout_s=7, max_parked_blocks=0.5).to_dict()})
    assert options(good) == {"idle_timeout_s": 7, "max_parked_blocks": 50}
    bad = SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: {"method": "hyco", "max_parked_blocks": -1}})
    with pytest.raises(ConfigError, match="max_parked_blocks"):
        options(bad)
    plain = SimpleNamespace(additional_config={})
    assert options(plain) == {}  # not a HyCo engine: registry defaults


# -- the engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    yield from tiny_hyco_llm(tmp_path_factory, "tiny_admission", max_num_seqs=SLOTS,
                             speculative_config={"method": "hyco", "max_parked_blocks": CAP,
                                                 "budget_policy": "static"})


@pytest.fixture(scope="module")
def hy(llm):
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    return HycoEngine(llm)


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _greedy(llm, prompts, max_tokens):
    """Plain vLLM greedy (only while no session is open: LLM.generate waits for every request)."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompts(rng, lengths):
    return [[2] + [rng.randrange(5, VOCAB) for _ in range(n - 1)] for n in lengths]


def test_more_trees_than_batch_slots_get_server_busy_and_resend(llm, hy):
    from vllm_hyco.engine_contract import TreeSubmission, decode_result

    rng = random.Random(3)
    prompts = _prompts(rng, (12, 20, 7, 16, 9))
    refs = _greedy(llm, prompts, 16)  # short: the five parked sessions stay under the cap
    handles = [hy.open(prompt_token_ids=p, temperature=0.0, max_tokens=16, ignore_eos=True) for p in prompts]
    state = {h.sid: {"root": h.root, "out": [], "round": 0, "ref": r} for h, r in zip(handles, refs)}
    busy = 0
    pending: dict[str, tuple] = {}  # sid -> the tree it must resend
    while state:
        batch = []
        for sid, st in state.items():
            if sid not in pending:
                shape = rng.choice(["chain", "deep"])
                toks, pars, _ = _tree(st["root"], st["ref"][len(st["out"]):], shape, rng)
                pending[sid] = (sid, st["round"], toks, pars)
            batch.append(pending[sid])
        results = hy.submit_many(batch, return_errors=True)
        verdicts = [r for r in results if not isinstance(r, Exception)]
        assert len(verdicts) == min(SLOTS, len(batch))  # exactly the free slots were taken
        for tree, r in zip(batch, results):
            sid = tree[0]
            if isinstance(r, Exception):
                assert isinstance(r, SessionError) and r.code == "server_busy", r
                busy += 1
                continue
            del pending[sid]
            st = state[sid]
            st["out"] += r.committed
            assert st["out"] == st["ref"][:len(st["out"])]
            st["root"], st["round"] = r.bonus, st["round"] + 1
            if r.finished:
                assert r.finish_reason == "length" and st["out"] == st["ref"]
                del state[sid]
    assert busy >= 3  # 5 sessions on 2 slots: at least the first round refused 3
    # The engine-core method the WebSocket route's client calls answers with the same code from the same
    # guard, in the one error format.
    core = _core(llm)
    handles = [hy.open(prompt_token_ids=p, temperature=0.0, max_tokens=4, ignore_eos=True)
               for p in prompts[:3]]
    acks = [core.hyco_submit_tree(TreeSubmission(h.sid, 0, (h.root,), (-1,)).to_wire()) for h in handles]
    assert [a["num_rows"] for a in acks[:2]] == [1, 1] and acks[2]["hyco_error"]["code"] == "server_busy"
    with pytest.raises(SessionError) as e:
        decode_result("hyco_submit_tree", acks[2])
    assert e.value.code == "server_busy"
    assert len(core.scheduler.running) == SLOTS
    for h in handles:
        hy.close(h.sid)


def test_parked_block_cap_evicts_the_lru_session_which_reopens_with_its_committed_text(llm, hy):
    core = _core(llm)
    reg = core.scheduler.hyco.sessions
    assert reg.max_parked_blocks == CAP  # from --speculative-config, through additional_config
    rng = random.Random(8)
    prompts = _prompts(rng, (90, 90, 90))
    refs = _greedy(llm, prompts, 20)
    a = hy.open(prompt_token_ids=prompts[0], temperature=0.0, max_tokens=20, ignore_eos=True)
    va = hy.submit(a.sid, 0, [a.root] + refs[0][:3], [-1, 0, 1, 2])
    committed = list(va.committed)
    assert committed == refs[0][:4]
    b = hy.open(prompt_token_ids=prompts[1], temperature=0.0, max_tokens=20, ignore_eos=True)
    c = hy.open(prompt_token_ids=prompts[2], temperature=0.0, max_tokens=20, ignore_eos=True)
    blocks = {h.sid: reg.get(h.sid).num_kv_blocks for h in (a, b, c)}
    assert sum(blocks.values()) > CAP >= blocks[b.sid] + blocks[c.sid], blocks  # the test's premise
    assert hy.poll() == [a.sid]  # a is the least recently used parked session
    with pytest.raises(SessionError) as info:
        hy.submit(a.sid, 1, [va.bonus], [-1])
    assert info.value.code == "session_evicted"
    vb = hy.submit(b.sid, 0, [b.root] + refs[1][:5], [-1, 0, 1, 2, 3, 4])  # the others keep their KV
    assert vb.committed == refs[1][:6]
    assert not hy.poll()
    hy.close(b.sid)
    hy.close(c.sid)
    # The phone reopens: the committed text is the new prompt (re-prefill), its last token the first root.
    text = prompts[0] + committed
    a2 = hy.open(prompt_token_ids=text, temperature=0.0, max_tokens=20 - len(committed), ignore_eos=True)
    assert a2.root == committed[-1]
    out, root, rnd = [], a2.root, 0
    while True:
        done = len(committed) + len(out)
        toks = [root] + refs[0][done:done + 6]
        v = hy.submit(a2.sid, rnd, toks, list(range(-1, len(toks) - 1)))
        out += v.committed
        root, rnd = v.bonus, rnd + 1
        if v.finished:
            break
    assert committed + out == refs[0]


def _sizes(llm, hy) -> dict[str, int]:
    core = _core(llm)
    sched = core.scheduler
    runner = core.model_executor.driver_worker.worker.model_runner
    reg = sched.hyco.sessions
    st = runner.hyco
    return {"registry_sids": len(reg._by_sid), "registry_reqs": len(reg._by_req), "live": len(reg),
            "sched_requests": len(sched.requests), "running": len(sched.running),
            "waiting": len(sched.waiting),
            "runner_requests": len(runner.requests), "runner_gens": len(st.gens),
            "runner_verdicts": len(st.verdicts), "runner_trees": int(bool(st.trees)),
            "frontend_states": len(llm.llm_engine.output_processor.request_states),
            "api_outbox": len(hy._outbox), "api_sessions": len(hy._sessions), "api_sids": len(hy._sids),
            "api_in_round": len(hy._in_round),
            "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks()}


def _state(reg, sid: str) -> tuple[str, str | None]:
    try:
        s = reg.get(sid)
    except SessionError:  # already forgotten (finished more than the grace period ago)
        return "finished", None
    return s.state.value, s.finish_code


def _forget_finished(reg) -> None:
    clock = reg._clock
    reg._clock = lambda: clock() + 3600.0  # past the grace period of every finished session
    try:
        reg.sweep_finished()
    finally:
        reg._clock = clock


def test_ended_sessions_leave_no_state_behind(llm, hy):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    core = _core(llm)
    reg = core.scheduler.hyco.sessions
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    assert hy.run_plain("before", {"prompt_token_ids": [2, 7, 8, 9]}, params)[-1].finished  # earlier tests
    _forget_finished(reg)
    hy.step()  # its finished id reaches the runner
    base = _sizes(llm, hy)
    rng = random.Random(17)
    # Opened in this order, the two big ones (9 blocks each) are evicted as the LRU parked sessions once the
    # short ones (4 blocks each, also after their rounds: <= 32 tokens) push the pinned total past the cap.
    ends = ["big", "big", "length", "close", "timeout", "length", "close", "timeout"]
    prompts = _prompts(rng, [90 if e == "big" else rng.randrange(6, 24) for e in ends])
    for cycle in range(2):  # twice: what one cycle leaves behind would show up as growth
        sids, codes = {}, []
        for i, (end, p) in enumerate(zip(ends, prompts)):
            temp = 0.8 if i % 2 else 0.0  # sampled sessions get a generator in the runner
            h = hy.open(prompt_token_ids=p, temperature=temp, seed=i, max_tokens=6, ignore_eos=True)
            sids[h.sid] = [end, h.root, 0]
            hy.poll()
        # Rounds, SLOTS trees at a time; "length" sessions run to max_tokens, the others stop after one.
        while True:
            todo = [sid for sid, (end, _, rnd) in sids.items()
                    if _state(reg, sid)[0] == "parked" and (end == "length" or rnd == 0)]
            if not todo:
                break
            results = hy.submit_many([(sid, sids[sid][2], [sids[sid][1]], [-1]) for sid in todo],
                                     return_errors=True)
            for sid, r in zip(todo, results):
                if isinstance(r, Exception):
                    assert r.code in ("server_busy", "session_evicted"), r
                    continue
                sids[sid][1], sids[sid][2] = r.bonus, sids[sid][2] + 1
        for sid, (end, _, _) in sids.items():
            if end == "close":
                hy.close(sid)  # False when the cap evicted it first
        idle = reg.idle_timeout_s
        reg.idle_timeout_s = 0.0
        try:
            for sid in sids:
                if _state(reg, sid)[0] == "parked" and sids[sid][0] != "timeout":
                    reg.get(sid).last_active += 1e9  # only the "timeout" sessions are idle
            hy.poll()
        finally:
            reg.idle_timeout_s = idle
        for sid, how in sids.items():
            if _state(reg, sid)[0] == "parked":  # the big ones, never driven
                hy.close(sid)
            state, code = _state(reg, sid)
            assert state == "finished", (sid, how, code)
            codes.append(code)
        assert {"finished", "closed", "session_timeout", "session_evicted"} <= set(codes), codes
        # An ordinary request afterwards: the engine serves, and the finished ids reach the runner.
        assert hy.run_plain(f"after-{cycle}", {"prompt_token_ids": prompts[0]}, params)[-1].finished
        for _ in range(3):
            hy.step()
        _forget_finished(reg)
        assert _sizes(llm, hy) == base, cycle


def test_a_sampled_session_ending_on_an_idle_engine_frees_its_generator(llm, hy):
    runner = _core(llm).model_executor.driver_worker.worker.model_runner
    gens = runner.hyco.gens
    s = hy.open(prompt_token_ids=[2, 40, 41, 42, 43], temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
    hy.submit(s.sid, 0, [s.root], [-1])
    assert s.engine_req_id in gens
    hy.close(s.sid)
    for _ in range(2):
        hy.step()  # nothing else runs: the finished id reaches the worker in an empty step
    assert s.engine_req_id not in gens


def test_top_k_without_top_p_on_an_ordinary_request_keeps_the_engine_serving(llm, hy):
    """A HyCo engine has speculative decoding configured, so vLLM runs its rejection sampler even when no
    request carries a draft row; its top-k over zero rows crashed the CPU engine (top_k set, top_p 1)."""
    from vllm import SamplingParams

    a, b = (llm.generate({"prompt_token_ids": [2, 40, 41, 42, 43]},
                         SamplingParams(temperature=1.0, top_k=8, seed=11, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids for _ in range(2))
    assert len(a) == 8 and list(a) == list(b)  # seeded: the same tokens twice
    s = hy.open(prompt_token_ids=[2, 40, 41, 42, 43], max_tokens=4, ignore_eos=True)
    v = hy.submit(s.sid, 0, [s.root], [-1])
    assert v.bonus is not None
    hy.close(s.sid)
