"""HyCo-2P (Algorithm 3 line 15) on the phone's own SLM Drafter (real: float torch on CPU, toy twin).

``HybridDrafter(..., two_pass=True)`` over ``MultiPassSlm`` runs the second pass under the nodes the first
pass added; those rows attend to first-pass rows (their planted ancestors), which ``MultiPassSlm``
recomputes in the same forward. Checked: the tree passes the server's validation, has second-pass nodes,
and equals a reference built by running the one-pass SLM twice on fresh drafters (pass 1 over the planted
rows; pass 2 over the whole tree so far in one causal-tree forward); the Algorithm 1 line 10 bookkeeping
still holds after a 2P round; the one-pass drafter and the compiled backend refuse 2P with a clear error.
"""

from __future__ import annotations

import numpy as np
import pytest

from mobile_client import bundle as bundle_mod
from mobile_client.drafters.base import DraftContext, HybridDrafter, RowLogprobs
from mobile_client.drafters.multipass import ROWS, MultiPassSlm
from mobile_client.drafters.slm import SlmDrafter
from mobile_client.drafters.spec import random_slm_state_dict, toy_slm_spec
from mobile_client.tree import DraftTree, frontier_plan, grow_tree, plant_tree
from vllm_hyco.errors import ConfigError
from vllm_hyco.handoff.tree_contract import NodeLabel, validate_tree

SPEC = toy_slm_spec()
SD = random_slm_state_dict(SPEC, seed=7)
KEEP = list(range(0, SPEC.vocab, 2))
CONTEXT = [5, 9, 17, 33, 2, 40, 8]
ROOT, CHAIN, RUNNER_UPS = 12, (30, 44, 6, 18), (31, 46)


class FixedChain:
    def draft(self, x_hat):
        return type("C", (), {"chain": CHAIN, "runner_ups": RUNNER_UPS})()


def _slm(rows=ROWS) -> SlmDrafter:
    d = SlmDrafter(SPEC, SD, KEEP, window=32, rows=rows)
    d.prefill(CONTEXT)
    return d


def _reference(node_budget: int = 32) -> DraftTree:
    """The SLM run twice, one plain one-pass forward each, on fresh drafters."""
    planted = plant_tree(ROOT, CHAIN, RUNNER_UPS, node_budget=node_budget)
    plan = frontier_plan(planted)
    first = _slm(32).forward_rows(plan)

    def second(plan2):
        whole = DraftTree.make_dummy(plan2.tokens, plan2.parents)
        out = _slm().forward_rows(frontier_plan(whole, rows=range(len(whole.tokens))))
        order = frontier_plan(whole, rows=range(len(whole.tokens))).rows
        at = {r: i for i, r in enumerate(order)}
        return RowLogprobs(np.asarray(out.logprobs)[[at[r] for r in plan2.rows]], out.ids)

    return grow_tree(planted, plan, first, second_pass=second)


def test_two_pass_tree_is_valid_and_equals_two_plain_slm_runs():
    slm = _slm()
    tree = HybridDrafter(FixedChain(), MultiPassSlm(slm), two_pass=True).propose(
        DraftContext(root=ROOT, x_hat=np.zeros(4, np.float32)), 32)
    tokens, parents = tree.to_wire()
    validate_tree(tokens, parents, vocab_size=SPEC.vocab, node_budget=32)
    assert tree.num_nodes == 32
    second_pass = [r for r in range(1, len(tokens))
                   if tree.sources[r] == NodeLabel.SLM and tree.sources[parents[r]] == NodeLabel.SLM]
    assert second_pass  # nodes under first-pass SLM nodes: the second pass ran and won places
    ref = _reference()
    assert (tokens, parents) == ref.to_wire()
    np.testing.assert_allclose(tree.scores, ref.scores, atol=1e-5)  # float32 sums in another order (2.5e-6 seen)
    one_pass = HybridDrafter(FixedChain(), _slm(32)).propose(DraftContext(root=ROOT, x_hat=np.zeros(4)), 32)
    assert one_pass.to_wire() != (tokens, parents)


def test_accept_after_a_two_pass_round_keeps_the_ring_consistent():
    """Accepting a path through a second-pass node: the SLM keeps the root and the computed path rows, and
    the next round (with the rest as catch-up) equals a fresh drafter that prefilled the committed text."""
    slm = _slm()
    rows = MultiPassSlm(slm)
    tree = HybridDrafter(FixedChain(), rows, two_pass=True).propose(
        DraftContext(root=ROOT, x_hat=np.zeros(4)), 32)
    leaf = next(r for r in range(len(tree.tokens)) if tree.sources[r] == NodeLabel.SLM
                and tree.sources[tree.parents[r]] == NodeLabel.SLM)
    path = tree.path(leaf)  # root ... first-pass SLM node -> second-pass SLM node
    committed = [tree.tokens[r] for r in path]
    kept = slm.accept(path, tokens=committed)  # by token path: the sent tree was trimmed (rows re-indexed)
    assert kept == len(path) - 1 and slm.committed == len(CONTEXT) + kept  # all but the 2nd-pass node
    nxt = DraftTree.make_dummy([99, 100], [-1, 0])
    got = rows.forward_rows(frontier_plan(nxt, catch_up=committed[kept:]))
    fresh = _slm()
    fresh.prefill(committed)
    want = fresh.forward_rows(frontier_plan(nxt))
    np.testing.assert_allclose(np.asarray(got.logprobs)[len(committed) - kept:], want.logprobs, atol=1e-5)


def test_one_pass_drafter_and_compiled_backend_refuse_two_pass(monkeypatch, tmp_path):
    with pytest.raises(NotImplementedError, match="MultiPassSlm"):
        HybridDrafter(FixedChain(), _slm(32), two_pass=True).propose(
            DraftContext(root=ROOT, x_hat=np.zeros(4)), 32)
    from test_client_loop_cli import ROPE, _save  # a bundle folder with an SLM only

    from mobile_client.drafters.spec import slm_hf_config

    _save(tmp_path / "slm", {**slm_hf_config(SPEC), "rope_parameters": ROPE}, SD)
    monkeypatch.setattr(bundle_mod, "compiled_step", lambda ctx, notes, name: (lambda feeds: None))
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "slm_ctx.onnx").write_bytes(b"")  # a compiled SLM step (never loaded here)
    with pytest.raises(ConfigError, match="--slm-passes 2"):
        bundle_mod.load_bundle(tmp_path, "compiled", slm_passes=2)
    with pytest.raises(ConfigError, match="--slm-passes"):
        bundle_mod.load_bundle(tmp_path, "torch", slm_passes=3)
    bundle = bundle_mod.load_bundle(tmp_path, "torch", slm_passes=2)  # torch: HyCo-2P (SLM-only without scales)
    assert bundle.drafter.drafter.two_pass and isinstance(bundle.drafter.drafter.row_drafter, MultiPassSlm)
