"""The worker's per-session ring of hidden states (``worker/hidden_rows.py``, MiMo's seeds) and the CPU MLA
override's startup guard (``worker/cpu_mla.check_tree_prefill``)."""

from __future__ import annotations

import pytest
import torch

from vllm_hyco.errors import HardwareUnsupportedError
from vllm_hyco.vllm_adapter.worker.hidden_rows import HiddenRing


def test_a_seed_is_the_longest_run_of_computed_positions():
    ring = HiddenRing.empty(8, torch.zeros(1, 4))
    rows = torch.arange(40, dtype=torch.float32).view(10, 4)
    ring.write(torch.arange(3, 10), rows[3:10])  # positions 0..2 came from the prefix cache: never computed
    start, got = ring.read(2, 10)  # W = 8: [2, 10) wanted, position 2 is missing
    assert start == 3 and torch.equal(got, rows[3:10])
    ring.write(torch.arange(10, 14), rows[:4] + 100)  # wraps: columns of positions 2..5 now hold 10..13
    start, got = ring.read(6, 14)
    assert start == 6 and torch.equal(got[-4:], rows[:4] + 100) and torch.equal(got[:4], rows[6:10])
    ring.write(torch.tensor([12, 13]), rows[:2])  # a position computed again: its last write is kept
    assert torch.equal(ring.read(6, 14)[1][-2:], rows[:2])


def test_mla_layers_verify_trees_only_through_the_masked_prefill():
    pytest.importorskip("vllm.v1.attention.backends.mla.cpu_mla")
    from types import SimpleNamespace

    from vllm_hyco.vllm_adapter.worker.cpu_mla import HycoSDPAMLAPrefill, HycoZenSDPAMLAPrefill, check_tree_prefill

    for cls in (HycoSDPAMLAPrefill, HycoZenSDPAMLAPrefill):  # the platform tries ZEN_CPU first
        check_tree_prefill(SimpleNamespace(prefill_backend=object.__new__(cls)))
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    with pytest.raises(HardwareUnsupportedError, match="causal mask"):
        check_tree_prefill(SimpleNamespace(layer_name="model.layers.0.self_attn.attn",
                                           prefill_backend=object.__new__(CPUSDPAMLAPrefillBackend)))
