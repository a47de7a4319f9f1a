"""Simulated phones for the benchmark: the drafters of each configuration and a session that records what
the metrics need (sources of the accepted nodes, modelled device time, time to first token).

Drafters come from the fixture bundle (``python -m vllm_hyco.fixtures DIR``; docs/phone-loop.md's bundle
layout) and run on this machine's CPU; their *timing* is modelled (decisions.md D8): the client pads each
round's drafting to the configuration's device time (``BenchClient``), 15.7 ms for the SLM-only first
round (D2), and nothing when a proactive tree is reused (SpecEdge + PD).

``MultiPassSlm`` lets the phone's one-pass SLM Drafter (``mobile_client.drafters.slm.SlmDrafter``, whose
static graph only takes one pass's rows) serve the multi-pass trees (SpecEdge-style, HyCo-2P) and
proactive drafting: every forward recomputes, in the same static call, the earlier passes' rows that the
new rows attend to (their ancestors), and first commits any committed tokens the SLM has not seen
(a reused proactive tree skips a forward, so its catch-up rows would otherwise be lost). ``pure`` runs a
forward without touching the drafter's state (proactive drafting while the verdict is in flight).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vllm_hyco.bench.configs import SLM_PASS_MS, BenchConfig
from vllm_hyco.bench.metrics import RoundRecord

ROWS = 96  # static rows of the benchmark's SLM graph: a pass's rows + their ancestors + catch-up rows
WINDOW = 1024


class MultiPassSlm:
    """A ``RowDrafter`` over an ``SlmDrafter`` that also serves rows attending to earlier passes' rows."""

    def __init__(self, slm: Any, context: Callable[[], Sequence[int]] | None = None):
        self.slm = slm
        self.context = context  # committed tokens before the session's current root

    def _augment(self, plan, before_root: Sequence[int]):
        """The plan with every needed tree row (the rows and their ancestors) and the missing catch-up."""
        from mobile_client.tree import FrontierPlan

        c = len(plan.catch_up)
        anc = plan.attend_mask()[c:, c:]  # [rows, T] ancestors + self of each forward tree row
        need = sorted(set(np.nonzero(anc.any(axis=0))[0].tolist()) - set(plan.rows))
        missing = tuple(before_root[self.slm.committed: max(len(before_root) - c, self.slm.committed)])
        full = FrontierPlan(missing + tuple(plan.catch_up), tuple(need) + tuple(plan.rows), plan.tokens,
                            plan.parents)
        keep = list(range(len(missing), len(missing) + c))
        keep += list(range(len(missing) + c + len(need), full.num_rows))
        return full, keep

    def forward_rows(self, plan, before_root: Sequence[int] | None = None):
        from mobile_client.drafters.base import RowLogprobs

        if before_root is None:
            before_root = list(self.context()) if self.context is not None else []
            if len(before_root) < self.slm.committed + len(plan.catch_up):
                before_root = []  # no context to resync against: trust the plan
        full, keep = self._augment(plan, before_root)
        if full.num_rows > ROWS:
            raise RuntimeError(f"{full.num_rows} SLM rows exceed the benchmark graph's {ROWS}")
        # pad to a multiple of 8 rows, not to the static 96: padded rows only attend to themselves, so the
        # real rows' outputs do not depend on it, and this CPU drafts faster (the timing is modelled anyway)
        self.slm.rows = -(-full.num_rows // 8) * 8
        try:
            out = self.slm.forward_rows(full)
        finally:
            self.slm.rows = ROWS
        return RowLogprobs(np.asarray(out.logprobs)[keep], out.ids)

    def pure(self, plan):
        """``forward_rows`` on a copy of the state (for proactive drafting; the bet's catch-up rows are the
        root and the bet path, which the real forward will commit later)."""
        saved = (copy.deepcopy(self.slm.rings), copy.deepcopy(self.slm.pos), self.slm.committed,
                 self.slm.pending)
        try:
            before = list(self.context()) if self.context is not None else []
            return self.forward_rows(plan, before_root=before if len(before) >= self.slm.committed else [])
        finally:
            self.slm.rings, self.slm.pos, self.slm.committed, self.slm.pending = saved


def load_phone(bundle: Path, config: BenchConfig, *, window: int = WINDOW):
    """(drafter, handoff spec or None, SessionOptions kwargs, notes) for one phone of ``config``."""
    from mobile_client.baselines import proactive_draft
    from mobile_client.cli import _handoff_spec, _hf_dir, _keep_ids, _mtp_drafter
    from mobile_client.drafters.base import HybridDrafter, SpecEdgeDrafter
    from mobile_client.drafters.slm import SlmDrafter
    from mobile_client.drafters.spec import SlmSpec
    from mobile_client.session import HycoPhoneDrafter

    bundle, notes = Path(bundle), []
    scfg, ssd = _hf_dir(bundle / "slm")
    sspec = SlmSpec.from_hf_config(scfg)
    keep = _keep_ids(bundle, sspec.vocab, None)
    slm = SlmDrafter(sspec, ssd, keep, window=window, rows=ROWS)
    rows = MultiPassSlm(slm)
    options: dict[str, Any] = {"mode": config.mode}
    spec, mtp, scales = None, None, None
    if config.drafter in ("hybrid", "hybrid-2p"):
        spec, scales = _handoff_spec(bundle)
        if scales is None:
            notes.append("no handoff_scales.npz in the bundle: SLM-only trees (no MTP chain)")
        else:
            mtp = _mtp_drafter(bundle, keep, "torch", bundle / "build", window, notes)
        inner = HybridDrafter(mtp, rows, two_pass=config.drafter == "hybrid-2p")
    else:
        inner = SpecEdgeDrafter(rows, passes=4, keep_ids=np.asarray(keep))
        if config.drafter == "specedge-pd":
            options["proactive"] = lambda tree: proactive_draft(tree, rows.pure, keep_ids=np.asarray(keep))
    drafter = HycoPhoneDrafter(inner, slm=slm, mtp=mtp, scales=scales)
    return drafter, spec, options, rows, notes


def recording_session_class():
    """``PhoneSession`` subclass recording each applied round's sources, path and first-token time."""
    from mobile_client.session import PhoneSession

    class RecordingSession(PhoneSession):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.bench_paths: dict[int, tuple[list[int], dict[int, int]]] = {}
            self.bench_first_token: float | None = None
            self.bench_device_ms: dict[int, float] = {}

        def apply_verdict(self, v, handoff=None, **kw):
            p = self._pending
            stats = super().apply_verdict(v, handoff, **kw)
            if stats is not None and p is not None:
                src = p.tree.sources
                drafted: dict[int, int] = {}
                for s in src[1:]:
                    drafted[int(s)] = drafted.get(int(s), 0) + 1
                self.bench_paths[stats.round] = ([int(src[r]) for r in v.path], drafted)
                if self.bench_first_token is None and stats.committed > 0:
                    self.bench_first_token = time.perf_counter()
            return stats

        def before_root(self) -> list[int]:
            return (self.prompt_tokens + self.tokens)[:-1]

    return RecordingSession


def bench_client_class():
    """``HycoClient`` whose modelled device time depends on the round (first round: the SLM alone)."""
    from mobile_client.client import HycoClient

    class BenchClient(HycoClient):
        def __init__(self, *args, config: BenchConfig, session, **kwargs):
            self.config, self.session = config, session
            super().__init__(*args, **kwargs)

        @property
        def sim_draft_ms(self) -> float:
            s, p = self.session, self.session._pending
            if p is None:
                return 0.0
            ms = SLM_PASS_MS if p.round == 0 else self.config.device_ms
            if p.proactive_hit:
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
                               proactive_ms=st.proactive_ms))
    return out


def prompt_ids(tokenizer_dir: Path, messages: list[dict]) -> list[int]:
    """The chat prompt's ids as vLLM's chat path makes them (template, no special tokens added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
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
    return json.dumps({"name": config.name, "drafter": config.drafter, "mode": config.mode,
                       "device_ms": config.device_ms})
