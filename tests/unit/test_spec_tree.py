"""TokenTree (the tree contract's torch edge): validation codes on torch and list inputs, derived fields
against brute force, padding, wire round trip. The contract itself: tests/unit/test_tree_contract.py."""

import random

import pytest
import torch

from vllm_hyco.errors import TreeValidationError
from vllm_hyco.handoff.tree_contract import validate_tree
from vllm_hyco.spec_decode.tree import TokenTree

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 100


def test_worked_example_from_docstring():
    tree = TokenTree.from_parents([7, 11, 12, 21, 31], [-1, 0, 1, 0, 1], vocab_size=V,
                                  labels=[0, 1, 1, 2, 3])
    assert tree.depth.tolist() == [0, 1, 2, 1, 2]
    assert tree.ancestor_mask.tolist() == [0b00001, 0b00011, 0b00111, 0b01001, 0b10011]
    assert tree.positions(40).tolist() == [40, 41, 42, 41, 42]
    assert tree.num_nodes == 4 and tree.num_rows == 5
    assert tree.source_labels().tolist() == [0, 1, 1, 2, 3]


def _brute_ancestors(parents):
    out = []
    for i in range(len(parents)):
        mask, cur = 0, i
        while cur != -1:
            mask |= 1 << cur
            cur = parents[cur]
        out.append(mask)
    return out


def test_masks_and_depths_match_brute_force_on_random_trees():
    for seed in range(200):
        n = seed % 33
        tree = TokenTree.make_dummy(n, kind="random", vocab_size=V, seed=seed)
        parents = tree.parents.tolist()
        assert tree.ancestor_mask.tolist() == _brute_ancestors(parents)
        depth = [m.bit_count() - 1 for m in _brute_ancestors(parents)]
        assert tree.depth.tolist() == depth


def test_full_64_row_mask_uses_the_sign_bit():
    tree = TokenTree.from_parents(list(range(64)), [-1] + list(range(63)), vocab_size=V, node_budget=63)
    assert tree.ancestor_mask[-1].item() == -1  # all 64 bits set


BAD_TREES = [
    ("tree_empty", [], [], None, 32),
    ("length_mismatch", [1, 2], [-1], None, 32),
    ("length_mismatch", [1, 2], [-1, 0], [0], 32),
    ("bad_root_parent", [1, 2], [0, 0], None, 32),
    ("parent_out_of_range", [1, 2, 3], [-1, 0, 5], None, 32),
    ("parent_out_of_range", [1, 2, 3], [-1, 0, -1], None, 32),
    ("parent_not_before_child", [1, 2, 3], [-1, 2, 0], None, 32),
    ("parent_not_before_child", [1, 2], [-1, 1], None, 32),
    ("tree_too_large", list(range(34)), [-1] + list(range(33)), None, 32),
    ("tree_too_large", [1, 2, 3], [-1, 0, 0], None, 1),
    ("token_out_of_vocab", [1, V], [-1, 0], None, 32),
    ("token_out_of_vocab", [-1, 2], [-1, 0], None, 32),
    ("duplicate_sibling", [1, 5, 5], [-1, 0, 0], None, 32),
    ("bad_label", [1, 2], [-1, 0], [1, 1], 32),
    ("bad_label", [1, 2], [-1, 0], [0, 0], 32),
    ("bad_label", [1, 2], [-1, 0], [0, 9], 32),
    ("bad_dtype", [1.0, 2.0], [-1, 0], None, 32),
    ("bad_dtype", torch.tensor([1.0, 2.0]), [-1, 0], None, 32),
    ("bad_shape", torch.tensor([[1, 2]]), [-1, 0], None, 32),
    ("bad_budget", [1], [-1], None, 64),
]


@pytest.mark.parametrize("code,tokens,parents,labels,budget", BAD_TREES)
def test_bad_trees_are_rejected_with_their_code(code, tokens, parents, labels, budget):
    with pytest.raises(TreeValidationError) as err:
        validate_tree(tokens, parents, vocab_size=V, node_budget=budget, labels=labels)
    assert err.value.code == code, str(err.value)
    assert str(err.value)  # a message that says what to fix
    with pytest.raises(TreeValidationError):
        TokenTree.from_parents(tokens, parents, vocab_size=V, node_budget=budget, labels=labels)


def test_random_corruptions_are_all_rejected():
    rng = random.Random(0)
    for seed in range(300):
        tree = TokenTree.make_dummy(rng.randrange(2, 33), kind="random", vocab_size=V, seed=seed)
        toks, pars = tree.tokens.tolist(), tree.parents.tolist()
        i = rng.randrange(1, len(toks))
        kind = seed % 4
        if kind == 0:
            pars[i] = rng.randrange(i, len(toks))
            code = "parent_not_before_child"
        elif kind == 1:
            pars[i] = len(toks) + rng.randrange(5)
            code = "parent_out_of_range"
        elif kind == 2:
            toks[i] = V + rng.randrange(5)
            code = "token_out_of_vocab"
        else:
            toks.append(toks[i])
            pars.append(pars[i])
            code = "duplicate_sibling"
        with pytest.raises(TreeValidationError) as err:
            validate_tree(toks, pars, vocab_size=V, node_budget=40)
        assert err.value.code == code


def test_root_only_tree_is_valid():
    tree = TokenTree.from_parents([5], [-1], vocab_size=V)
    assert tree.num_nodes == 0 and tree.ancestor_mask.tolist() == [1]


def test_padding_repeats_the_last_row_and_masks_it():
    tree = TokenTree.from_parents([7, 11, 12], [-1, 0, 1], vocab_size=V)
    pad = tree.padded(5)
    assert pad.tokens.tolist() == [7, 11, 12, 12, 12]
    assert pad.parents.tolist() == [-1, 0, 1, 1, 1]
    assert pad.ancestor_mask.tolist() == [1, 3, 7, 7, 7]
    assert pad.valid.tolist() == [True, True, True, False, False]
    assert pad.positions(10).tolist() == [10, 11, 12, 12, 12]
    with pytest.raises(TreeValidationError):
        tree.padded(2)


def test_wire_round_trip_and_validation():
    for seed in range(20):
        tree = TokenTree.make_dummy(seed, kind="random", vocab_size=V, seed=seed, labelled=seed % 2 == 0)
        wire = tree.to_wire()
        assert ("labels" in wire) == (seed % 2 == 0)
        back = TokenTree.from_wire(wire, vocab_size=V)
        assert back.tokens.tolist() == tree.tokens.tolist()
        assert back.parents.tolist() == tree.parents.tolist()
        assert back.ancestor_mask.tolist() == tree.ancestor_mask.tolist()
    with pytest.raises(TreeValidationError) as err:
        TokenTree.from_wire({"tokens": [1, 2, 2], "parents": [-1, 0, 0]}, vocab_size=V)
    assert err.value.code == "duplicate_sibling"

