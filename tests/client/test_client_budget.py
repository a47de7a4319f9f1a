"""The phone's side of the adaptive node budget: trees sent in value order, never more nodes than granted.

Value order (``mobile_client.tree.value_order``): Algorithm 3's node set is unchanged, parents come before
children, and every prefix of k nodes is the k best nodes (``trim(tree, k)``), so a server that verifies
only a prefix verifies the most valuable tree of that size.
"""

import math

import numpy as np
import pytest

from mobile_client.session import PhoneSession, SessionOptions
from mobile_client.tree import DraftTree, build_draft_tree, trim, value_order
from vllm_hyco.errors import ConfigError
from vllm_hyco.handoff import (
    HandoffPayload,
    HandoffScales,
    HandoffSpec,
    LayerSpec,
    SessionFrame,
    VerdictFrame,
    openai_chunk,
)
from vllm_hyco.handoff.tree_contract import validate_tree

LAYERS = (LayerSpec(2, "sliding", kv_heads=2, head_dim=4, window=8),)
SCALES = HandoffScales(np.full(6, 0.5, np.float32), np.full(6, 0.25, np.float32),
                       ((2, np.full((2, 4), 0.1, np.float32), np.full((2, 4), 0.2, np.float32)),))
SPEC = HandoffSpec.from_scales({"model_type": "toy"}, LAYERS, SCALES)


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Each node as the tokens on its path from the root (row-order independent)."""
    return {tuple(tree.tokens[r] for r in tree.path(i)) for i in range(len(tree.tokens))}


def _random_tree(seed: int, node_budget: int = 32) -> DraftTree:
    rng = np.random.default_rng(seed)
    V, K = 64, 4
    chain = [int(t) for t in rng.choice(V, K, replace=False)]
    runner_ups = [int((c + 1) % V) for c in chain[:2]]
    lp = rng.normal(0, 2.0, size=(1 + K + 2, V))
    lp = lp - np.log(np.exp(lp).sum(axis=1, keepdims=True))
    return build_draft_tree(int(rng.integers(V)), chain, runner_ups, lp, node_budget=node_budget)


@pytest.mark.parametrize("seed", range(6))
def test_value_order_keeps_algorithm_3s_node_set_and_every_prefix_is_the_best_tree(seed):
    tree = _random_tree(seed)
    ordered = value_order(tree)
    assert _paths(ordered) == _paths(tree) and ordered.num_nodes == tree.num_nodes
    assert sorted(ordered.scores) == sorted(tree.scores)
    assert list(ordered.scores[1:]) == sorted(ordered.scores[1:], reverse=True)
    validate_tree(ordered.tokens, ordered.parents, vocab_size=64, labels=ordered.sources)  # parents first
    for k in (1, 2, 5, 9, 17, tree.num_nodes):
        prefix = DraftTree(ordered.tokens[:k + 1], ordered.parents[:k + 1], ordered.scores[:k + 1],
                           ordered.sources[:k + 1])
        assert _paths(prefix) == _paths(trim(tree, k)), k


def test_a_smaller_budget_drafts_the_prefix_of_the_bigger_tree():
    big, small = value_order(_random_tree(11, node_budget=32)), value_order(_random_tree(11, node_budget=8))
    assert big.tokens[:9] == small.tokens and big.parents[:9] == small.parents


class Chain:
    """A budget-respecting drafter: ``node_budget`` nodes, one chain and a low-scoring sibling first in
    insertion order (so value order moves it last)."""

    def __init__(self):
        self.asked = []

    def propose(self, context, node_budget):
        self.asked.append(node_budget)
        r, a = context.root, math.log(0.66)
        tokens = [r, r + 100] + [r + 1 + i for i in range(node_budget - 1)]
        parents = [-1, 0] + [0] + list(range(2, node_budget))
        scores = [0.0, 40 * a] + [a * (i + 1) for i in range(node_budget - 1)]
        return DraftTree(tuple(tokens[:node_budget + 1]), tuple(parents[:node_budget + 1]),
                         tuple(scores[:node_budget + 1]), tuple([0] + [1] * node_budget), node_budget)


def _verdict(rnd, path, tokens, budget, root):
    """Verdict ``rnd`` committing ``tokens`` (path + bonus), its hand-off at the new root ``root``."""
    h = HandoffPayload.make_dummy(SPEC, 0, root, tokens[-1], salt=rnd)
    chunk = openai_chunk("text_completion", "c", "m", "", None, created=0)
    return VerdictFrame(rnd, tuple(path), tuple(tokens), tokens[-1], h, None, budget, chunk)


def test_the_phone_drafts_no_more_nodes_than_the_last_verdict_granted():
    d = Chain()
    s = PhoneSession(d, prompt_tokens=[5, 6, 7], request={"prompt": [5, 6, 7]}, endpoint="completions",
                     spec=SPEC, options=SessionOptions(node_budget=16, order="score"))
    s.apply_session(SessionFrame("hyco." + "0" * 32, -1, 16, SPEC))  # protocol v2: the session frame first
    frame = s.next_tree()
    assert d.asked == [16] and len(frame.tokens) - 1 == 16
    assert frame.tokens[-1] == 7 + 100  # the low-score sibling goes last: a prefix drops it first
    s.apply_verdict(_verdict(0, [1], [frame.tokens[1], 40], 3, root=4))  # prompt root at 2, +2
    frame = s.next_tree()
    assert d.asked[-1] == 3 and len(frame.tokens) - 1 == 3
    s.apply_verdict(_verdict(1, [], [41], 1, root=5))
    assert len(s.next_tree().tokens) - 1 == 1 and d.asked[-1] == 1
    s.apply_verdict(_verdict(2, [], [42], 32, root=6))
    assert len(s.next_tree().tokens) - 1 == 16  # never past the phone's own node_budget


class ChainAndRunnerUp:
    """A K = 4 chain and a runner-up beside its first node that outscores the chain's last two nodes
    (Algorithm 3: a runner-up at depth 1 scores 2a, the chain's third node 3a)."""

    def propose(self, context, node_budget):
        r, a = context.root, math.log(0.66)
        tokens = (r, r + 1, r + 2, r + 3, r + 4, r + 50)
        parents = (-1, 0, 1, 2, 3, 0)
        scores = (0.0, a, 2 * a, 3 * a, 4 * a, 2 * a)
        return DraftTree(tokens, parents, scores, (0, 1, 1, 1, 1, 2), 5)


def _chain_and_runner_up_session(**options) -> PhoneSession:
    """A started session (prompt [5, 6, 7], 16 nodes granted) drafting ``ChainAndRunnerUp``'s tree."""
    s = PhoneSession(ChainAndRunnerUp(), prompt_tokens=[5, 6, 7], request={"prompt": [5, 6, 7]},
                     endpoint="completions", spec=SPEC, options=SessionOptions(**options))
    s.apply_session(SessionFrame("hyco." + "0" * 32, -1, 16, SPEC))
    return s


def test_the_learned_order_puts_a_chain_the_server_keeps_accepting_before_the_runner_up():
    s = _chain_and_runner_up_session(node_budget=16, order="learned")
    root = 7
    frame = s.next_tree()
    assert frame.tokens[:4] == (root, root + 1, root + 2, root + 3)  # the prior: chain first up to depth 3
    orders = []
    for rnd in range(12):  # every round the whole chain is accepted
        chain = [frame.tokens.index(root + i) for i in (1, 2, 3, 4)]
        new_root = 100 + rnd
        s.apply_verdict(_verdict(rnd, chain, [root + 1, root + 2, root + 3, root + 4, new_root], 5,
                                 root=2 + 5 * (rnd + 1)))
        root = new_root
        frame = s.next_tree()
        orders.append(frame.tokens)
    assert orders[-1] == (root, root + 1, root + 2, root + 3, root + 4, root + 50)  # the runner-up last
    # granted 4 nodes: the head of the learned order is the whole chain (Algorithm 3's tree of 4 would
    # have kept the runner-up and dropped the chain's last node)
    s.apply_verdict(_verdict(12, [1, 2, 3, 4], [root + 1, root + 2, root + 3, root + 4, 200], 4, root=2 + 5 * 13))
    assert s.next_tree().tokens == (200, 201, 202, 203, 204)
    score = _chain_and_runner_up_session(order="score")
    assert score.next_tree().tokens == (7, 8, 9, 57, 10, 11)  # Algorithm-3 order: the runner-up third
    with pytest.raises(ConfigError, match="order"):
        SessionOptions(order="random")
    # "auto": the chain first in exact mode, the learned order in epsilon mode
    assert SessionOptions().tree_order == "chain"
    assert SessionOptions(mode="epsilon").tree_order == "learned"


def test_the_chain_order_sends_the_whole_chain_first_whatever_was_learned():
    s = _chain_and_runner_up_session(node_budget=16, order="chain")
    root = 7
    frame = s.next_tree()
    for rnd in range(12):  # every round the runner-up is accepted and the chain is not: learned would put it first
        new_root = 100 + rnd
        s.apply_verdict(_verdict(rnd, [frame.tokens.index(root + 50)], [root + 50, new_root], 5,
                                 root=2 + 2 * (rnd + 1)))
        root = new_root
        frame = s.next_tree()
        # every prefix of at most 4 nodes is a chain: the server verifies it with vLLM's own attention
        assert frame.tokens == (root, root + 1, root + 2, root + 3, root + 4, root + 50)
        assert frame.parents == (-1, 0, 1, 2, 3, 0)


def test_rows_past_the_granted_budget_are_not_counted_as_failures():
    """A cut tree: the verdict's budget (the nodes the server kept) bounds the rows the phone counts as
    tried; the untried rest does not lower its estimates. Round 0 (granted the cap whatever was verified)
    is not counted."""
    s = PhoneSession(ChainAndRunnerUp(), prompt_tokens=[5, 6, 7], request={"prompt": [5, 6, 7]},
                     endpoint="completions", spec=SPEC, options=SessionOptions(node_budget=16))
    s.apply_session(SessionFrame("hyco." + "0" * 32, -1, 16, SPEC))
    s.next_tree()
    s.apply_verdict(_verdict(0, [], [60], 16, root=3))
    assert s.acceptance.engine.trials.sum() == 0
    frame = s.next_tree()
    assert frame.tokens[1:3] == (61, 62)
    s.apply_verdict(_verdict(1, [1, 2], [61, 62, 70], 2, root=6))  # the server kept 2 nodes, both accepted
    assert s.acceptance.engine.trials.sum() == pytest.approx(2.0)
    assert s.acceptance.engine.accepted.sum() == pytest.approx(2.0)
