"""NullProposer: the ``custom_class`` drafter of a HyCo engine (vLLM 0.32 custom_class interface).

HyCo's drafts come from the phone, so the server's proposer drafts nothing: with it, vLLM schedules no
speculative tokens of its own and runs no MTP head. Later, HycoScheduler puts the phone's tree into the
spec slots. (docs/vllm-notes.md §1: the proposer never sees request ids, so it cannot do more.)
"""

from __future__ import annotations

from typing import Any


class NullProposer:
    """``propose`` returns one empty draft per batch row.

    >>> NullProposer(None).propose([[5], [7, 8]], None, None)
    [[], []]
    """

    def __init__(self, vllm_config: Any):
        self.vllm_config = vllm_config

    def load_model(self, target_model: Any) -> None:
        """Nothing to load: no server-side drafter."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                **kwargs: Any) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]
