"""The token tree: one owner, one canonical form (wire and engine).

A tree has ``n + 1`` rows in insertion order. Row 0 is the root (the last committed token, x_{t+1} in the
paper); rows 1..n are drafted nodes. ``tokens[i]`` is the token id of row i and ``parents[i]`` the row of
its parent: the parent token of ``tokens[i]`` is ``tokens[parents[i]]``. ``parents[0] == -1`` and
``0 <= parents[i] < i`` for every other row, so a parent's row always comes before its children's. The
node budget B counts drafted nodes, not the root (default 32, so at most 33 rows).

Worked example (root 7, chain 11 -> 12, a runner-up 21 beside 11, an SLM leaf 31 under 11)::

    row      0   1   2   3   4
    token    7  11  12  21  31          root 7 at position t
    parent  -1   0   1   0   1            11 (t+1) -- 12 (t+2)
    depth    0   1   2   1   2          /             \\
    label    R   C   C   U   S         7                31 (t+2)
                                        \\
                                         21 (t+1)

Row j takes position ``t + depth[j]`` and attends to the committed prefix, its ancestor rows and itself.
``ancestor_mask[j]`` has bit i set iff row i is an ancestor of row j or j itself: here
``[0b00001, 0b00011, 0b00111, 0b01001, 0b10011]``.

Resolved ambiguities (docs/acceptance.md): two children of one node with the same token are *rejected*
(docs/decisions.md D3), not silently deduplicated; a root-only tree (n = 0) is valid, it verifies to just a
bonus token; a tree with no rows at all is ``tree_empty``.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hyco.errors import TreeValidationError

DEFAULT_BUDGET = 32
# The ancestor bitmask is one int64 per row, so a tree has at most 64 rows (bit 63 is the sign bit).
MAX_ROWS = 64


class NodeSource(enum.IntEnum):
    """Who proposed a node. The values go on the wire and the phone uses them."""

    ROOT = 0
    CHAIN = 1
    RUNNER_UP = 2
    SLM = 3
    OTHER = 4


def _as_int_list(name: str, values: Any) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise TreeValidationError(
                f"{name} must be 1-D, got shape {tuple(values.shape)}", code="bad_shape"
            )
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise TreeValidationError(
                f"{name} must hold integers, got dtype {values.dtype}", code="bad_dtype"
            )
        return [int(v) for v in values.tolist()]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__"):
            raise TreeValidationError(
                f"{name} must hold integers, got {type(v).__name__} {v!r}", code="bad_dtype"
            )
        out.append(int(v))
    return out


def _check_shape(tokens: list[int], parents: list[int], labels, budget: int) -> None:
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
    if len(tokens) - 1 > budget:
        raise TreeValidationError(
            f"tree has {len(tokens) - 1} nodes (plus the root) but the node budget is {budget}; "
            f"trim it to the {budget} best nodes",
            code="tree_too_large",
        )


def _check_parents(parents: list[int]) -> None:
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
    valid = {int(s) for s in NodeSource}
    if labels[0] != NodeSource.ROOT:
        raise TreeValidationError(
            f"row 0 must be labelled ROOT (0), got {labels[0]}", code="bad_label"
        )
    for i in range(1, len(labels)):
        if labels[i] not in valid or labels[i] == NodeSource.ROOT:
            raise TreeValidationError(
                f"row {i} has label {labels[i]}; node labels are 1 (chain), 2 (runner-up), "
                f"3 (SLM) or 4 (other)",
                code="bad_label",
            )


def validate_tree(
    tokens: Sequence[int] | torch.Tensor,
    parents: Sequence[int] | torch.Tensor,
    *,
    vocab_size: int,
    budget: int = DEFAULT_BUDGET,
    labels: Sequence[int] | torch.Tensor | None = None,
) -> None:
    """Raise ``TreeValidationError`` (with a rule-specific ``.code``) unless the tree is well formed.

    Codes: ``bad_shape``/``bad_dtype`` (not a 1-D int sequence), ``length_mismatch``, ``tree_empty``,
    ``tree_too_large``, ``bad_root_parent``, ``parent_out_of_range``, ``parent_not_before_child``,
    ``token_out_of_vocab``, ``duplicate_sibling``, ``bad_label``.

    >>> validate_tree([7, 11, 12], [-1, 0, 1], vocab_size=100)
    >>> validate_tree([7, 11, 11], [-1, 0, 0], vocab_size=100)
    Traceback (most recent call last):
    ...
    vllm_hyco.errors.TreeValidationError: rows 1 and 2 are both children of row 0 with token 11; ...
    """
    if not 0 <= budget <= MAX_ROWS - 1:
        raise TreeValidationError(
            f"node budget {budget} is outside [0, {MAX_ROWS - 1}]", code="bad_budget"
        )
    tok = _as_int_list("tokens", tokens)
    par = _as_int_list("parents", parents)
    lab = None if labels is None else _as_int_list("labels", labels)
    _check_shape(tok, par, lab, budget)
    _check_parents(par)
    _check_tokens(tok, par, vocab_size)
    if lab is not None:
        _check_labels(lab)


def _depths(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def _ancestor_masks(parents: list[int]) -> list[int]:
    masks = [1]
    for i in range(1, len(parents)):
        masks.append(masks[parents[i]] | (1 << i))
    # Store as signed int64 (bit 63, if used, becomes the sign bit).
    return [m - (1 << 64) if m >= (1 << 63) else m for m in masks]


@dataclass(frozen=True)
class PaddedTree:
    """A tree padded to a fixed row count by repeating its last row; ``valid`` marks the real rows."""

    # [num_rows] int64
    tokens: torch.Tensor
    # [num_rows] int64 (pad rows repeat the last row's parent)
    parents: torch.Tensor
    # [num_rows] int64
    depth: torch.Tensor
    # [num_rows] int64 bitmask (pad rows repeat the last row's mask)
    ancestor_mask: torch.Tensor
    # [num_rows] bool, True for the tree's own rows
    valid: torch.Tensor

    def positions(self, t: int) -> torch.Tensor:
        """[num_rows] int64: ``t + depth`` (pad rows take the last row's position)."""
        return self.depth + t


@dataclass(frozen=True)
class TokenTree:
    """A validated token tree (see the module docstring for the encoding and a worked example).

    Build it with ``from_parents`` (validates) or ``from_wire``; the fields are derived once.
    """

    # [n + 1] int64, row 0 is the root
    tokens: torch.Tensor
    # [n + 1] int64, parents[0] == -1
    parents: torch.Tensor
    # [n + 1] int64, depth[0] == 0
    depth: torch.Tensor
    # [n + 1] int64, bit j set iff row j is an ancestor of the row or the row itself
    ancestor_mask: torch.Tensor
    # [n + 1] int64 NodeSource values, or None when the client sent no labels
    labels: torch.Tensor | None = None

    @classmethod
    def from_parents(
        cls,
        tokens: Sequence[int] | torch.Tensor,
        parents: Sequence[int] | torch.Tensor,
        *,
        vocab_size: int,
        budget: int = DEFAULT_BUDGET,
        labels: Sequence[int] | torch.Tensor | None = None,
    ) -> TokenTree:
        """Validate (``validate_tree``) and derive depth and ancestor masks.

        >>> TokenTree.from_parents([7, 11, 12, 21], [-1, 0, 1, 0], vocab_size=100).depth.tolist()
        [0, 1, 2, 1]
        """
        validate_tree(tokens, parents, vocab_size=vocab_size, budget=budget, labels=labels)
        tok = _as_int_list("tokens", tokens)
        par = _as_int_list("parents", parents)
        lab = None if labels is None else torch.tensor(_as_int_list("labels", labels), dtype=torch.int64)
        return cls(
            tokens=torch.tensor(tok, dtype=torch.int64),
            parents=torch.tensor(par, dtype=torch.int64),
            depth=torch.tensor(_depths(par), dtype=torch.int64),
            ancestor_mask=torch.tensor(_ancestor_masks(par), dtype=torch.int64),
            labels=lab,
        )

    @property
    def num_rows(self) -> int:
        """n + 1 (root included)."""
        return int(self.tokens.numel())

    @property
    def num_nodes(self) -> int:
        """n, the drafted nodes (what the budget counts)."""
        return self.num_rows - 1

    def positions(self, t: int) -> torch.Tensor:
        """[n + 1] int64: row j sits at position ``t + depth[j]`` (the root at t)."""
        return self.depth + t

    def source_labels(self) -> torch.Tensor:
        """[n + 1] int64 labels; an unlabelled tree reads ROOT for row 0 and OTHER elsewhere."""
        if self.labels is not None:
            return self.labels
        out = torch.full((self.num_rows,), int(NodeSource.OTHER), dtype=torch.int64)
        out[0] = int(NodeSource.ROOT)
        return out

    def padded(self, num_rows: int) -> PaddedTree:
        """Pad to ``num_rows`` rows by repeating the last row (the phone's static graphs do the same).

        >>> t = TokenTree.from_parents([7, 11], [-1, 0], vocab_size=100).padded(4)
        >>> t.tokens.tolist(), t.valid.tolist()
        ([7, 11, 11, 11], [True, True, False, False])
        """
        n = self.num_rows
        if num_rows < n:
            raise TreeValidationError(
                f"cannot pad a {n}-row tree to {num_rows} rows", code="tree_too_large"
            )
        idx = torch.arange(num_rows).clamp(max=n - 1)  # [num_rows]
        return PaddedTree(
            tokens=self.tokens[idx],
            parents=self.parents[idx],
            depth=self.depth[idx],
            ancestor_mask=self.ancestor_mask[idx],
            valid=torch.arange(num_rows) < n,
        )

    def to_wire(self) -> dict[str, list[int]]:
        """Plain lists for the wire codec: ``{"tokens", "parents"[, "labels"]}`` (no padding)."""
        out = {"tokens": self.tokens.tolist(), "parents": self.parents.tolist()}
        if self.labels is not None:
            out["labels"] = self.labels.tolist()
        return out

    @classmethod
    def from_wire(
        cls, wire: dict[str, Sequence[int]], *, vocab_size: int, budget: int = DEFAULT_BUDGET
    ) -> TokenTree:
        """Inverse of ``to_wire``; validates like ``from_parents``."""
        missing = [k for k in ("tokens", "parents") if k not in wire]
        if missing:
            raise TreeValidationError(f"wire tree lacks {missing}", code="length_mismatch")
        return cls.from_parents(
            wire["tokens"], wire["parents"], vocab_size=vocab_size, budget=budget,
            labels=wire.get("labels"),
        )

    @classmethod
    def make_dummy(
        cls,
        num_nodes: int = 4,
        *,
        kind: str = "chain",
        vocab_size: int = 1000,
        seed: int = 0,
        labelled: bool = False,
    ) -> TokenTree:
        """A small valid tree from plain lists, for tests: ``kind`` is "chain", "star" or "random".

        Random trees draw each parent uniformly below the row and give siblings distinct tokens.
        """
        if kind not in ("chain", "star", "random"):
            raise ValueError(f"unknown dummy tree kind {kind!r}")
        rng = random.Random(seed)
        parents, tokens = [-1], [rng.randrange(vocab_size)]
        used: dict[int, set[int]] = {}
        for i in range(1, num_nodes + 1):
            parent = {"chain": i - 1, "star": 0}.get(kind)
            while parent is None or len(used.get(parent, ())) >= vocab_size:
                if kind != "random":
                    raise ValueError(f"{num_nodes} siblings do not fit a vocabulary of {vocab_size}")
                parent = rng.randrange(i)
            taken = used.setdefault(parent, set())
            tok = rng.choice([t for t in range(vocab_size) if t not in taken]) if vocab_size <= 64 \
                else rng.randrange(vocab_size)
            while tok in taken:
                tok = rng.randrange(vocab_size)
            taken.add(tok)
            parents.append(parent)
            tokens.append(tok)
        labels = None
        if labelled:
            labels = [0] + [rng.choice([1, 2, 3, 4]) for _ in range(num_nodes)]
        return cls.from_parents(tokens, parents, vocab_size=vocab_size, budget=max(num_nodes, 0),
                                labels=labels)
