"""Per-round acceptance statistics, summable across rounds and requests, JSON-ready.

>>> a = RoundStats.from_counts(accepted=2, hits=1, per_depth=[1, 1], per_source=[0, 1, 0, 1, 0],
...                            eps_only_per_source=[0, 0, 0, 1, 0], drafted=5)
>>> (a + a).to_dict()["mean_accepted_length"]
2.0
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm_hyco.handoff.tree_contract import NodeLabel

NUM_SOURCES = len(NodeLabel)


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass(frozen=True)
class RoundStats:
    """Counts over one or more rounds. ``per_depth[d]`` counts accepted nodes at depth d + 1;
    ``per_source[s]`` and ``eps_only_per_source[s]`` count accepted nodes labelled ``NodeLabel(s)``
    (unlabelled trees count as OTHER). Accepted length excludes the bonus token."""

    rounds: int = 0
    accepted: int = 0
    hits: int = 0
    eps_only: int = 0
    drafted: int = 0
    per_depth: list[int] = field(default_factory=list)
    per_source: list[int] = field(default_factory=lambda: [0] * NUM_SOURCES)
    eps_only_per_source: list[int] = field(default_factory=lambda: [0] * NUM_SOURCES)

    @classmethod
    def from_counts(cls, *, accepted: int, hits: int, per_depth: Iterable[int], per_source: Iterable[int],
                    eps_only_per_source: Iterable[int], drafted: int = 0) -> RoundStats:
        """One round's stats."""
        assert 0 <= hits <= accepted, (hits, accepted)
        return cls(
            rounds=1, accepted=accepted, hits=hits, eps_only=accepted - hits, drafted=drafted,
            per_depth=[int(x) for x in per_depth], per_source=[int(x) for x in per_source],
            eps_only_per_source=[int(x) for x in eps_only_per_source],
        )

    def __add__(self, other: RoundStats) -> RoundStats:
        return RoundStats(
            rounds=self.rounds + other.rounds,
            accepted=self.accepted + other.accepted,
            hits=self.hits + other.hits,
            eps_only=self.eps_only + other.eps_only,
            drafted=self.drafted + other.drafted,
            per_depth=_add_lists(self.per_depth, other.per_depth),
            per_source=_add_lists(self.per_source, other.per_source),
            eps_only_per_source=_add_lists(self.eps_only_per_source, other.eps_only_per_source),
        )

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per round (MAT counts the bonus too: this + 1)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        """JSON/metrics form; sources keyed by lower-case NodeLabel names."""
        names = [s.name.lower() for s in NodeLabel]
        return {
            "rounds": self.rounds,
            "accepted": self.accepted,
            "hits": self.hits,
            "eps_only": self.eps_only,
            "drafted": self.drafted,
            "mean_accepted_length": self.mean_accepted_length,
            "per_depth": list(self.per_depth),
            "per_source": dict(zip(names, self.per_source)),
            "eps_only_per_source": dict(zip(names, self.eps_only_per_source)),
        }
