"""The tree contract (vllm_hyco.handoff.tree_contract): labels, limits, depth and ancestor masks against a
brute-force reference, every prefix of a tree is a tree, padding, validate_tree's codes and messages, and
that the contract has one owner (numpy only, every former copy imports it)."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vllm_hyco.errors import TreeValidationError
from vllm_hyco.handoff.tree_contract import (
    DEFAULT_NODE_BUDGET,
    MAX_NODE_BUDGET,
    MAX_TREE_ROWS,
    NodeLabel,
    ancestor_mask,
    ancestor_matrix,
    depths,
    pad_tree,
    validate_tree,
)

ROOT_DIR = Path(__file__).resolve().parents[2]
V = 100


def random_parents(n_rows: int, rng: random.Random, reach: int | None = None) -> list[int]:
    """A random parents list in insertion order; ``reach`` bounds how far back a parent may be (deep trees)."""
    out = [-1]
    for i in range(1, n_rows):
        lo = 0 if reach is None else max(0, i - reach)
        out.append(rng.randrange(lo, i))
    return out


def random_tree(n_rows: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(tokens, parents) with distinct tokens among siblings (a valid tree for vocabulary V)."""
    parents = random_parents(n_rows, rng, reach=rng.choice([None, 1, 3]))
    tokens, used = [rng.randrange(V)], {}
    for p in parents[1:]:
        taken = used.setdefault(p, set())
        tok = rng.choice([t for t in range(V) if t not in taken])
        taken.add(tok)
        tokens.append(tok)
    return tokens, parents


def brute_ancestors(parents: list[int]) -> list[set[int]]:
    """Row j's ancestors and j itself, by walking up the parents (no masks involved)."""
    out = []
    for j in range(len(parents)):
        rows, cur = set(), j
        while cur != -1:
            rows.add(cur)
            cur = parents[cur]
        out.append(rows)
    return out


def as_int64(bits: set[int]) -> int:
    m = sum(1 << i for i in bits)
    return m - (1 << 64) if m >= 1 << 63 else m


# ------------------------------------------------------------------------------------- labels, limits


def test_labels_are_the_wire_values():
    assert [(s.name, int(s)) for s in NodeLabel] == [
        ("ROOT", 0), ("CHAIN", 1), ("RUNNER_UP", 2), ("SLM", 3), ("OTHER", 4)]


def test_limits():
    assert DEFAULT_NODE_BUDGET == 32
    assert MAX_TREE_ROWS == 64 and MAX_NODE_BUDGET == 63


def test_every_default_budget_is_the_contracts():
    from mobile_client.session import SessionOptions
    from mobile_client.tree import DraftTree
    from vllm_hyco.config import HycoConfig
    from vllm_hyco.handoff.client_frames import ClientCapabilities
    from vllm_hyco.handoff.limits import WireLimits

    assert HycoConfig().node_budget == WireLimits().max_node_budget == ClientCapabilities().node_budget \
        == DraftTree.make_dummy([1], [-1]).node_budget == SessionOptions().node_budget == DEFAULT_NODE_BUDGET


def test_one_definition_of_the_label_enum():
    """Only tree_contract.py defines the ROOT = 0 ... OTHER = 4 enum (the server, wire and phone import it)."""
    owners = [
        p.relative_to(ROOT_DIR).as_posix()
        for pkg in ("vllm_hyco", "mobile_client/src")
        for p in (ROOT_DIR / pkg).rglob("*.py")
        if re.search(r"^\s+RUNNER_UP = 2\b", p.read_text(), re.MULTILINE)
    ]
    assert owners == ["vllm_hyco/handoff/tree_contract.py"]
    from mobile_client import tree as phone_tree
    from vllm_hyco.handoff import NodeLabel as wire_label
    from vllm_hyco.spec_decode import stats

    assert wire_label is NodeLabel and len(NodeLabel) == stats.NUM_SOURCES
    assert not hasattr(phone_tree, "Source") and not hasattr(phone_tree, "BUDGET")


def test_contract_imports_neither_torch_nor_vllm():
    code = ("import sys, vllm_hyco.handoff.tree_contract; "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------- depth and ancestor masks


def test_worked_example():
    parents = [-1, 0, 1, 0, 1]
    assert depths(parents).tolist() == [0, 1, 2, 1, 2]
    assert ancestor_mask(parents).tolist() == [0b00001, 0b00011, 0b00111, 0b01001, 0b10011]
    assert ancestor_matrix(parents).astype(int).tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 0, 1]]
    assert depths(parents).dtype == ancestor_mask(parents).dtype == np.int64


@pytest.mark.parametrize("seed", range(60))
def test_depth_and_masks_match_brute_force(seed):
    rng = random.Random(seed)
    n = [1, 2, 33, 64][seed % 4] if seed < 8 else rng.randrange(1, MAX_TREE_ROWS + 1)
    parents = random_parents(n, rng, reach=rng.choice([None, 1, 2, 5]))
    anc = brute_ancestors(parents)
    assert depths(parents).tolist() == [len(a) - 1 for a in anc]
    assert ancestor_mask(parents).tolist() == [as_int64(a) for a in anc]
    mat = ancestor_matrix(parents)
    assert [set(np.nonzero(row)[0].tolist()) for row in mat] == anc
    # numpy inputs of any integer width give the same answer
    assert ancestor_mask(np.asarray(parents, dtype=np.int16)).tolist() == ancestor_mask(parents).tolist()


def test_a_64_row_chain_uses_the_sign_bit():
    parents = [-1] + list(range(63))
    assert ancestor_mask(parents)[-1] == -1  # all 64 bits set
    assert depths(parents)[-1] == 63


def test_matrix_and_depth_have_no_row_cap_but_the_int64_mask_does():
    parents = random_parents(150, random.Random(3))
    anc = brute_ancestors(parents)
    assert [set(np.nonzero(r)[0].tolist()) for r in ancestor_matrix(parents)] == anc
    assert depths(parents).tolist() == [len(a) - 1 for a in anc]
    with pytest.raises(TreeValidationError) as err:
        ancestor_mask(parents)
    assert err.value.code == "tree_too_large" and "trim" in str(err.value)


@pytest.mark.parametrize("seed", range(40))
def test_every_prefix_of_a_tree_is_a_tree(seed):
    """Rows come parents first, so the engine may schedule any prefix: it validates, and its derived
    fields are the prefix of the whole tree's."""
    rng = random.Random(1000 + seed)
    tokens, parents = random_tree(rng.randrange(1, MAX_TREE_ROWS + 1), rng)
    validate_tree(tokens, parents, vocab_size=V, node_budget=MAX_NODE_BUDGET)
    full_d, full_m, full_a = depths(parents), ancestor_mask(parents), ancestor_matrix(parents)
    for k in range(1, len(parents) + 1):
        validate_tree(tokens[:k], parents[:k], vocab_size=V, node_budget=k - 1)
        assert depths(parents[:k]).tolist() == full_d[:k].tolist()
        assert ancestor_mask(parents[:k]).tolist() == full_m[:k].tolist()
        assert (ancestor_matrix(parents[:k]) == full_a[:k, :k]).all()


@pytest.mark.parametrize("parents,code", [
    ([], "tree_empty"),
    ([0, 0], "bad_root_parent"),
    ([-1, 1], "parent_not_before_child"),
    ([-1, 0, 7], "parent_out_of_range"),
    ([-1, -1], "parent_out_of_range"),
    ([-1, 0.0], "bad_dtype"),
    (np.zeros((2, 2), dtype=np.int64), "bad_shape"),
])
def test_derived_fields_refuse_a_non_tree(parents, code):
    for fn in (depths, ancestor_mask, ancestor_matrix):
        with pytest.raises(TreeValidationError) as err:
            fn(parents)
        assert err.value.code == code


# -------------------------------------------------------------------------------------------- padding


def test_padding_repeats_the_last_row():
    p = pad_tree([7, 11, 12, 21], [-1, 0, 1, 0], 6)
    assert p.tokens.tolist() == [7, 11, 12, 21, 21, 21]
    assert p.parents.tolist() == [-1, 0, 1, 0, 0, 0]
    assert p.depths.tolist() == [0, 1, 2, 1, 1, 1]
    assert p.ancestor_mask.tolist() == [1, 3, 7, 9, 9, 9]
    assert p.valid.tolist() == [True] * 4 + [False] * 2
    assert p.positions(40).tolist() == [40, 41, 42, 41, 41, 41]
    m = p.ancestor_matrix()
    assert m.shape == (6, 6) and not m[:, 4:].any()
    assert m[:4, :4].tolist() == ancestor_matrix([-1, 0, 1, 0]).tolist()
    assert m[4].tolist() == m[5].tolist() == m[3].tolist()
    root = pad_tree([5], [-1], 3)
    assert root.tokens.tolist() == [5, 5, 5] and root.valid.tolist() == [True, False, False]


@pytest.mark.parametrize("seed", range(20))
def test_padded_masks_agree_with_the_matrix(seed):
    rng = random.Random(seed)
    tokens, parents = random_tree(rng.randrange(1, 34), rng)
    p = pad_tree(tokens, parents, DEFAULT_NODE_BUDGET + 1)
    bits = p.ancestor_mask.tolist()
    mat = p.ancestor_matrix()
    for j in range(p.num_rows):
        assert [i for i in range(p.num_rows) if (bits[j] >> i) & 1] == np.nonzero(mat[j])[0].tolist()


def test_padding_refuses_too_few_rows_and_bad_trees():
    with pytest.raises(TreeValidationError) as err:
        pad_tree([7, 11, 12], [-1, 0, 1], 2)
    assert err.value.code == "tree_too_large" and "pad to at least 3 rows" in str(err.value)
    with pytest.raises(TreeValidationError) as err:
        pad_tree([7, 11], [-1, 0, 1], 4)
    assert err.value.code == "length_mismatch"
    with pytest.raises(TreeValidationError) as err:
        pad_tree([7, 11], [-1, 1], 4)
    assert err.value.code == "parent_not_before_child"


# ----------------------------------------------------------------------------------------- validation


BAD = [
    # code, tokens, parents, labels, budget, a word of the fix the message must name
    ("tree_empty", [], [], None, 32, "root"),
    ("length_mismatch", [1, 2], [-1], None, 32, "one parent per token"),
    ("length_mismatch", [1, 2], [-1, 0], [0], 32, "label every row"),
    ("bad_root_parent", [1, 2], [0, 0], None, 32, "parent -1"),
    ("parent_out_of_range", [1, 2, 3], [-1, 0, 5], None, 32, "0..2"),
    ("parent_not_before_child", [1, 2, 3], [-1, 2, 0], None, 32, "insertion order"),
    ("tree_too_large", list(range(34)), [-1] + list(range(33)), None, 32, "trim"),
    ("token_out_of_vocab", [1, V], [-1, 0], None, 32, f"[0, {V})"),
    ("token_out_of_vocab", [-1, 2], [-1, 0], None, 32, f"[0, {V})"),
    ("duplicate_sibling", [1, 5, 5], [-1, 0, 0], None, 32, "drop the duplicate"),
    ("bad_label", [1, 2], [-1, 0], [1, 1], 32, "ROOT"),
    ("bad_label", [1, 2], [-1, 0], [0, 0], 32, "3 (SLM)"),
    ("bad_label", [1, 2], [-1, 0], [0, 5], 32, "4 (other)"),
    ("bad_dtype", [1.0, 2.0], [-1, 0], None, 32, "integer"),
    ("bad_dtype", [True, 2], [-1, 0], None, 32, "integer"),
    ("bad_dtype", np.array([1.0, 2.0]), [-1, 0], None, 32, "integer"),
    ("bad_shape", np.array([[1, 2]]), [-1, 0], None, 32, "1-D"),
    ("bad_budget", [1], [-1], None, MAX_TREE_ROWS, "64 rows"),
    ("bad_budget", [1], [-1], None, -1, "64 rows"),
]


@pytest.mark.parametrize("code,tokens,parents,labels,budget,fix", BAD)
def test_bad_trees_name_the_rule_and_the_fix(code, tokens, parents, labels, budget, fix):
    with pytest.raises(TreeValidationError) as err:
        validate_tree(tokens, parents, vocab_size=V, node_budget=budget, labels=labels)
    assert err.value.code == code, str(err.value)
    assert fix in str(err.value)


def test_valid_trees_of_every_input_form():
    validate_tree([5], [-1], vocab_size=V, node_budget=0)  # root only: verifies to a bonus token
    validate_tree((7, 11, 12), (-1, 0, 1), vocab_size=V, labels=(0, 1, 3))
    validate_tree(np.array([7, 11], np.uint32), np.array([-1, 0], np.int8), vocab_size=V,
                  labels=np.array([0, 2], np.uint8))
    validate_tree([np.int64(7), np.int32(8)], [-1, 0], vocab_size=V)
    tokens = list(range(MAX_TREE_ROWS))
    validate_tree(tokens, [-1] + tokens[:-1], vocab_size=V, node_budget=MAX_NODE_BUDGET)


def test_random_corruptions_are_rejected_with_their_code():
    rng = random.Random(0)
    for seed in range(200):
        tokens, parents = random_tree(rng.randrange(2, 34), rng)
        i = rng.randrange(1, len(tokens))
        kind = seed % 4
        if kind == 0:
            parents[i] = rng.randrange(i, len(tokens))
            code = "parent_not_before_child"
        elif kind == 1:
            parents[i] = len(tokens) + rng.randrange(5)
            code = "parent_out_of_range"
        elif kind == 2:
            tokens[i] = V + rng.randrange(5)
            code = "token_out_of_vocab"
        else:
            tokens.append(tokens[i])
            parents.append(parents[i])
            code = "duplicate_sibling"
        with pytest.raises(TreeValidationError) as err:
            validate_tree(tokens, parents, vocab_size=V, node_budget=40)
        assert err.value.code == code

