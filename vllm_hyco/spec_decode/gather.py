"""Step gathering: hold a step that would run only phone trees while sessions about to submit can join it.

A step's cost is a fixed part plus a part per row (``budget.StepCostModel``). Under load the phones' round
trips (link and drafting) spread their trees out, so each step runs two or three trees and pays the fixed
part for few tokens: measured on the CPU build at 16 phones, 2-3 trees per step, against Cloud+MTP's 16
requests per step (docs/benchmarks.md). The engine can wait a little for the trees it expects: every
session's round trip (verdict taken -> next tree submitted) is measured, so the next arrival of each
session now in its round trip is predicted.

The rule (:meth:`StepGather.hold_until`): a step whose runnable work is only submitted trees is held
while sessions in their round trip are expected before ``first tree ready + predicted step time``, the
step's time predicted with the trees expected to join it (k sessions are waited for when the k-th
expected arrival comes before the predicted end of a step with k more trees); the step runs at that
deadline, or as soon as no expected session is left (each submission re-evaluates it). So a tree waits
at most the predicted time of the step it joins, the wait a tree arriving just after that step started
pays anyway, and every session that arrives in the window shares the step's fixed cost; a burst of
trees that reaches the engine over longer than the first tree's own step is still gathered.

Round trips move together: the sessions of one step take their verdicts at the same moment, and a slow
or fast round (the server's own step, a shared link, phones released together) moves all of them. So the
expected arrivals are shifted by the *lateness* of the trees already pending (each one's submission time
minus its expected time; their median, at most one round trip either way): when the pending trees came
100 ms later than their averages said, the others are expected 100 ms later too. Without the shift a round
slower or faster than the average by more than one step time held nothing: the others looked overdue or
not due yet, and the step ran with the first tree or two (measured with phase-locked phones,
docs/benchmarks.md).

Nothing is held while an ordinary request, a prefill or an unfinished output is in the engine (the
adapter checks that), and nothing is held before the cost model is fitted. Pure Python; the engine wiring is
``vllm_adapter/engine_core/step_gather.py`` (``HycoScheduler.has_requests``) and
``vllm_adapter/patches/engine_core_methods.py`` (the wake-up).

    >>> g = StepGather()
    >>> g.taken("a", 0.00); g.submitted("a", 0.10)   # a's round trip: 100 ms
    >>> g.taken("a", 0.20); g.taken("b", 0.20); g.submitted("b", 0.25)
    >>> g.hold_until(0.25, 0.02, ["a"], now=0.26) is None   # a is expected at 0.30, after 0.25 + 0.02
    True
    >>> g.hold_until(0.25, 0.06, ["a"], now=0.26)           # within 0.25 + 0.06: hold until then
    0.31
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable


class StepGather:
    """Per-session round-trip estimates (exponential average, ``alpha`` per round) and the hold rule."""

    def __init__(self, alpha: float = 0.25):
        self.alpha = alpha
        self.gap: dict[str, float] = {}  # sid -> average seconds from verdict taken to next tree submitted
        self.taken_at: dict[str, float] = {}  # sid -> when its last verdict was taken (in its round trip)
        self.ready_at: dict[str, float] = {}  # sid -> when its pending tree was submitted
        self.late: dict[str, float] = {}  # sid -> its pending tree's submission time minus its expected time
        self.holds = 0  # holds started (the adapter counts them and logs a few)

    def taken(self, sid: str, now: float) -> None:
        self.taken_at[sid] = now
        self.ready_at.pop(sid, None)
        self.late.pop(sid, None)

    def submitted(self, sid: str, now: float) -> None:
        t = self.taken_at.pop(sid, None)
        if t is not None and now >= t:
            g = now - t
            old = self.gap.get(sid)
            if old is not None:
                self.late[sid] = g - old
            self.gap[sid] = g if old is None else old + self.alpha * (g - old)
        self.ready_at[sid] = now

    def forget(self, sid: str) -> None:
        for d in (self.gap, self.taken_at, self.ready_at, self.late):
            d.pop(sid, None)

    def lateness(self, pending: Iterable[str]) -> float:
        """The median lateness of the pending trees (0 when none has an estimate)."""
        xs = [self.late[s] for s in pending if s in self.late]
        return statistics.median(xs) if xs else 0.0

    def expected(self, sid: str) -> float | None:
        """When ``sid``'s next tree is expected, or None (not in its round trip, or no estimate yet)."""
        t, g = self.taken_at.get(sid), self.gap.get(sid)
        return None if t is None or g is None else t + g

    def hold_until(self, ready_since: float, horizon: float | Callable[[int], float], waiting: Iterable[str], *,
                   now: float, pending: Iterable[str] = ()) -> float | None:
        """The deadline to hold the step until, or None to run it now.

        ``ready_since``: when the oldest pending tree was submitted; ``horizon``: the predicted seconds of
        the step, or ``horizon(k)``: of the step when ``k`` more trees join it; ``waiting``: the sessions
        in their round trip (parked with their verdict taken); ``pending``: the sessions whose trees wait
        for the step (their lateness shifts the others' expected arrivals, at most by each one's own round
        trip). The step waits for the most sessions ``k`` whose ``k``-th expected arrival falls before
        ``ready_since + horizon(k)``: a tree waits at most the predicted time of the step it joins, the
        wait a tree arriving just after that step started would pay anyway. A session overdue by more than
        ``horizon(0)`` (it stopped submitting, or its phone is far slower than its average) is not waited
        for."""
        hz = horizon if callable(horizon) else (lambda k, h=horizon: h)
        h0 = hz(0)
        if not h0 > 0:
            return None
        shift = self.lateness(pending)
        times = []
        for sid in waiting:
            e = self.expected(sid)
            if e is None:
                continue
            if shift:
                g = self.gap[sid]
                e += min(max(shift, -g), g)
            if e >= now - h0:
                times.append(e)
        times.sort()
        best = 0
        for k, e in enumerate(times, start=1):
            if e <= ready_since + hz(k):
                best = k
        if not best:
            return None
        end = ready_since + hz(best)
        return end if now < end else None
