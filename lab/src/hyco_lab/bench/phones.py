"""Simulated phones for the benchmark: the drafters of each configuration and a session that records what
the metrics need (sources of the accepted nodes, modelled device time, time to first token).

Drafters come from the fixture bundle (``python -m hyco_lab.fixtures DIR``; docs/phone-loop.md's bundle
layout) and run on this machine's CPU; their *timing* is modelled (docs/decisions.md D8): the client pads each
round's drafting to the configuration's device time (``BenchClient``), 15.7 ms for the SLM-only first
round (D2), and nothing when a proactive tree is reused (SpecEdge + PD).

``MultiPassSlm`` (``mobile_client.drafters.multipass``, re-exported here) lets the phone's one-pass SLM
Drafter (``mobile_client.drafters.slm.SlmDrafter``, whose static graph only takes one pass's rows) serve
the multi-pass trees (SpecEdge-style, HyCo-2P) and proactive drafting: every forward recomputes, in the
same static call, the earlier passes' rows that the new rows attend to (their ancestors), and first
commits any committed tokens the SLM has not seen (``context``; ``PhoneSession`` now hands a reused
proactive tree's owed rows to the next forward itself). ``pure`` runs a forward without touching the
drafter's state (proactive drafting while the verdict is in flight).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from hyco_lab.bench.configs import SLM_PASS_MS, BenchConfig
from hyco_lab.bench.metrics import RoundRecord

# the multi-pass wrapper lives in the phone package (HyCo-2P is a phone option); re-exported here
from mobile_client.drafters.multipass import ROWS, MultiPassSlm
from vllm_hyco.errors import ConfigError

WINDOW = 1024


def load_phone(bundle: Path, config: BenchConfig, *, window: int = WINDOW):
    """(drafter, handoff spec or None, SessionOptions kwargs, notes) for one phone of ``config``."""
    from mobile_client.baselines import proactive_draft
    from mobile_client.bundle import chain_drafter, handoff_spec, keep_ids, read_hf_dir
    from mobile_client.drafters.base import HybridDrafter, SpecEdgeDrafter
    from mobile_client.drafters.slm import SlmDrafter
    from mobile_client.drafters.spec import SlmSpec
    from mobile_client.session import HycoPhoneDrafter

    bundle, notes = Path(bundle), []
    scfg, ssd = read_hf_dir(bundle / "slm")
    sspec = SlmSpec.from_hf_config(scfg)
    keep = keep_ids(bundle, sspec.vocab, None)
    slm = SlmDrafter(sspec, ssd, keep, window=window, rows=ROWS)
    rows = MultiPassSlm(slm)
    options: dict[str, Any] = {"mode": config.mode}
    if config.draft_sampling != "greedy":  # sampled MTP drafts (with a sampled request)
        options["draft_sampling"] = config.draft_sampling
    if config.values:  # per-node values on the wire (the server's ValueTrust decides how far to use them)
        options["values"] = True
    if config.opening is not None:
        options["opening"] = config.opening
    if config.order is not None:
        options["order"] = config.order
    # a static server budget needs nothing here: the session frame and every verdict grant the phone its
    # budget, and the phone sends the head of that size of its tree (the same phone for every budget)
    spec, mtp, scales = None, None, None
    if config.drafter in ("hybrid", "hybrid-2p"):
        spec, scales = handoff_spec(bundle)
        if scales is None:
            notes.append("no handoff_scales.npz in the bundle: SLM-only trees (no MTP chain)")
        else:
            mtp = chain_drafter(bundle, spec, keep, "torch", bundle / "build", window, notes)
        inner = HybridDrafter(mtp, rows, two_pass=config.drafter == "hybrid-2p")
    elif config.drafter == "chain":
        spec, scales = handoff_spec(bundle)
        if scales is None:
            raise ConfigError(f"{config.name} drafts the MTP chain alone; the bundle {bundle} has no "
                              f"handoff_scales.npz (no MTP chain)")
        mtp = chain_drafter(bundle, spec, keep, "torch", bundle / "build", window, notes)
        if mtp is None:
            raise ConfigError(f"{config.name} drafts the MTP chain alone; the bundle {bundle}'s family has no "
                              f"phone MTP drafter")
        inner = ChainOnlyDrafter(HybridDrafter(mtp, rows))
    else:
        inner = SpecEdgeDrafter(rows, passes=4, keep_ids=np.asarray(keep))
        if config.drafter == "specedge-pd":
            options["proactive"] = lambda tree, catch_up=(): proactive_draft(tree, rows.pure, keep_ids=np.asarray(keep),
                                                                            catch_up=catch_up)
    drafter = HycoPhoneDrafter(inner, slm=slm, mtp=mtp, scales=scales)
    return drafter, spec, options, rows, notes


class ChainOnlyDrafter:
    """The MTP chain alone, K nodes, no runner-ups and no SLM children (``hyco-exact-chain``): each round then
    has vLLM's MTP step's shape (the accepted chain prefix, then the bonus), so the two drafters are compared
    at the same kind of positions (``hyco_lab.bench.chainparity``). Its configuration opens with the root alone
    (``SessionOptions.opening`` ``"root"``), so round 1 drafts from the prompt's last position, as vLLM's first
    step does. A round without a hand-off before any chain (an ``opening`` ``"slm"``) is
    ``hybrid``'s SLM tree; after the first chain the SLM never runs, so the committed tokens it has not seen
    pile up, and a later round without a hand-off (a session that went to server mode) is refused rather than
    drafted from a stale SLM.

    >>> import numpy as np
    >>> from mobile_client.drafters.base import ChainDraft, DraftContext, HybridDrafter
    >>> class Chain:
    ...     def draft(self, x_hat, sampling=None):
    ...         return ChainDraft((5, 6, 7, 8), (9, 10))
    >>> ChainOnlyDrafter(HybridDrafter(Chain(), None)).propose(DraftContext(1, x_hat=np.zeros(2)), 4).to_wire()
    ([1, 5, 6, 7, 8], [-1, 0, 1, 2, 3])
    """

    def __init__(self, hybrid):
        self.hybrid, self.chained = hybrid, False

    def propose(self, context, node_budget: int):
        from mobile_client.tree import plant_tree

        h = self.hybrid
        if context.x_hat is None:
            if self.chained:
                raise ConfigError("hyco-exact-chain: a round without a hand-off after the first (server mode?); "
                                  "the chain-only phone's SLM has not seen the committed tokens")
            return h.propose(context, node_budget)
        self.chained = True
        c = h.draft_chain(context)
        return plant_tree(context.root, c.chain, (), lam=h.lam, node_budget=node_budget, chain_q=c.chain_q)


_ACCEPTANCE: dict[tuple[str, int], Any] = {}


def acceptance_of(config: str, slot: int):
    """The phone of ``slot`` (its index in a run) of ``config``: its acceptance model, kept across the
    requests it runs in this process, as a phone app keeps one across requests
    (``PhoneSession(acceptance=)``)."""
    from vllm_hyco.spec_decode.budget import SESSION_HALF_LIFE, AcceptanceModel

    key = (config, slot)
    if key not in _ACCEPTANCE:
        _ACCEPTANCE[key] = AcceptanceModel(engine_half_life=SESSION_HALF_LIFE)
    return _ACCEPTANCE[key]


def recording_session_class():
    """``PhoneSession`` subclass recording each applied round's sources, path and first-token time."""
    from mobile_client.session import PhoneSession

    class RecordingSession(PhoneSession):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.bench_paths: dict[int, tuple[list[int], dict[int, int]]] = {}
            self.bench_first_token: float | None = None
            self.bench_device_ms: dict[int, float] = {}
            self.bench_trees: dict[int, dict] = {}  # round -> the tree, its path and the tokens before it

        def apply_verdict(self, v, handoff=None, **kw):
            p, before = self._pending, len(self.tokens)
            stats = super().apply_verdict(v, handoff, **kw)
            if stats is not None and p is not None:
                src = p.tree.sources
                drafted: dict[int, int] = {}
                for s in src[1:]:
                    drafted[int(s)] = drafted.get(int(s), 0) + 1
                self.bench_paths[stats.round] = ([int(src[r]) for r in v.path], drafted)
                self.bench_trees[stats.round] = {"tokens": [int(t) for t in p.tree.tokens],
                                                 "parents": [int(x) for x in p.tree.parents],
                                                 "sources": [int(s) for s in src], "before": before,
                                                 "path": [int(r) for r in v.path]}
                if self.bench_first_token is None and stats.committed > 0:
                    self.bench_first_token = time.perf_counter()
            return stats

        def before_root(self) -> list[int]:
            return (self.prompt_tokens + self.tokens)[:-1]

    return RecordingSession


class RoundGate:
    """Phase-locked phones (``--phase-lock``): each active phone's next tree waits until every active phone
    has one ready, so the phones draft while the server idles and their trees reach it together.

    Why: the simulated phones draft on this machine's CPU, the server's. Free-running, their drafting
    overlaps the server's steps (both slow down) and spreads their trees so that a step carries one or
    two of them (docs/benchmarks.md). Locked, no drafting overlaps a step and every step can carry all
    trees: the server's cost per token at full batching, the regime Cloud+MTP's HTTP clients are always in.
    A phone is active from ``join`` until ``leave`` (its session finished or failed); the gate opens when
    the ready phones reach the active ones. The bench also passes the gate once before opening the
    sessions, so they start together (loading 64 drafters took seconds, and each session opened alone cost
    the server one prefill step). ``waited_s`` is each phone's time at the gate.

    >>> import asyncio
    >>> async def demo():
    ...     g, order = RoundGate(), []
    ...     async def phone(name, rounds):
    ...         for r in range(rounds):
    ...             await g.wait(name)
    ...             order.append((name, r))
    ...         g.leave(name)
    ...     g.join("a"); g.join("b")
    ...     await asyncio.gather(phone("a", 2), phone("b", 1))
    ...     return order, g.opened
    >>> asyncio.run(demo())   # a's second tree goes only after b's first
    ([('b', 0), ('a', 0), ('a', 1)], 2)
    """

    def __init__(self):
        self.active: set[str] = set()
        self.ready: set[str] = set()
        self.waited_s: dict[str, float] = {}
        self.opened = 0  # times the gate opened (rounds of the locked phones)
        self._event: asyncio.Event | None = None

    def join(self, name: str) -> None:
        self.active.add(name)

    def leave(self, name: str) -> None:
        self.active.discard(name)
        self.ready.discard(name)
        self._maybe_open()

    async def wait(self, name: str) -> None:
        if self._event is None:
            self._event = asyncio.Event()
        t0, event = time.perf_counter(), self._event
        self.ready.add(name)
        self._maybe_open()
        if name in self.ready:  # not opened by this arrival
            await event.wait()
        self.waited_s[name] = self.waited_s.get(name, 0.0) + time.perf_counter() - t0

    def _maybe_open(self) -> None:
        if self.ready and self.ready >= self.active:
            self.ready.clear()
            self.opened += 1
            if self._event is not None:
                self._event.set()
            self._event = asyncio.Event()


def bench_client_class():
    """``HycoClient`` whose modelled device time depends on the round (first round: the SLM alone); with a
    ``gate`` (:class:`RoundGate`) each new tree waits there before it is sent."""
    from mobile_client.client import HycoClient

    class BenchClient(HycoClient):
        def __init__(self, *args, config: BenchConfig, session, gate: RoundGate | None = None,
                     gate_name: str = "", **kwargs):
            self.config, self.session = config, session
            self.gate, self.gate_name = gate, gate_name
            super().__init__(*args, **kwargs)

        async def _call(self, fn):
            out = await super()._call(fn)
            if self.gate is not None and fn == self.session.next_tree:
                await self.gate.wait(self.gate_name)
            return out

        async def _take_verdict(self, *args, **kwargs):
            await super()._take_verdict(*args, **kwargs)
            if self.gate is not None and self.session.finished:
                self.gate.leave(self.gate_name)  # no further tree: the others need not wait for this phone

        @property
        def sim_draft_ms(self) -> float:
            s, p = self.session, self.session._pending
            if p is None:
                return 0.0
            ms = SLM_PASS_MS if p.round == 0 else self.config.device_ms
            if not p.forward:
                ms = 0.0  # the root alone (SessionOptions.opening): nothing drafted
            elif p.proactive_hit:
                ms = 0.0  # prepared during the last wait (its device time overlapped the link)
            s.bench_device_ms[p.round] = ms
            return ms

        @sim_draft_ms.setter
        def sim_draft_ms(self, value) -> None:
            pass

    return BenchClient


def round_records(session, result) -> list[RoundRecord]:
    out = []
    for st in result.rounds:
        sources, drafted = session.bench_paths.get(st.round, ([], {}))
        out.append(RoundRecord(st.round, st.nodes, st.accepted, st.committed,
                               device_ms=session.bench_device_ms.get(st.round, 0.0), draft_ms=st.draft_ms,
                               wait_ms=st.wait_ms, bytes_up=st.bytes_up, bytes_down=st.bytes_down,
                               path_sources=sources, drafted_sources=drafted, proactive_hit=st.proactive_hit,
                               proactive_ms=st.proactive_ms, tree=_tree_record(session, st.round),
                               budget=st.budget))
    return out


def _tree_record(session, round_: int) -> dict | None:
    t = session.bench_trees.get(round_)
    return None if t is None else {"parents": t["parents"], "sources": t["sources"], "path": t["path"]}


def prompt_ids(tokenizer_dir: Path, messages: list[dict]) -> list[int]:
    """The chat prompt's ids as vLLM's chat path makes them (template, no special tokens added)."""
    from transformers import AutoTokenizer

    # the tokenizer needs no model code: a folder whose config maps AutoConfig to its own code (MiMo) would
    # otherwise ask on stdin whether to run it
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def cpu_overrun_ms(rounds: list[RoundRecord], proactive_device_ms: float = 4 * SLM_PASS_MS) -> float:
    """Wall time this CPU spent drafting beyond the modelled device time: drafting slower than the model
    (the client pads only when it is faster), and a proactive draft still running when the verdict came
    (the phone would wait for ``proactive_device_ms`` at most).

    >>> cpu_overrun_ms([RoundRecord(1, 32, 2, 3, device_ms=50.0, draft_ms=80.0, wait_ms=40.0,
    ...                             proactive_hit=False, proactive_ms=100.0)])
    67.2
    """
    total = 0.0
    for x in rounds:
        total += max(0.0, x.draft_ms - x.device_ms)
        if x.proactive_hit is not None:
            total += max(0.0, x.proactive_ms - x.wait_ms) - max(0.0, proactive_device_ms - x.wait_ms)
    return round(total, 3)


def describe(config: BenchConfig) -> str:
    """The configuration's phone as JSON (``draft_sampling`` only when the MTP chain is sampled).

    >>> from hyco_lab.bench.configs import CONFIGS
    >>> json.loads(describe(CONFIGS["hyco-exact-prob"]))["draft_sampling"]
    'probabilistic'
    """
    out = {"name": config.name, "drafter": config.drafter, "mode": config.mode}
    if config.draft_sampling != "greedy":
        out["draft_sampling"] = config.draft_sampling
    if config.values:
        out["values"] = True
    out["device_ms"] = config.device_ms
    return json.dumps(out)
