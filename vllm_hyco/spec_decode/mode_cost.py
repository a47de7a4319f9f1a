"""What a committed token costs the server in each session mode, measured from its own steps (pure Python).

A phone session's mode rule (``mobile_client.mode_rule``) keeps the phone drafting because that saves the
server its drafting. Whether it does is a measurement, not a given: a tree of phone-drafted nodes costs more
rows, tree attention and hand-off work than vLLM's MTP chain, and pays only when it commits enough more tokens
per step. On a big MoE verifier at the memory limit phone mode is the cheaper one (docs/engine.md, the cost
model); on this project's CPU fixtures server mode is (docs/benchmarks.md, "Server mode per link"). So the
engine measures both and the server advertises them (``session`` and ``pong`` frames, protocol section 4.12).

**Attribution.** Each step's measured cost (the node budget's clock: schedule + execute + update, process
CPU on a CPU engine, wall on an accelerator) is split over the step's rows: a decoding request's share is
its rows over the step's rows. Rows of requests still prefilling are not attributed (a session's prefill is
paid once, whichever mode it then runs in). HyCo's utility calls since the step before (tree submission,
verdict take) are phone mode's alone. The rows' modes: a phone-mode session verifying a tree is ``phone``;
a server-mode session, and an ordinary request when the server drafts ordinary requests with vLLM's MTP,
is ``server`` (server mode is an ordinary MTP request in the engine). A mode's cost per token is its decayed
attributed seconds over its decayed committed tokens (``HALF_LIFE_TOKENS`` of the mode's tokens count half).

Row shares are an average, not a marginal cost: in a mixed batch they charge each mode its rows' part of the
step's fixed cost. With one session at a time (the link sweep) they are exact.

>>> m = ModeCost(min_tokens=4)
>>> m.observe(0.010, {"a": ("phone", 5)}, {"a": 3}, utility_s=0.002)
>>> m.observe(0.006, {"b": ("server", 3)}, {"b": 2})
>>> m.ms_per_token("phone") == 0.0  # 3 tokens: fewer than min_tokens, not known yet
True
>>> m.observe(0.010, {"a": ("phone", 5), "b": ("server", 3)}, {"a": 3, "b": 2})
>>> round(m.ms_per_token("phone"), 3), round(m.ms_per_token("server"), 3)
(3.041, 2.437)
"""

from __future__ import annotations

from collections.abc import Mapping

MODES = ("phone", "server")
HALF_LIFE_TOKENS = 4096.0  # a mode's tokens after which its older steps count half
MIN_TOKENS = 128  # tokens of a mode before its cost is advertised (0.0 until then: unknown)


class ModeCost:
    """Decayed server seconds and committed tokens per session mode (module docstring)."""

    def __init__(self, *, half_life_tokens: float = HALF_LIFE_TOKENS, min_tokens: int = MIN_TOKENS) -> None:
        self.half_life, self.min_tokens = half_life_tokens, min_tokens
        self.seconds = dict.fromkeys(MODES, 0.0)
        self.tokens = dict.fromkeys(MODES, 0.0)
        self.seen = dict.fromkeys(MODES, 0)  # tokens ever counted (not decayed): the advertising threshold

    def observe(self, step_s: float, rows: Mapping[str, tuple[str, int]], tokens: Mapping[str, int], *,
                utility_s: float = 0.0, total_rows: int | None = None) -> None:
        """One step: ``step_s`` its cost (without ``utility_s``, the HyCo utility calls since the step
        before); ``rows`` request id -> (mode, rows) of its decoding requests; ``tokens`` request id -> tokens
        it committed; ``total_rows`` the step's rows, prefill included (default: the decoding rows)."""
        decoding = sum(n for _, n in rows.values())
        total = max(total_rows if total_rows is not None else decoding, decoding)
        if total <= 0:
            return
        spent, got = dict.fromkeys(MODES, 0.0), dict.fromkeys(MODES, 0)
        for req, (mode, n) in rows.items():
            spent[mode] += step_s * n / total
            got[mode] += int(tokens.get(req, 0))
        if got["phone"] or spent["phone"]:
            spent["phone"] += utility_s
        for mode in MODES:
            if got[mode] <= 0 and spent[mode] <= 0:
                continue
            keep = 0.5 ** (got[mode] / self.half_life)
            self.seconds[mode] = self.seconds[mode] * keep + spent[mode]
            self.tokens[mode] = self.tokens[mode] * keep + got[mode]
            self.seen[mode] += got[mode]

    def ms_per_token(self, mode: str) -> float:
        """Milliseconds of server compute per token committed in ``mode``; 0.0 while unknown."""
        if self.seen[mode] < self.min_tokens or self.tokens[mode] <= 0:
            return 0.0
        return 1e3 * self.seconds[mode] / self.tokens[mode]
