"""Phone values earn trust only as far as the session's own verdicts show them to predict (spec_decode/trust.py):
a phone that inflates every value gets exactly the rows the server's own estimate gives it (no more), and a
phone whose values are calibrated and informative (it knows which rounds' chains hold) gets the benefit: fewer
rows verified on the rounds its chain fails, more on the ones it holds, and less server cost per committed
token. Synthetic rounds, a fitted cost model, no engine."""

import random

import numpy as np

from vllm_hyco.spec_decode.budget import BudgetPolicy
from vllm_hyco.spec_decode.trust import ValueTrust

DEPTH = 16
PARENTS = [-1, *range(DEPTH)]  # a chain of 16 nodes
LABELS = [0] + [1] * DEPTH
EASY, HARD = 0.97, 0.25  # per-node acceptance of a round's chain, given its parent was accepted


def run(kind: str, rounds: int = 600, seed: int = 0) -> dict:
    rng = random.Random(seed)
    pol = BudgetPolicy(DEPTH, "adaptive", min_steps=4)
    for rows in (2, 5, 9, 17, 3, 12, 7, 17):  # a fitted cost: 8 ms a step, 1 ms a row
        pol.observe_step(rows, 0.1, 0.008 + 0.001 * rows)
    assert pol.cost.ready
    verified = accepted = 0
    cost = 0.0
    for _ in range(rounds):
        a = EASY if rng.random() < 0.5 else HARD
        truth = [1.0] + [a ** d for d in range(1, DEPTH + 1)]
        phone = None if kind == "none" else [1.0] * (DEPTH + 1) if kind == "inflated" else truth
        plan = pol.plan("s", PARENTS, LABELS, phone, ctx=100, sharing=1)
        n = plan.nodes
        path = []
        for row in range(1, n + 1):
            if rng.random() >= a:
                break
            path.append(row)
        pol.observe_round("s", PARENTS[: n + 1], LABELS[: n + 1], path, plan.predicted, plan.phone)
        verified += n
        accepted += len(path) + 1
        cost += 0.008 + 0.001 * (n + 1)
    return {"verified": verified, "tokens": accepted, "ms_per_token": 1e3 * cost / accepted,
            "weight": pol.trust.weight("s")}


def test_an_inflating_phone_gets_no_more_rows_than_its_verdicts_justify():
    none, inflated = run("none"), run("inflated")
    assert inflated["weight"] == 0.0
    assert inflated["verified"] <= 1.005 * none["verified"]  # the server's own estimate, up to its first rounds
    assert inflated["ms_per_token"] >= 0.995 * none["ms_per_token"]


def test_a_calibrated_phone_gets_the_benefit():
    none, calibrated = run("none"), run("calibrated")
    assert calibrated["weight"] > 0.5
    assert calibrated["ms_per_token"] < 0.9 * none["ms_per_token"], (calibrated, none)


def test_trust_needs_evidence_and_skill():
    t = ValueTrust()
    server = np.array([1.0, 0.6, 0.36])
    assert t.values("s", server, [1.0, 1.0, 1.0]).tolist() == server.tolist()  # no evidence: the bound
    for _ in range(200):  # values that say nothing the depth does not: always 0.9, while depth 1 holds, 2 fails
        t.observe("s", server, [1.0, 0.9, 0.9], np.array([True, True, False]), [0, 1, 2])
    assert t.weight("s") == 0.0
    assert abs(t.calibrated("s", server, np.array([1.0, 0.9, 0.9]))[1] - 0.5) < 0.05  # mapped to what was seen
