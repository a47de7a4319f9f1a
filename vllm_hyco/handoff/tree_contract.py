"""The token-tree contract: what a draft tree is, defined once for the wire, the server and the phone.

numpy + stdlib only (no torch, no vLLM). The wire frames (``client_frames``), the server core
(``vllm_hyco.spec_decode.tree``), the kernels' launchers, the engine's tree plan
(``vllm_hyco.vllm_adapter.worker.tree_plan``) and the phone (``mobile_client.tree``) all import it; torch callers
convert at their edge (``torch.from_numpy``).

A tree has ``n + 1`` rows in insertion order. Row 0 is the root (the last committed token, x_{t+1} in the
paper); rows 1..n are drafted nodes. ``tokens[i]`` is the token id of row i and ``parents[i]`` the row of
its parent: the parent token of ``tokens[i]`` is ``tokens[parents[i]]``. ``parents[0] == -1`` and
``0 <= parents[i] < i`` for every other row, so a parent's row always comes before its children's, and
every prefix of a tree is a tree (the engine may schedule only the first rows). The node budget counts
drafted nodes, not the root (default ``DEFAULT_NODE_BUDGET`` = 32, so at most 33 rows).

Worked example (root 7, chain 11 -> 12, a runner-up 21 beside 11, an SLM leaf 31 under 11)::

    row      0   1   2   3   4
    token    7  11  12  21  31          root 7 at position t
    parent  -1   0   1   0   1            11 (t+1) -- 12 (t+2)
    depth    0   1   2   1   2          /             \\
    label    R   C   C   U   S         7                31 (t+2)
                                        \\
                                         21 (t+1)

Row j takes position ``t + depth[j]`` and attends to the committed prefix, its ancestor rows and itself.
``ancestor_mask`` packs that set into one int64 per row (bit i set iff row i is an ancestor of row j or j
itself); ``ancestor_matrix`` is the same relation as an ``[n, n]`` bool matrix, for any n:

>>> depths([-1, 0, 1, 0, 1]).tolist()
[0, 1, 2, 1, 2]
>>> [bin(m) for m in ancestor_mask([-1, 0, 1, 0, 1]).tolist()]
['0b1', '0b11', '0b111', '0b1001', '0b10011']

Resolved ambiguities (docs/acceptance.md): two children of one node with the same token are *rejected*
(``duplicate_sibling``), not silently deduplicated; a root-only tree (n = 0) is valid, it verifies to just
a bonus token; a tree with no rows at all is ``tree_empty``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from vllm_hyco.errors import TreeValidationError

# The node budget: drafted nodes per tree, root excluded. One name (``node_budget``) end to end: the operator's
# ``HycoConfig.node_budget`` (at most DEFAULT_NODE_BUDGET), each round's grant, the phone's cap
# (``ClientCapabilities.node_budget``, the wire's ``max_nodes``); :func:`grant_node_budget` is the one clamp.
DEFAULT_NODE_BUDGET = 32  # B: the paper's setting, the default and the most an operator may grant
# The ancestor bitmask is one int64 per row, so a tree has at most 64 rows (bit 63 is the sign bit).
MAX_TREE_ROWS = 64
MAX_NODE_BUDGET = MAX_TREE_ROWS - 1  # the largest node budget a tree can hold (the root takes a row)


class NodeLabel(IntEnum):
    """Who proposed a node: the optional per-row ``labels`` of the tree frame (one uint8 each on the wire,
    docs/protocol.md). Row 0 is always ROOT. Labels feed statistics only, never acceptance."""

    ROOT = 0
    CHAIN = 1  # the verifier's MTP chain
    RUNNER_UP = 2  # the MTP head's second choice beside a chain node
    SLM = 3  # the phone's small LM
    OTHER = 4  # anything else (and every node of an unlabelled tree)


# ---------------------------------------------------------------------------------------------- inputs


def _int_list(name: str, values: Any) -> list[int]:
    """``values`` as a list of Python ints: a sequence of ints, or a 1-D integer array (numpy, or anything
    numpy can read, such as a CPU torch tensor)."""
    if not isinstance(values, (list, tuple, range)) and (
        hasattr(values, "__array__") or hasattr(values, "ndim")
    ):
        arr = np.asarray(values)
        if arr.ndim != 1:
            raise TreeValidationError(
                f"{name} must be 1-D, got shape {tuple(arr.shape)}; send one entry per row", code="bad_shape"
            )
        if arr.dtype.kind not in "iu":
            raise TreeValidationError(
                f"{name} must hold integers, got dtype {arr.dtype}; send integer ids", code="bad_dtype"
            )
        return [int(v) for v in arr.tolist()]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__"):
            raise TreeValidationError(
                f"{name} must hold integers, got {type(v).__name__} {v!r}; send integer ids", code="bad_dtype"
            )
        out.append(int(v))
    return out


def _check_parents(parents: list[int]) -> None:
    if not parents:
        raise TreeValidationError(
            "tree has no rows; send at least the root (row 0, parent -1)", code="tree_empty"
        )
    if parents[0] != -1:
        raise TreeValidationError(
            f"row 0 is the root and must have parent -1, got {parents[0]}", code="bad_root_parent"
        )
    n_rows = len(parents)
    for i in range(1, n_rows):
        p = parents[i]
        if p < 0 or p >= n_rows:
            raise TreeValidationError(
                f"row {i} has parent {p}, outside the tree's rows 0..{n_rows - 1}",
                code="parent_out_of_range",
            )
        if p >= i:
            raise TreeValidationError(
                f"row {i} has parent {p}, but a parent must come before its child "
                f"(send rows in insertion order)",
                code="parent_not_before_child",
            )


def _checked_parents(parents: Sequence[int] | np.ndarray) -> list[int]:
    par = _int_list("parents", parents)
    _check_parents(par)
    return par


# ------------------------------------------------------------------------------------- derived fields


def depths(parents: Sequence[int] | np.ndarray) -> np.ndarray:
    """[n] int64: each row's distance from the root (the root's is 0). Any row count.

    Raises ``TreeValidationError`` unless ``parents`` is a tree (``parents[0] == -1``, ``0 <= parents[i] < i``).
    """
    par = _checked_parents(parents)
    out = [0] * len(par)
    for i in range(1, len(par)):
        out[i] = out[par[i]] + 1
    return np.asarray(out, dtype=np.int64)


def ancestor_mask(parents: Sequence[int] | np.ndarray) -> np.ndarray:
    """[n] int64 bitmasks (n <= MAX_TREE_ROWS): bit i of row j is set iff row i is an ancestor of row j or
    j itself; a 64th row's mask uses bit 63, the sign bit. The form the kernels and the engine take."""
    par = _checked_parents(parents)
    if len(par) > MAX_TREE_ROWS:
        raise TreeValidationError(
            f"tree has {len(par)} rows but an int64 ancestor mask holds at most {MAX_TREE_ROWS}; "
            f"trim it to {MAX_NODE_BUDGET} nodes",
            code="tree_too_large",
        )
    masks = [1]
    for i in range(1, len(par)):
        masks.append(masks[par[i]] | (1 << i))
    return np.asarray([m - (1 << 64) if m >= (1 << 63) else m for m in masks], dtype=np.int64)


def ancestor_matrix(parents: Sequence[int] | np.ndarray) -> np.ndarray:
    """[n, n] bool, any n: ``[j, i]`` is True iff row i is row j or one of its ancestors."""
    par = _checked_parents(parents)
    n = len(par)
    mask = np.zeros((n, n), dtype=bool)
    for j in range(n):
        if j:
            mask[j] = mask[par[j]]
        mask[j, j] = True
    return mask


# -------------------------------------------------------------------------------------------- padding


@dataclass(frozen=True)
class PaddedTree:
    """A tree padded to a fixed row count by repeating its last row (the engine's and the phone's static
    graphs' form). Pad rows copy the last real row's token, parent, depth and mask, so they compute exactly
    what that row computes; ``valid`` keeps them out of acceptance and statistics."""

    tokens: np.ndarray  # [rows] int64
    parents: np.ndarray  # [rows] int64, -1 for the root
    depths: np.ndarray  # [rows] int64, 0 for the root
    ancestor_mask: np.ndarray  # [rows] int64 bitmasks (see ``ancestor_mask``)
    valid: np.ndarray  # [rows] bool, True on the tree's own rows (a prefix)

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def positions(self, t: int) -> np.ndarray:
        """[rows] int64: ``t + depth`` (pad rows take the last row's position)."""
        return self.depths + t

    def ancestor_matrix(self) -> np.ndarray:
        """[rows, rows] bool: ``[j, i]`` is True iff row i is row j or its ancestor; never a pad column."""
        n = int(self.valid.sum())
        anc = ancestor_matrix(self.parents[:n])  # [n, n]
        out = np.zeros((self.num_rows, self.num_rows), dtype=bool)
        out[:n, :n] = anc
        out[n:, :n] = anc[n - 1]
        return out


def pad_tree(
    tokens: Sequence[int] | np.ndarray, parents: Sequence[int] | np.ndarray, num_rows: int
) -> PaddedTree:
    """Pad a tree of n <= ``num_rows`` rows (n <= MAX_TREE_ROWS) to ``num_rows`` rows.

    >>> p = pad_tree([7, 11], [-1, 0], 4)
    >>> p.tokens.tolist(), p.ancestor_mask.tolist(), p.valid.tolist()
    ([7, 11, 11, 11], [1, 3, 3, 3], [True, True, False, False])
    """
    tok = _int_list("tokens", tokens)
    masks = ancestor_mask(parents)  # validates parents
    par = _int_list("parents", parents)
    n = len(par)
    if len(tok) != n:
        raise TreeValidationError(
            f"tokens has {len(tok)} rows but parents has {n}; send one parent per token", code="length_mismatch"
        )
    if num_rows < n:
        raise TreeValidationError(
            f"cannot pad a {n}-row tree to {num_rows} rows; pad to at least {n} rows or trim the tree to "
            f"{max(num_rows - 1, 0)} nodes",
            code="tree_too_large",
        )
    take = np.minimum(np.arange(num_rows), n - 1)  # [rows] source row of each padded row
    return PaddedTree(
        tokens=np.asarray(tok, dtype=np.int64)[take],
        parents=np.asarray(par, dtype=np.int64)[take],
        depths=depths(par)[take],
        ancestor_mask=masks[take],
        valid=np.arange(num_rows) < n,
    )


# ------------------------------------------------------------------------------------------ validation


def _check_shape(tokens: list[int], parents: list[int], labels: list[int] | None, node_budget: int) -> None:
    if len(tokens) != len(parents):
        raise TreeValidationError(
            f"tokens has {len(tokens)} rows but parents has {len(parents)}; send one parent per token",
            code="length_mismatch",
        )
    if labels is not None and len(labels) != len(tokens):
        raise TreeValidationError(
            f"labels has {len(labels)} rows but tokens has {len(tokens)}; label every row (root = 0)",
            code="length_mismatch",
        )
    if len(tokens) == 0:
        raise TreeValidationError(
            "tree has no rows; send at least the root (row 0, parent -1)", code="tree_empty"
        )
    if len(tokens) - 1 > node_budget:
        raise TreeValidationError(
            f"tree has {len(tokens) - 1} nodes (plus the root) but the node budget is {node_budget}; "
            f"trim it to the {node_budget} best nodes",
            code="tree_too_large",
        )


def _check_tokens(tokens: list[int], parents: list[int], vocab_size: int) -> None:
    for i, tok in enumerate(tokens):
        if tok < 0 or tok >= vocab_size:
            raise TreeValidationError(
                f"row {i} has token {tok}, outside the verifier vocabulary [0, {vocab_size})",
                code="token_out_of_vocab",
            )
    seen: dict[tuple[int, int], int] = {}
    for i in range(1, len(tokens)):
        key = (parents[i], tokens[i])
        if key in seen:
            raise TreeValidationError(
                f"rows {seen[key]} and {i} are both children of row {parents[i]} with token "
                f"{tokens[i]}; drop the duplicate sibling",
                code="duplicate_sibling",
            )
        seen[key] = i


def _check_labels(labels: list[int]) -> None:
    if labels[0] != NodeLabel.ROOT:
        raise TreeValidationError(
            f"row 0 must be labelled ROOT (0), got {labels[0]}", code="bad_label"
        )
    for i in range(1, len(labels)):
        if not NodeLabel.CHAIN <= labels[i] <= NodeLabel.OTHER:
            raise TreeValidationError(
                f"row {i} has label {labels[i]}; node labels are 1 (chain), 2 (runner-up), "
                f"3 (SLM) or 4 (other)",
                code="bad_label",
            )


def grant_node_budget(*caps: int) -> int:
    """The node budget a round may use: the smallest of ``caps`` (a grant, the operator's ``node_budget``,
    the phone's own cap), never below 1.

    >>> grant_node_budget(12, 32, 16), grant_node_budget(0, 32)
    (12, 1)
    """
    return max(1, min(int(c) for c in caps))


def validate_tree(
    tokens: Sequence[int] | np.ndarray,
    parents: Sequence[int] | np.ndarray,
    *,
    vocab_size: int,
    node_budget: int = DEFAULT_NODE_BUDGET,
    labels: Sequence[int] | np.ndarray | None = None,
) -> None:
    """Raise ``TreeValidationError`` (with a rule-specific ``.code``) unless the tree is well formed.

    Codes: ``bad_budget`` (node_budget outside [0, MAX_NODE_BUDGET]), ``bad_shape``/``bad_dtype`` (not a 1-D int
    sequence), ``length_mismatch``, ``tree_empty``, ``tree_too_large``, ``bad_root_parent``,
    ``parent_out_of_range``, ``parent_not_before_child``, ``token_out_of_vocab``, ``duplicate_sibling``,
    ``bad_label``.

    >>> validate_tree([7, 11, 12], [-1, 0, 1], vocab_size=100)
    >>> validate_tree([7, 11, 11], [-1, 0, 0], vocab_size=100)
    Traceback (most recent call last):
    ...
    vllm_hyco.errors.TreeValidationError: rows 1 and 2 are both children of row 0 with token 11; ...
    """
    if not 0 <= node_budget <= MAX_NODE_BUDGET:
        raise TreeValidationError(
            f"node budget {node_budget} is outside [0, {MAX_NODE_BUDGET}]; a tree holds at most "
            f"{MAX_TREE_ROWS} rows, the root included",
            code="bad_budget",
        )
    tok = _int_list("tokens", tokens)
    par = _int_list("parents", parents)
    lab = None if labels is None else _int_list("labels", labels)
    _check_shape(tok, par, lab, node_budget)
    _check_parents(par)
    _check_tokens(tok, par, vocab_size)
    if lab is not None:
        _check_labels(lab)


MAX_DRAFT_Q_ENTRIES = 64  # ids per sampled row (the request's top-k 64 bounds a useful q)


def check_draft_q(tokens: Sequence[int], parents: Sequence[int], rows: Sequence[int],
                  ids: Sequence[Sequence[int]], weights: Sequence[Sequence[int]],
                  vocab_size: int | None = None) -> None:
    """Raise ``TreeValidationError`` (code ``bad_draft_q``) unless the sampled rows' distributions fit the
    tree: rows ascend within 1..n, each row's q has 1..64 distinct ids (inside the vocabulary when given)
    with weights >= 1, its own token is among them, and no node has two sampled children (the coupled
    sample at a node serves one drawn child; ``vllm_hyco.spec_decode.coupling``).

    >>> check_draft_q([7, 11, 12], [-1, 0, 0], [1], [[11, 3]], [[5, 1]])
    >>> check_draft_q([7, 11, 12], [-1, 0, 0], [1, 2], [[11], [12]], [[1], [1]])
    Traceback (most recent call last):
    ...
    vllm_hyco.errors.TreeValidationError: draft_q rows 1 and 2 share parent 0; a node can have one sampled child
    """
    n = len(tokens) - 1

    def bad(msg: str) -> TreeValidationError:
        return TreeValidationError(f"draft_q {msg}", code="bad_draft_q")

    if not (len(rows) == len(ids) == len(weights)):
        raise bad(f"has {len(rows)} rows, {len(ids)} id lists and {len(weights)} weight lists; one of each per row")
    seen: dict[int, int] = {}
    for k, r in enumerate(rows):
        if not 1 <= r <= n or (k and r <= rows[k - 1]):
            raise bad(f"rows must ascend within 1..{n}, got {list(rows)}")
        i, w = list(ids[k]), list(weights[k])
        if not 1 <= len(i) <= MAX_DRAFT_Q_ENTRIES or len(w) != len(i):
            raise bad(f"row {r} has {len(i)} ids and {len(w)} weights; send 1..{MAX_DRAFT_Q_ENTRIES} of each")
        if len(set(i)) != len(i):
            raise bad(f"row {r} repeats an id")
        if min(w) < 1:
            raise bad(f"row {r} has a weight below 1; leave zero-mass ids out")
        if vocab_size is not None and (min(i) < 0 or max(i) >= vocab_size):
            raise bad(f"row {r} holds an id outside [0, {vocab_size})")
        if tokens[r] not in i:
            raise bad(f"row {r}: its token {tokens[r]} is not among the ids it was drawn from")
        p = parents[r]
        if p in seen:
            raise bad(f"rows {seen[p]} and {r} share parent {p}; a node can have one sampled child")
        seen[p] = r
