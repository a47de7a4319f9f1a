"""Which mode a phone session runs in: phone drafting (HyCo: the server saves its drafting) or server mode (the
server drafts with its own MTP head and streams; no round trip per round). docs/phone-loop.md "Modes".

The rule (:class:`ModeRule`) keeps the phone drafting while its measured tokens per second stay above a
**floor** (the operator's or the app's; default 6 tokens/s, about 4.5 words/s, a comfortable reading speed)
and the app says its power state allows (``power_ok``, for example not on a hot or low-battery phone), and
moves to server mode when they do not, if the server offers it. The client feeds it what it measures:

* phone rounds (``RoundStats``: tokens committed, drafting time, the wait for the verdict);
* the link's round trip (``ping`` / ``pong`` frames, one before the first tree, one every ``probe_s`` in
  server mode and one every ``offer_s`` in phone mode, sent just before a tree, when the connection carries
  nothing else that could delay the answer);
* the server's offer (``session`` and ``pong``: whether it takes a switch now, the tokens per second its
  stretches got, and what a token costs it in each mode).

**Cost**: the server advertises what a committed token costs it in each mode lately (``session`` and ``pong``:
``phone_ms``, ``server_ms``; measured on its own steps). Phone mode exists to save the server its drafting, and
server mode is the faster one for the user (no round trip per round); so where the server's measurements say
phone mode saves it less than half of ``cost_margin`` (10 %: phone mode costs over 95 % of server mode's) and
server mode meets the floor (its advertised tokens per second, unknown counting as meeting it), the rule moves
to server mode whatever the phone's rate, at once before the first tree (no probe needed); it comes back only
when phone mode saves the server at least ``cost_margin`` (the band between is the hysteresis). With either
figure unknown (0) the rule is the floor rule above.

**Hysteresis**: a switch needs its reason to hold for ``hold_s`` seconds (and, leaving phone mode, at least
``min_rounds`` measured rounds), and the way back to phone mode needs the phone's estimated tokens per second
above the floor by ``margin``, **counting the catch-up** (the seed hand-off and an SLM-only first round cost
about one more round, spread over the tokens still to come). A refused switch (``server_mode_full``...) is not
asked again for ``retry_s``.

In server mode the phone's rate is estimated, not measured: its last rounds' tokens per round and drafting
time, their wait less the round trip measured then, and the round trip measured now.

Forced policies for benchmarks and tests: :class:`PhoneOnly`, :class:`ServerOnly`, :class:`Alternate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_hyco.errors import ConfigError

DEFAULT_FLOOR_TPS = 6.0
PRIOR_MAT = 2.0  # tokens per phone round before any is measured
PRIOR_BASE_S = 0.06  # a phone round's time besides drafting and the round trip, before any is measured
PRIOR_DRAFT_S = 0.053  # the paper's device time per round (52.9 ms), before any round is measured
EMA = 0.3


class PhoneOnly:
    """Never switch (phone mode, the paper's operating point)."""

    name = "phone"
    probe_s = offer_s = math.inf

    def decide(self, mode: str, now: float, remaining: int | None = None) -> str | None:
        return None


class ServerOnly(PhoneOnly):
    """Server mode from the first round on."""

    name = "server"

    def decide(self, mode: str, now: float, remaining: int | None = None) -> str | None:
        return "server" if mode == "phone" else None


class Alternate(PhoneOnly):
    """One phone round, then a stretch of at least ``stretch_tokens`` tokens, and again (tests: a switch every
    round; give the client a small credit window, or the server runs ahead of the switch back)."""

    name = "alternate"

    def __init__(self, stretch_tokens: int = 2):
        self.stretch_tokens, self._stretch, self._phone_rounds = stretch_tokens, 0, 0

    def decide(self, mode: str, now: float, remaining: int | None = None) -> str | None:
        if mode == "phone":
            if self._phone_rounds == 0:
                return None
            self._stretch = self._phone_rounds = 0
            return "server"
        return "phone" if self._stretch >= self.stretch_tokens else None

    def observe_round(self, tokens: int, draft_s: float, wait_s: float, now: float) -> None:
        self._phone_rounds += 1

    def observe_tokens(self, n: int, now: float) -> None:
        self._stretch += n


@dataclass(frozen=True)
class ModeRuleConfig:
    floor_tps: float = DEFAULT_FLOOR_TPS  # tokens per second the session must keep
    hold_s: float = 1.0  # hysteresis: a reason to switch must hold this long
    margin: float = 0.25  # back to phone mode only when its estimate beats the floor by this fraction
    min_rounds: int = 3  # phone rounds measured before the rule leaves phone mode for speed
    probe_s: float = 0.5  # server mode: a ping this often
    offer_s: float = 5.0  # phone mode: a ping this often (with a tree), for the server's offer and the link
    retry_s: float = 10.0  # after a refused switch
    window: int = 64  # the credit window asked for (tokens)
    cost_margin: float = 0.1  # phone mode must save the server this fraction (half of it, to stay in phone mode)

    def __post_init__(self) -> None:
        if not (self.floor_tps > 0 and self.hold_s >= 0 and self.margin >= 0 and self.min_rounds >= 1
                and self.probe_s > 0 and self.retry_s >= 0 and 1 <= self.window <= 1 << 16
                and 0 <= self.cost_margin < 1 and self.offer_s > 0):
            raise ConfigError(f"ModeRuleConfig: floor_tps > 0, hold_s >= 0, margin >= 0, min_rounds >= 1, "
                              f"probe_s > 0, retry_s >= 0, window 1..65536, cost_margin in [0, 1), offer_s > 0; "
                              f"got {self}")


class ModeRule:
    """The documented rule (module docstring). ``power_ok``: the app's flag, read at every decision."""

    name = "rule"

    def __init__(self, config: ModeRuleConfig = ModeRuleConfig(), power_ok=lambda: True):
        self.cfg, self.power_ok = config, power_ok
        self.probe_s, self.offer_s = config.probe_s, config.offer_s
        self.rtt_s: float | None = None
        self.mat, self.draft_s, self.base_s = PRIOR_MAT, PRIOR_DRAFT_S, PRIOR_BASE_S
        self.phone_tps: float | None = None  # measured, EMA over phone rounds
        self.rounds = 0
        self.rounds_since = 0  # phone rounds since the last switch
        self.offers_server, self.server_tps = True, 0.0
        self.phone_ms = self.server_ms = 0.0  # the server's cost per token in each mode (0: unknown)
        self._since: float | None = None  # when the current reason to switch began
        self._refused_at = -math.inf
        self.switches = 0
        self._back = False

    # -- measurements ----------------------------------------------------------------------------------------
    def observe_rtt(self, rtt_s: float, now: float) -> None:
        self.rtt_s = rtt_s if self.rtt_s is None else (1 - EMA) * self.rtt_s + EMA * rtt_s

    def observe_offer(self, offers_server: bool, server_tps: float, phone_ms: float = 0.0,
                      server_ms: float = 0.0) -> None:
        self.offers_server, self.server_tps = offers_server, server_tps
        if phone_ms > 0 and server_ms > 0:  # a server that stops advertising keeps the last figures
            self.phone_ms, self.server_ms = phone_ms, server_ms

    def observe_round(self, tokens: int, draft_s: float, wait_s: float, now: float) -> None:
        if self.switches and self.rounds_since == 0 and self._back:  # the SLM-only catch-up round after a stretch
            self.rounds_since, self._back = 1, False
            return
        t = max(draft_s + wait_s, 1e-6)
        tps = tokens / t
        base = max(0.0, wait_s - (self.rtt_s or 0.0))
        if self.rounds == 0:
            self.phone_tps, self.mat, self.draft_s, self.base_s = tps, float(tokens), draft_s, base
        else:
            a = EMA
            self.phone_tps = (1 - a) * (self.phone_tps or tps) + a * tps
            self.mat = (1 - a) * self.mat + a * tokens
            self.draft_s, self.base_s = (1 - a) * self.draft_s + a * draft_s, (1 - a) * self.base_s + a * base
        self.rounds += 1
        self.rounds_since += 1

    def observe_tokens(self, n: int, now: float) -> None:
        pass

    def refused(self, now: float) -> None:
        self._refused_at, self._since = now, None

    # -- the decision ----------------------------------------------------------------------------------------
    def phone_estimate(self, remaining: int | None = None) -> float:
        """Tokens per second phone mode would give on the link as measured now; with ``remaining`` tokens to
        come, the catch-up of a switch back (about one round) spread over them."""
        round_s = self.draft_s + self.base_s + (self.rtt_s or 0.0)
        if round_s <= 0:
            return math.inf
        tps = self.mat / round_s
        if remaining is not None and remaining > 0:
            tps = remaining / (remaining / tps + round_s)
        return tps

    def phone_saves(self, share: float) -> bool | None:
        """Phone mode costs the server at most ``1 - share`` of server mode's, or server mode misses the floor;
        None while the server has not said what the modes cost."""
        if self.phone_ms <= 0 or self.server_ms <= 0:
            return None
        slow = 0 < self.server_tps < self.cfg.floor_tps
        return slow or self.phone_ms <= (1 - share) * self.server_ms

    def decide(self, mode: str, now: float, remaining: int | None = None) -> str | None:
        cfg = self.cfg
        if now - self._refused_at < cfg.retry_s:
            return None
        if mode == "phone":
            cheaper = self.phone_saves(cfg.cost_margin / 2) is False  # phone drafting saves the server next to nothing
            if not self.power_ok():
                reason = True
            elif self.rounds == 0 and self.switches == 0 and cheaper:  # no reason to draft on the phone at all
                return self._switch("server") if self.offers_server else None
            elif self.rounds == 0 and self.switches == 0:  # before the first tree: the link probe and the priors decide
                reason = self.rtt_s is not None and self.phone_estimate() < cfg.floor_tps
                if reason and self.offers_server:
                    return self._switch("server")
                return None
            else:
                reason = cheaper or (self.rounds_since >= cfg.min_rounds and self.phone_tps is not None
                                     and self.phone_tps < cfg.floor_tps)
            if not (reason and self.offers_server):
                self._since = None
                return None
            return self._held(now, "server")
        reason = (self.power_ok() and self.phone_saves(cfg.cost_margin) is not False
                  and self.phone_estimate(remaining) >= cfg.floor_tps * (1 + cfg.margin))
        if not reason:
            self._since = None
            return None
        return self._held(now, "phone")

    def _held(self, now: float, to: str) -> str | None:
        if self._since is None:
            self._since = now
        if now - self._since < self.cfg.hold_s:
            return None
        return self._switch(to)

    def _switch(self, to: str) -> str:
        self._since = None
        self.switches += 1
        if to == "phone":  # its rate is measured afresh before it may leave again
            self.rounds_since, self.phone_tps, self._back = 0, None, True
        return to
