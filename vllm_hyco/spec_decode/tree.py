"""The token tree on the server: ``TokenTree``, a validated tree as torch tensors (the engine's form).

What a tree is (rows, parents, labels, depth, ancestor masks, padding, the validation rules and their codes)
is defined once in ``vllm_hyco.handoff.tree_contract`` (numpy only); this module is its torch edge: it
hands the contract host values and turns the contract's arrays into int64 tensors.

Worked example (the contract's: root 7, chain 11 -> 12, a runner-up 21 beside 11, an SLM leaf 31 under
11): ``TokenTree.from_parents([7, 11, 12, 21, 31], [-1, 0, 1, 0, 1], vocab_size=100)`` has depth
``[0, 1, 2, 1, 2]`` and ancestor masks ``[0b00001, 0b00011, 0b00111, 0b01001, 0b10011]``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hyco.errors import TreeValidationError
from vllm_hyco.handoff.tree_contract import (
    DEFAULT_NODE_BUDGET,
    NodeLabel,
    PaddedTree,
    ancestor_mask,
    depths,
    pad_tree,
    validate_tree,
)


def _host(values: Sequence[int] | torch.Tensor) -> Sequence[int] | np.ndarray:
    """A torch tensor as a host numpy array (the contract is numpy-only); anything else as is."""
    if isinstance(values, torch.Tensor):
        return np.asarray(values.detach().cpu().tolist())
    return values


def _long(values: Sequence[int] | np.ndarray) -> torch.Tensor:
    """[n] int64 tensor of validated host values."""
    return torch.as_tensor(np.asarray(values, dtype=np.int64))


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
    # [n + 1] int64 NodeLabel values, or None when the client sent no labels
    labels: torch.Tensor | None = None

    @classmethod
    def from_parents(
        cls,
        tokens: Sequence[int] | torch.Tensor,
        parents: Sequence[int] | torch.Tensor,
        *,
        vocab_size: int,
        node_budget: int = DEFAULT_NODE_BUDGET,
        labels: Sequence[int] | torch.Tensor | None = None,
    ) -> TokenTree:
        """Validate (``tree_contract.validate_tree``) and derive depth and ancestor masks.

        >>> TokenTree.from_parents([7, 11, 12, 21], [-1, 0, 1, 0], vocab_size=100).depth.tolist()
        [0, 1, 2, 1]
        """
        host_tokens, host_parents = _host(tokens), _host(parents)
        host_labels = None if labels is None else _host(labels)
        validate_tree(host_tokens, host_parents, vocab_size=vocab_size, node_budget=node_budget, labels=host_labels)
        return cls(
            tokens=_long(host_tokens),
            parents=_long(host_parents),
            depth=torch.from_numpy(depths(host_parents)),
            ancestor_mask=torch.from_numpy(ancestor_mask(host_parents)),
            labels=None if host_labels is None else _long(host_labels),
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
        out = torch.full((self.num_rows,), int(NodeLabel.OTHER), dtype=torch.int64)
        out[0] = int(NodeLabel.ROOT)
        return out

    def padded(self, num_rows: int) -> PaddedTree:
        """The contract's padded form (numpy, ``tree_contract.pad_tree``): the last row repeated.

        >>> t = TokenTree.from_parents([7, 11], [-1, 0], vocab_size=100).padded(4)
        >>> t.tokens.tolist(), t.valid.tolist()
        ([7, 11, 11, 11], [True, True, False, False])
        """
        return pad_tree(self.tokens.tolist(), self.parents.tolist(), num_rows)

    def to_wire(self) -> dict[str, list[int]]:
        """Plain lists for the wire codec: ``{"tokens", "parents"[, "labels"]}`` (no padding)."""
        out = {"tokens": self.tokens.tolist(), "parents": self.parents.tolist()}
        if self.labels is not None:
            out["labels"] = self.labels.tolist()
        return out

    @classmethod
    def from_wire(
        cls, wire: dict[str, Sequence[int]], *, vocab_size: int, node_budget: int = DEFAULT_NODE_BUDGET
    ) -> TokenTree:
        """Inverse of ``to_wire``; validates like ``from_parents``."""
        missing = [k for k in ("tokens", "parents") if k not in wire]
        if missing:
            raise TreeValidationError(f"wire tree lacks {missing}", code="length_mismatch")
        return cls.from_parents(
            wire["tokens"], wire["parents"], vocab_size=vocab_size, node_budget=node_budget,
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
        return cls.from_parents(tokens, parents, vocab_size=vocab_size, node_budget=max(num_nodes, 0),
                                labels=labels)
