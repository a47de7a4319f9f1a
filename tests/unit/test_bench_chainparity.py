"""Chain parity (hyco_lab.bench.chainparity): the phone's chain and vLLM's MTP counted with the same conditional
metric, from a run's records."""

from hyco_lab.bench.chainparity import chain_counts, parity


def _round(path, nodes=6):
    # root -> chain 1 -> chain 2 -> chain 3, an SLM sibling of chain 1 (4) and of chain 2 (5)
    return {"nodes": nodes, "tree": {"parents": [-1, 0, 1, 2, 0, 1, 2], "sources": [0, 1, 1, 1, 3, 3, 3],
                                     "path": path}}


def test_the_chain_is_counted_per_depth_inside_the_cut():
    reached, accepted = chain_counts([_round([1, 2, 3]), _round([4]), _round([1, 5]), _round([1, 2, 3], nodes=2)], 4)
    assert reached.tolist() == [4, 3, 1, 0] and accepted.tolist() == [3, 2, 1, 0]  # the 4th round: cut after 2


def test_parity_pairs_the_phone_with_vllms_counters():
    records = [{"config": "hyco-exact", "run": 0, "requests": [{"rounds": [_round([1, 2, 3]), _round([4])]}]},
               {"config": "hyco-exact", "run": 1, "requests": [{"rounds": [_round([1, 5])]}]},
               {"config": "cloud-mtp", "run": -1, "spec_counters": {"drafts": 9, "accepted_per_pos": [9, 9, 9, 9]}},
               *({"config": "cloud-mtp", "run": r, "spec_counters": {"drafts": 10, "accepted_per_pos": [5, 4, 2, 1]}}
                 for r in (0, 1))]
    (row,) = parity(records, depth=3)
    assert (row["phone_requests"], row["cloud_runs"]) == (2, 2)  # the warm-up run (-1) is left out
    assert row["phone_rate"] == [round(2 / 3, 4), 0.5, 1.0] and row["cloud_rate"] == [0.5, 0.8, 0.5]
    assert row["diff"] == [round(2 / 3 - 0.5, 4), -0.3, 0.5]


def test_the_adaptive_cut_is_read_from_the_grant():
    # 6 nodes sent, the verdict granted (kept) 2: chain depth 3 was never verified; a last round (grant 0) counts whole
    cut = _round([1, 2]) | {"budget": 2}
    last = _round([1, 2, 3]) | {"budget": 0}
    reached, accepted = chain_counts([cut, last], 4)
    assert reached.tolist() == [2, 2, 1, 0] and accepted.tolist() == [2, 2, 1, 0]
