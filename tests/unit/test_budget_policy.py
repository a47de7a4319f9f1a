"""The adaptive node budget (vllm_hyco.spec_decode.budget): cost fit, acceptance estimate, cut rule.

Synthetic numbers only: step costs from known linear models (with seeded noise), acceptance from known
conditional rates by depth. Asserted: flat cost keeps whole trees, steep cost keeps short ones, load
shortens trees, inflated phone values never add rows, the estimate is calibrated on logged rounds.
"""

import numpy as np
import pytest

from vllm_hyco.errors import TreeValidationError
from vllm_hyco.handoff.tree_contract import NodeLabel
from vllm_hyco.spec_decode.budget import (
    PRIOR_ACCEPT,
    AcceptanceModel,
    BudgetPolicy,
    Plan,
    StepCostModel,
    bound_values,
    calibration_error,
    chain_prefix,
    choose_nodes,
    reliability_table,
)

CHAIN8 = [-1, 0, 1, 2, 3, 4, 5, 6, 7]  # root + a chain of 8
# root, chain of 4 (rows 1-4), a runner-up beside each of the first two chain nodes (rows 5, 6),
# SLM leaves under rows 2 and 5 (rows 7, 8): value order as the phone sends it
TREE = [-1, 0, 1, 2, 3, 0, 1, 2, 5]
LABELS = [0, 1, 1, 1, 1, 2, 2, 3, 3]


def fitted(fixed_s: float, per_row_s: float, steps: int = 64, seed: int = 0, **kw) -> StepCostModel:
    rng = np.random.default_rng(seed)
    m = StepCostModel(**kw)
    for _ in range(steps):
        rows = int(rng.integers(1, 200))
        m.observe(rows, rows * int(rng.integers(10, 2000)) / 1000, fixed_s + per_row_s * rows + rng.normal(0, 1e-5))
    return m


def test_rls_recovers_a_linear_step_cost_and_waits_for_enough_steps():
    m = StepCostModel(min_steps=16)
    for rows in (5, 5, 5, 5):
        m.observe(rows, 1.0, 0.01)
    assert not m.ready  # too few steps, one row count
    m = fitted(0.004, 0.0002)
    assert m.ready
    c0, c1, _ = m.coef
    assert c0 == pytest.approx(0.004, rel=0.05) and c1 == pytest.approx(0.0002, rel=0.05)
    assert m.predict(33) == pytest.approx(0.004 + 33 * 0.0002, rel=0.02)
    snap = m.snapshot()
    assert snap["steps"] == 64 and snap["fixed_ms"] == pytest.approx(4.0, rel=0.05)
    assert not m.observe(10, 1.0, float("nan")) and not m.observe(0, 0.0, 0.1)  # junk is not fitted


def test_choose_nodes_flat_cost_keeps_the_whole_tree_steep_cost_a_short_prefix():
    vals = [1.0, 0.8, 0.6, 0.45, 0.3, 0.2, 0.12, 0.07, 0.04]
    assert choose_nodes(vals, fixed=0.01, per_row=0.0) == 8  # flat: every node adds tokens for free
    assert choose_nodes(vals, fixed=1.0, per_row=1e-6) == 8
    assert choose_nodes(vals, fixed=0.001, per_row=1.0) == 1  # steep: the first node only (never 0)
    mid = choose_nodes(vals, fixed=1.0, per_row=0.25)
    assert 1 < mid < 8
    # the rule: no kept node is worth less than its cost at the optimum's tokens per cost
    tokens = 1 + sum(vals[1:mid + 1])
    cost = 1.0 + 0.25 * (mid + 1)
    assert all(v / 0.25 >= tokens / cost for v in vals[1:mid + 1])
    assert vals[mid + 1] / 0.25 < tokens / cost
    assert choose_nodes([1.0], fixed=1.0, per_row=1.0) == 0  # a root-only tree stays root-only


def test_policy_flat_cost_full_trees_steep_cost_short_trees():
    flat, steep = BudgetPolicy(32), BudgetPolicy(32)
    flat.cost, steep.cost = fitted(0.010, 0.0), fitted(0.0001, 0.002)
    a = flat.plan("s", TREE, LABELS)
    b = steep.plan("s", TREE, LABELS)
    assert (a.nodes, a.sent) == (8, 8)
    assert b.nodes == 1 and b.sent == 8
    # load: one fixed cost shared by 64 requests makes rows matter
    mid = BudgetPolicy(32)
    mid.cost = fitted(0.010, 0.0003)
    assert mid.plan("s", CHAIN8, sharing=1).nodes > mid.plan("s", CHAIN8, sharing=64).nodes >= 1


def test_static_policy_and_unfitted_cost_verify_everything():
    pol = BudgetPolicy(32, "static")
    pol.cost = fitted(0.0001, 0.01)
    assert pol.plan("s", TREE, LABELS).nodes == 8 and pol.next_budget(pol.plan("s", TREE)) == 32
    fresh = BudgetPolicy(16)  # adaptive, no steps measured yet: the cap, whole trees
    plan = fresh.plan("s", TREE, LABELS)
    assert plan.nodes == 8 and fresh.next_budget(plan) == 16
    with pytest.raises(ValueError, match="budget_policy"):
        BudgetPolicy(32, "greedy")


def test_next_budget_follows_the_cut_and_grows_back_to_the_cap():
    pol = BudgetPolicy(32)
    pol.cost = fitted(0.0001, 0.002)
    cut = pol.plan("s", TREE, LABELS)
    assert cut.nodes < cut.sent and pol.next_budget(cut) == cut.nodes
    pol.cost = fitted(0.010, 0.0)
    full = pol.plan("s", CHAIN8[:4])
    assert full.nodes == full.sent == 3 and pol.next_budget(full) == 6
    assert pol.next_budget(Plan(30, 30, np.ones(31), np.ones(31))) == 32  # capped
    assert pol.next_budget(cut, first_round=True) == 32  # round 0 is the SLM's tree alone: no evidence yet


def test_the_floor_keeps_at_least_its_nodes_and_grants_them():
    """``budget_floor``: a steep cost that keeps one node alone keeps the floor's (the best prefix of at least
    that many), grants at least the floor, and leaves a tree smaller than the floor whole."""
    vals = [1.0, 0.9, 0.1, 0.05, 0.01, 0.005]
    assert choose_nodes(vals, fixed=0.001, per_row=1.0) == 1
    assert choose_nodes(vals, fixed=0.001, per_row=1.0, least=4) == 4
    assert choose_nodes(vals, fixed=100.0, per_row=1e-6, least=2) == 5  # the floor never lowers a cut
    assert choose_nodes(vals[:3], fixed=0.001, per_row=1.0, least=4) == 2  # fewer nodes than the floor: all
    pol = BudgetPolicy(32, floor=4)
    pol.cost = fitted(0.0001, 0.002)
    cut = pol.plan("s", CHAIN8)
    assert (cut.nodes, cut.sent) == (4, 8) and pol.next_budget(cut) == 4  # the phone learns: 4 were verified
    small = pol.plan("s", CHAIN8[:3])
    assert (small.nodes, small.sent) == (2, 2) and pol.next_budget(small) == 4
    unfloored = BudgetPolicy(32)
    unfloored.cost = pol.cost
    assert unfloored.plan("s", CHAIN8).nodes < 4
    probing = BudgetPolicy(32, floor=3)  # the cost model is not ready: probes never go below the floor
    assert min(probing.plan("s", CHAIN8).nodes for _ in range(5)) == 3
    with pytest.raises(ValueError, match="budget_floor"):
        BudgetPolicy(8, floor=9)


def test_inflated_phone_values_never_raise_a_sessions_rows():
    pol = BudgetPolicy(32)
    pol.cost = fitted(0.002, 0.0004)
    own = pol.plan("s", TREE, LABELS)
    liar = pol.plan("s", TREE, LABELS, phone_values=[1.0] * len(TREE))
    assert liar.nodes == own.nodes and np.allclose(liar.values, own.values)
    humble = pol.plan("s", TREE, LABELS, phone_values=[1.0] + [0.01] * (len(TREE) - 1))
    assert humble.nodes <= own.nodes
    assert np.all(bound_values(np.array([1.0, 0.5]), [9.0, float("nan")]) == [1.0, 0.5])
    with pytest.raises(TreeValidationError):
        pol.plan("s", TREE, LABELS, phone_values=[1.0, 0.5])


def test_node_values_are_path_products_and_siblings_share_their_parent():
    m = AcceptanceModel()
    v = m.node_values(TREE, LABELS)
    assert v[0] == 1.0 and v[1] == pytest.approx(PRIOR_ACCEPT)
    assert v[2] == pytest.approx(PRIOR_ACCEPT**2)
    assert v[5] == pytest.approx(PRIOR_ACCEPT * (1 - PRIOR_ACCEPT))  # a runner-up: the chain node failed
    for j in range(1, len(TREE)):
        assert v[j] <= v[TREE[j]] + 1e-12
    kids = [j for j in range(1, len(TREE)) if TREE[j] == 0]
    assert sum(v[j] for j in kids) <= 1.0 + 1e-9  # at most one child of the root is accepted
    # five SLM siblings beside the chain's first node share what it leaves; they do not lower it (a
    # proportional share would have: the chain then fell behind the SLM nodes in a phone's value order)
    wide = [-1, 0, 1, 0, 0, 0, 0, 0]
    w = m.node_values(wide, [0, 1, 1, 3, 3, 3, 3, 3])
    assert w[1] == pytest.approx(PRIOR_ACCEPT) and w[2] == pytest.approx(PRIOR_ACCEPT ** 2)
    assert w[3] == pytest.approx(PRIOR_ACCEPT * (1 - PRIOR_ACCEPT))  # the likeliest SLM sibling, in full
    assert w[4] == pytest.approx(1 - PRIOR_ACCEPT - w[3]) and w[5:].sum() == 0.0  # then what is left
    assert w[[1, 3, 4, 5, 6, 7]].sum() == pytest.approx(1.0)


def _simulate(model: AcceptanceModel, rounds: int, rng, sid="s", log=None):
    """Rounds on TREE with known conditional acceptance: chain 0.8, runner-up 0.3, SLM 0.5 per edge;
    siblings exclusive (a runner-up is tried only when the chain node beside it was rejected)."""
    truth = {NodeLabel.CHAIN: 0.8, NodeLabel.RUNNER_UP: 0.3, NodeLabel.SLM: 0.5}
    kids = {p: [j for j in range(1, len(TREE)) if TREE[j] == p] for p in range(len(TREE))}
    for _ in range(rounds):
        pred = model.node_values(TREE, LABELS, sid)
        path, node = [], 0
        while kids[node]:
            nxt = None
            for j in kids[node]:  # chain first, then its runner-up
                if rng.random() < truth[NodeLabel(LABELS[j])]:
                    nxt = j
                    break
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        model.observe(sid, TREE, LABELS, path)
        if log is not None:
            hit = np.zeros(len(TREE))
            hit[path] = 1
            log.append((pred[1:], hit[1:]))


def test_the_estimate_learns_conditional_acceptance_and_is_calibrated():
    rng = np.random.default_rng(7)
    m = AcceptanceModel()
    _simulate(m, 400, rng)
    cond = m.conditional("s")
    assert cond[1, NodeLabel.CHAIN] == pytest.approx(0.8, abs=0.08)
    # given its parent: tried only when the chain node beside it is rejected, (1 - 0.8) * 0.3
    assert cond[1, NodeLabel.RUNNER_UP] == pytest.approx(0.06, abs=0.04)
    log = []
    _simulate(m, 2000, rng, log=log)
    pred = np.concatenate([p for p, _ in log])
    obs = np.concatenate([o for _, o in log])
    table = reliability_table(pred, obs, bins=10)
    assert sum(r["n"] for r in table) == len(pred)
    assert calibration_error(table) < 0.05, table
    # an uncalibrated predictor has a large error on the same rounds (the table has teeth)
    assert calibration_error(reliability_table(np.full_like(pred, 0.9), obs)) > 0.3


def test_sessions_shrink_to_the_engine_estimate_and_are_forgotten():
    rng = np.random.default_rng(3)
    m = AcceptanceModel()
    _simulate(m, 300, rng, sid="a")
    new = m.conditional("b")[1, NodeLabel.CHAIN]  # a new session starts from the engine-wide estimate
    assert new == pytest.approx(m.conditional(None)[1, NodeLabel.CHAIN])
    assert abs(new - 0.8) < abs(PRIOR_ACCEPT - 0.8)
    m.forget("a")
    assert "a" not in m.sessions


def test_policy_logs_predictions_for_the_reliability_table():
    pol = BudgetPolicy(32)
    plan = pol.plan("s", TREE, LABELS)
    pol.observe_round("s", TREE, LABELS, [1, 2], plan.predicted)
    table = pol.reliability()
    assert sum(r["n"] for r in table) == len(TREE) - 1


def test_the_budget_and_the_cost_fit_are_prometheus_metrics():
    from prometheus_client import REGISTRY

    from vllm_hyco.engine_contract import BudgetInfo, CostFit
    from vllm_hyco.serving import metrics

    m = metrics.get()
    before = REGISTRY.get_sample_value("vllm_hyco_node_budget_count") or 0.0
    pol = BudgetPolicy(32)
    pol.cost = fitted(0.004, 0.0002)
    info = BudgetInfo(pol.policy, pol.cap, nodes_sent=8, nodes_verified=5,
                      cost=CostFit.from_snapshot(pol.cost.snapshot()))
    m.node_budget(info, 6)
    assert REGISTRY.get_sample_value("vllm_hyco_node_budget_count") == before + 1
    assert REGISTRY.get_sample_value("vllm_hyco_verified_nodes_bucket", {"le": "8.0"}) >= 1
    fixed = REGISTRY.get_sample_value("vllm_hyco_step_cost_seconds", {"term": "fixed"})
    assert fixed == pytest.approx(0.004, rel=0.05)
    assert REGISTRY.get_sample_value("vllm_hyco_step_cost_steps") == 64


def test_engine_core_time_is_counted_apart_from_the_model_calls(monkeypatch, tmp_path):
    from vllm_hyco.vllm_adapter.patches import step_timing as t

    monkeypatch.setenv(t.ENV, "1")
    timer = t.EngineTimer(str(tmp_path))
    monkeypatch.setattr(t, "TIMER", timer)
    t.add_core(0.5, 0.25)  # a HyCo utility call (or a wrapped EngineCore.step)
    timer.add("execute_s", 0.1, rows=3)
    snap = timer.snapshot()
    assert (snap["core_s"], snap["core_cpu_s"], snap["busy_s"]) == (0.5, 0.25, 0.1)
    import time

    for _ in range(500):  # the flusher thread writes the file within FLUSH_S of the last change
        total = t.read_dir(tmp_path)
        if total["busy_s"]:
            break
        time.sleep(t.FLUSH_S)
    assert (total["core_s"], total["busy_s"]) == (0.5, 0.1)


def test_per_tree_cost_is_fitted_apart_from_rows_and_lengthens_the_cut():
    # steps of 1-64 requests with 1-16 rows each: a request costs 1 ms whatever its rows, a row 0.2 ms
    rng = np.random.default_rng(3)
    m = StepCostModel(min_steps=16)
    for _ in range(200):
        reqs = int(rng.integers(1, 65))
        rows = int(reqs * rng.integers(1, 17))
        m.observe(rows, 0.0, 0.008 + 0.0002 * rows + 0.001 * reqs + rng.normal(0, 1e-5), reqs)
    c0, c1, _ = m.coef
    assert c0 == pytest.approx(0.008, rel=0.05) and c1 == pytest.approx(0.0002, rel=0.05)
    assert m.per_tree == pytest.approx(0.001, rel=0.05)
    assert m.predict(80, 0.0, 16) == pytest.approx(0.008 + 0.016 + 0.016, rel=0.02)
    assert m.snapshot()["per_tree_ms"] == pytest.approx(1.0, rel=0.05)
    # at 64 trees a step the per-request millisecond is the session's own fixed cost: a row-only model
    # of the same steps would charge it to rows and keep a shorter prefix
    with_req = BudgetPolicy(32)
    with_req.cost = m
    rows_only = BudgetPolicy(32)
    rows_only.cost = fitted(0.008, 0.0002 + 0.001 / 8)  # the request's cost spread over 8 rows
    vals = [1.0, 0.85, 0.7, 0.56, 0.45, 0.36, 0.29, 0.23, 0.18]
    a = choose_nodes(vals, fixed=c0 / 64 + m.per_tree, per_row=m.marginal(0))
    assert with_req.plan("s", CHAIN8, sharing=64).nodes >= rows_only.plan("s", CHAIN8, sharing=64).nodes
    assert a > choose_nodes(vals, fixed=c0 / 64, per_row=m.marginal(0))


def test_a_lone_phone_probes_smaller_trees_until_the_fit_can_tell_rows_from_the_step():
    # one phone sending full 32-node trees: every step has 33 rows, so without probing no per-row cost
    # could ever be fitted (the model never gets ready and the policy stays static)
    flat = StepCostModel(min_steps=16)
    for _ in range(40):
        flat.observe(33, 1.0, 0.010 + 0.0003 * 33)
    assert not flat.spread and not flat.ready
    pol = BudgetPolicy(32)
    tree = TREE + [8 + i for i in range(24)]  # a chain of 4, then branches: 32 nodes
    assert chain_prefix(tree) == 4
    sizes = []
    for _ in range(20):
        plan = pol.plan("s", tree, LABELS + [3] * 24)
        sizes.append(plan.nodes)
        # a probe grants what it kept (the phone counts min(sent, budget) nodes as verified)
        assert pol.next_budget(plan) == (plan.nodes if plan.nodes < 32 else 32)
        rows = plan.nodes + 1
        branching = int(plan.nodes > 4)
        pol.observe_step(rows, 0.05 * rows, 0.010 + 0.0003 * rows + 0.0015 * branching, 1, branching)
    # all, the chain, a quarter, the chain and one node more, a half, in turn, until the model is ready
    assert sizes[:6] == [32, 4, 8, 5, 16, 32]
    assert pol.cost.ready and pol.probes == 16 and len(set(sizes[16:])) == 1  # then the cut alone
    c0, c1, _ = pol.cost.coef
    assert c0 + pol.cost.per_tree == pytest.approx(0.010, rel=0.05) and c1 == pytest.approx(0.0003, rel=0.05)
    assert pol.cost.per_branching == pytest.approx(0.0015, rel=0.05)
    static = BudgetPolicy(32, "static")  # the paper's budget never probes
    assert static.plan("s", tree).nodes == 32 and static.plan("s", tree).nodes == 32


def test_branching_cost_is_fitted_and_the_cut_prefers_a_chain_when_branching_costs():
    assert chain_prefix(TREE) == 4 and chain_prefix(CHAIN8) == 8 and chain_prefix([-1, 0, 0]) == 1
    # steps of 1-32 trees, some of them chains: a tree that is not a chain costs 0.5 ms more
    rng = np.random.default_rng(5)
    m = StepCostModel(min_steps=16)
    for _ in range(300):
        reqs = int(rng.integers(1, 33))
        branching = int(rng.integers(0, reqs + 1))
        rows = int(reqs * rng.integers(2, 17))
        m.observe(rows, 0.0, 0.008 + 0.0002 * rows + 0.001 * reqs + 0.0005 * branching + rng.normal(0, 1e-5),
                  reqs, branching)
    assert m.per_branching == pytest.approx(0.0005, rel=0.05) and m.per_tree == pytest.approx(0.001, rel=0.05)
    assert m.snapshot()["per_branching_ms"] == pytest.approx(0.5, rel=0.05)
    assert m.predict(40, 0.0, 4, 2) == pytest.approx(0.008 + 0.008 + 0.004 + 0.001, rel=0.02)
    # TREE's first 4 nodes are its chain; keeping its 5th (a runner-up) makes it a branching tree, which
    # pays the branching cost too
    vals = [1.0, 0.8, 0.6, 0.45, 0.3, 0.25, 0.2, 0.1, 0.05]
    free = choose_nodes(vals, fixed=0.002, per_row=0.0002, branch=0.0, chain=4)
    dear = choose_nodes(vals, fixed=0.002, per_row=0.0002, branch=0.002, chain=4)
    assert free > 4 and dear == 4
    assert choose_nodes(vals, fixed=0.002, per_row=0.0002, branch=0.002) == free  # no chain given: no term


def test_prefill_steps_do_not_charge_the_trees_own_work_to_branching():
    """One phone: prefill steps (a plain request, no tree) between rounds whose trees are chains or
    branching trees of similar size. The tree's own work (decision, compaction, hand-off) is the per-tree
    term and the tree attention the branching term; a prefill pays neither."""
    rng = np.random.default_rng(9)
    m = StepCostModel(min_steps=16)
    for i in range(120):
        if i % 8 == 0:  # a prefill of 30-60 rows
            rows, trees, branching, plain = int(rng.integers(30, 61)), 0, 0, 1
        else:
            rows = int(rng.choice([5, 6, 9, 17, 33]))
            trees, branching, plain = 1, int(rows > 5), 0
        secs = 0.010 + 0.0003 * rows + 0.004 * trees + 0.0013 * branching + 0.0005 * plain
        m.observe(rows, rows * 0.05, secs + rng.normal(0, 2e-5), trees, branching, plain)
    assert m.per_branching == pytest.approx(0.0013, abs=2e-4)
    assert m.coef[1] == pytest.approx(0.0003, rel=0.1)
    assert m.coef[0] + m.per_tree == pytest.approx(0.014, rel=0.05)  # the cut's fixed cost at one tree a step
    assert m.predict(40, 2.0, 0, 0, 1) == pytest.approx(0.0105 + 0.012, rel=0.02)  # a prefill
    assert m.predict(9, 0.45, 1, 1) == pytest.approx(0.014 + 0.0027 + 0.0013, rel=0.02)
    assert m.snapshot()["per_plain_ms"] == pytest.approx(m.per_plain * 1e3, rel=1e-6)


def test_cost_model_charges_the_mtp_head_to_ordinary_requests_not_to_tree_rows():
    """Under mixed load (phones' trees beside ordinary requests drafted by vLLM's MTP, K per batch size) the
    head's forward passes are the ``head`` term: the per-row cost a tree's cut uses stays the rows' own."""
    rng = np.random.default_rng(4)
    m = StepCostModel(min_steps=16)
    for _ in range(200):
        trees, plain = int(rng.integers(0, 5)), int(rng.integers(0, 9))
        k = 4 if trees + plain <= 6 else 2  # vLLM's per-batch-size K
        rows = sum(int(rng.choice([5, 9, 17, 33])) for _ in range(trees)) + plain * (1 + k)
        if rows == 0:
            continue
        head = plain * k
        secs = 0.008 + 0.0003 * rows + 0.004 * trees + 0.0005 * plain + 0.0011 * head
        m.observe(rows, rows * 0.05, secs + rng.normal(0, 2e-5), trees, 0, plain, head)
    assert m.per_head == pytest.approx(0.0011, rel=0.1)
    assert m.coef[1] == pytest.approx(0.0003, rel=0.1)
    assert m.snapshot()["per_head_ms"] == pytest.approx(m.per_head * 1e3, rel=1e-6)
