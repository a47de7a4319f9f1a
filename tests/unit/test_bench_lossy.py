"""The lossy-step attribution (hyco_lab.bench.lossy): reached and accepted per depth under greedy verification,
the paired bootstrap against the float reference, and the report table."""

import numpy as np

from hyco_lab.bench import lossy


class _Chain:
    def __init__(self, chain):
        self.chain = chain


class _Drafter:
    """Drafts the verifier's own next tokens, wrong from ``wrong_at`` (a depth, 0-based) on."""

    def __init__(self, seq, wrong_at):
        self.seq, self.wrong_at, self.lut, self.t0 = seq, wrong_at, None, -1

    def apply_handoff(self, t, a, rows):
        self.t = t

    def draft(self, x_hat):
        nxt = self.seq[self.t + 1: self.t + 1 + lossy.K]
        return _Chain([tok if d < self.wrong_at else -1 for d, tok in enumerate(nxt)])


def test_a_node_is_reached_when_its_ancestors_match_and_accepted_when_it_does():
    seq = list(range(20))
    kv = {"sliding_attention": (np.zeros((20, 1, 2)), np.zeros((20, 1, 2)))}
    out = lossy.counts(_Drafter(seq, wrong_at=2), None, None, (), seq, start=5, h=np.zeros((20, 3)), kv=kv,
                       scales=None, kv_scales={}, embed=np.zeros((30, 3)), hidden=3)
    positions = len(seq) - lossy.K - 1 - (5 - 1)
    assert out[0].tolist() == [positions, positions, positions, 0]  # depth 3 fails, so depth 4 is never reached
    assert out[1].tolist() == [positions, positions, 0, 0]


def test_the_difference_interval_pairs_prompts_and_the_table_shows_it():
    a = np.array([[[10, 8, 6, 4], [7, 6, 4, 2]]] * 5, dtype=float)
    b = np.array([[[10, 8, 6, 4], [7, 6, 5, 3]]] * 5, dtype=float)
    ci = lossy._boot(a, b, np.random.default_rng(0))
    assert ci[0] == [0.0, 0.0] and ci[2][0] == ci[2][1] == round(4 / 6 - 5 / 6, 4)
    r = {"prompts": 5, "tokens": 8, "k": 4, "variants": {
        "float": {"reached": [50, 40, 30, 20], "rate": [0.7, 0.75, 0.833, 0.75], "diff_ci": None},
        "kv8": {"reached": [50, 40, 30, 20], "rate": [0.7, 0.75, 0.667, 0.5], "diff_ci": ci}}}
    md = lossy.markdown(r)
    assert "| kv8 | 0.700 (50) +0.000 [+0.000, +0.000] |" in md and "-0.167" in md
