"""The engine contract (vllm_hyco/engine_contract.py): every object that crosses between the three processes
survives its one encode and one decode, through msgpack as vLLM's utility transport carries it (untyped on
the way back), and a typed error crosses as a Refusal that the caller raises with its class and code."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from vllm_hyco.engine_contract import (
    UTILITY_METHODS,
    BudgetInfo,
    CostFit,
    EngineStats,
    Handoff,
    HandoffSeed,
    KVRows,
    Refusal,
    RoundVerdict,
    SessionInfo,
    TreeAccepted,
    TreeSubmission,
    TreeVerdict,
    decode_result,
    encode_result,
)
from vllm_hyco.errors import EngineError, HycoError, RequestFieldError, SessionError, TreeValidationError


def _transport(obj):
    """What vLLM's utility transport does to a result: msgpack out, untyped msgpack back."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=False)


def _rows(n: int, heads: int = 2, dim: int = 4, start: int = 0) -> KVRows:
    k = torch.arange(start, start + n * heads * dim, dtype=torch.int8).view(n, heads, dim)
    return KVRows(k, -k)


def _verdict(seed: bool) -> RoundVerdict:
    handoff = Handoff(position=12, start=10, e_bonus=torch.arange(8, dtype=torch.int8),
                      h=torch.arange(8, 16, dtype=torch.int8), layers={"full": "m.layers.3", "sliding": "m.layers.2"},
                      kv={"full": _rows(3), "sliding": _rows(3, start=5)},
                      seed=HandoffSeed(0, 13, {"full": _rows(13), "sliding": _rows(13)}) if seed else None)
    tree = TreeVerdict(round=0 if seed else 4, path_rows=(1, 3), bonus=77, hits=2, num_rows=5, root_pos=10,
                       samples=(5, 6, -1, 8, -1), handoff=handoff, host_s=0.25)
    cost = CostFit(fixed_ms=1.0, per_row_ms=0.1, per_krow_ctx_ms=0.01, per_tree_ms=0.2, per_branching_ms=0.3,
                   per_plain_ms=0.4, per_head_ms=0.1, steps=20, ready=True, rmse_ms=None)
    return RoundVerdict(tree, committed=(11, 13, 77), finish_reason=None, node_budget=16,
                        budget_info=BudgetInfo("adaptive", 32, nodes_sent=4, nodes_verified=4, cost=cost))


def _same_handoff(a: Handoff, b: Handoff) -> None:
    assert (a.position, a.start, dict(a.layers)) == (b.position, b.start, dict(b.layers))
    for x, y in ((a.e_bonus, b.e_bonus), (a.h, b.h)):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    for kind in a.kv:
        assert np.array_equal(np.asarray(a.kv[kind].k), b.kv[kind].k) and np.asarray(b.kv[kind].k).dtype == np.int8
        assert np.array_equal(np.asarray(a.kv[kind].v), b.kv[kind].v)
    assert (a.seed is None) == (b.seed is None)
    if a.seed is not None:
        assert (a.seed.start, a.seed.end) == (b.seed.start, b.seed.end)
        for kind in a.seed.kv:
            assert np.array_equal(np.asarray(a.seed.kv[kind].k), b.seed.kv[kind].k)


@pytest.mark.parametrize("seed", [True, False], ids=["round-0-seed", "later-round"])
def test_round_verdict_survives_the_utility_transport(seed):
    sent = _verdict(seed)
    got = decode_result("hyco_take_verdict", _transport(encode_result(sent)))
    assert isinstance(got, RoundVerdict) and got.tree.handoff is not None
    assert (got.committed, got.finish_reason, got.node_budget, got.budget_info) == (
        sent.committed, sent.finish_reason, sent.node_budget, sent.budget_info)
    t, s = got.tree, sent.tree
    assert (t.round, t.path_rows, t.bonus, t.hits, t.num_rows, t.root_pos, t.samples, t.host_s, t.end_row) == (
        s.round, s.path_rows, s.bonus, s.hits, s.num_rows, s.root_pos, s.samples, s.host_s, 3)
    _same_handoff(s.handoff, t.handoff)


def test_tree_submission_is_normalised_and_round_trips():
    tree = TreeSubmission(sid="s1", round=2, tokens=[7, 11, 12], parents=np.array([-1, 0, 1]), labels=[0, 1, 1],
                          values=[1, 0.5, 0.25], draft_q={2: ([12, 13], [3, 1])})
    assert tree.tokens == (7, 11, 12) and tree.parents == (-1, 0, 1) and tree.values == (1.0, 0.5, 0.25)
    assert tree.draft_q == {2: ((12, 13), (3, 1))}
    wire = _transport(tree.to_wire())
    assert wire["draft_q"] == [[2, [12, 13], [3, 1]]]  # records, not int-keyed maps
    assert TreeSubmission.from_wire(wire) == tree and TreeSubmission.from_wire(tree) is tree
    with pytest.raises(EngineError, match="TreeSubmission crossing .* is malformed"):
        TreeSubmission.from_wire({"sid": "s1", "round": 0})


@pytest.mark.parametrize("value", [
    TreeAccepted("s1", 3, 9),
    SessionInfo("s1", "hyco-s1-x", "parked", 4, None, (3,), root=5, root_position=40),
    SessionInfo("s2", "hyco-s2-x", "server", 5, None, (), root=9, root_position=51, mode="server", seed_due=False,
                server_steps=3, server_tokens=7),
    EngineStats(live=2, parked=1, kv_blocks_used=10, kv_blocks_total=99),
])
def test_small_results_round_trip(value):
    method = {TreeAccepted: "hyco_submit_tree", SessionInfo: "hyco_session_info", EngineStats: "hyco_stats"}
    assert decode_result(method[type(value)], _transport(encode_result(value))) == value


def test_plain_results_pass_through():
    assert decode_result("hyco_close", _transport(encode_result(True))) is True
    assert decode_result("hyco_poll", _transport(encode_result(["a", "b"]))) == ["a", "b"]
    assert set(UTILITY_METHODS) == {"hyco_submit_tree", "hyco_take_verdict", "hyco_session_info", "hyco_set_mode",
                                    "hyco_close", "hyco_poll", "hyco_stats"}


@pytest.mark.parametrize("error", [
    SessionError("all 2 batch slots are busy", code="server_busy"),
    TreeValidationError("root token 5 is not the last committed token 6", code="bad_root"),
    RequestFieldError("top_k", "top_k: must be an integer", code="bad_request"),
    HycoError("something", code="weird"),
])
def test_a_refusal_raises_the_same_class_code_and_field_on_the_callers_side(error):
    wire = _transport(encode_result(error))
    assert Refusal.from_wire(wire) == Refusal.of(error)
    with pytest.raises(type(error)) as got:
        decode_result("hyco_submit_tree", wire)
    assert got.value.code == error.code and str(got.value) == str(error)
    assert getattr(got.value, "field", None) == getattr(error, "field", None)


def test_a_malformed_verdict_is_an_engine_error_not_a_key_error():
    wire = _transport(encode_result(_verdict(False)))
    del wire["bonus"]
    with pytest.raises(EngineError, match="RoundVerdict crossing between the API server and the engine core"):
        decode_result("hyco_take_verdict", wire)


def test_the_engine_core_adds_exactly_the_contracts_utility_methods():
    pytest.importorskip("vllm")
    from vllm_hyco.vllm_adapter.patches import engine_core_methods

    assert [fn.__name__ for fn in engine_core_methods.METHODS] == list(UTILITY_METHODS)
    assert [p.attr for p in engine_core_methods.PATCHES] == list(UTILITY_METHODS)
