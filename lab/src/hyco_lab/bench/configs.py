"""The benchmark's configurations (paper Table 5), each selectable by name, and the phone device model.

The configurations, each as ``name``: server; phone tree; acceptance.

* ``cloud-mtp``: vLLM's built-in MTP (the assistant on the server), K = 4; none: plain ``openai`` requests;
  exact
* ``cloud-mtp-prob``: same, ``"draft_sample_method": "probabilistic"`` (drafts sampled from the head); same;
  exact
* ``cloud-mtp-k2`` / ``-k3`` / ``-dyn`` and ``cloud-mtp-prob-k2`` / ``-k3`` / ``-dyn``: the same at K = 2, 3
  and at vLLM's per-batch-size K (``num_speculative_tokens_per_batch_size``, :data:`MTP_SCHEDULE`); the
  baseline takes the best Cloud+MTP setting at each load
* ``specedge``: ``--speculative-config hyco``; 32 nodes from 4 SLM passes; exact
* ``specedge-pd``: same; + proactive drafting during the wait; exact
* ``specedge-eps``: hyco, ε = 0.005; 32 nodes from 4 SLM passes; ε = 0.005
* ``hyco``: hyco, ε = 0.005; MTP chain K = 4 + runner-ups + 1 SLM pass; ε = 0.005
* ``hyco-chainfirst``: hyco, ε = 0.005; same as hyco, rows ordered the MTP chain first (``SessionOptions.order``
  ``"chain"``; ε mode's default is ``"learned"``); ε = 0.005
* ``hyco-s32``: hyco, ``budget_policy`` static, ``node_budget`` 32 (the paper's HyCo); same as hyco; ε = 0.005
* ``hyco-2p``: hyco, ε = 0.005; same, 2 SLM passes; ε = 0.005
* ``hyco-exact``: hyco; same as hyco; exact
* ``hyco-exact-prob``: hyco; same, the MTP chain sampled (``draft_sampling`` probabilistic); exact
* ``hyco-exact-values``: hyco; same as hyco-exact, the phone sending per-node values (protocol v2 ``values``:
  the server trusts them as far as the session's verdicts show them calibrated, ``spec_decode/trust.py``);
  exact
* ``hyco-exact-s4`` .. ``-s32``: hyco, ``budget_policy`` static, ``node_budget`` 4, 8, 16, 32; same as hyco,
  that many nodes; exact
* ``hyco-exact-prob-s4`` .. ``-s32``: same; same as hyco-exact-prob, that many nodes; exact
* ``hyco-exact-chainfirst``: hyco; same as hyco-exact, rows ordered the MTP chain first
  (``SessionOptions.order`` ``"chain"``, exact mode's default since issue 35); exact
* ``hyco-exact-learned``: hyco; same as hyco-exact, rows ordered by the learned acceptance alone
  (``SessionOptions.order`` ``"learned"``, exact mode's default before issue 35); exact
* ``hyco-exact-floor4``: hyco, ``budget_floor`` K = 4 (the adaptive cut keeps at least Cloud+MTP's K nodes
  of each tree: with the chain first, the MTP chain to depth 4); same as hyco-exact, round 0 the root alone
  (so every later round drafts from where vLLM's MTP step would: Cloud+MTP's setting, plus what pays); exact
* ``hyco-exact-floor4-slm0``: the same server; same as hyco-exact-floor4, round 0 the SLM's tree; exact
* ``hyco-exact-slm0``: hyco; same as hyco-exact, round 0 pinned to the SLM's tree (``SessionOptions.opening``
  ``"slm"``, the default); exact
* ``hyco-exact-root0``: hyco; same as hyco-exact, round 0 the root alone (``SessionOptions.opening``
  ``"root"``; ``hyco-exact`` ran so in issue 35's runs ``mimo-open-35``, ``mimo-table-35``,
  ``gemma-table-35`` and ``gemma-open-35``); exact
* ``hyco-exact-chain``: hyco, ``budget_policy`` static, ``node_budget`` K = 4; the MTP chain alone (no
  runner-ups, no SLM children; round 0 the root alone, round 1 the chain from the prompt's last position):
  vLLM's MTP step shape, for chain parity (``hyco_lab.bench.chainparity``); exact
* ``server-head``: dropped (``DROPPED``): the engine runs no MTP head for phone sessions
* ``slm-only``: none: modelled from the paper's device numbers (no server)

Every ``hyco`` server without a static budget runs the default ``budget_policy`` ``adaptive`` (cap 32):
the server cuts each tree to the prefix that pays and grants each phone its next tree's nodes.

Phone compute is **modelled** (docs/decisions.md D8) from the paper's device numbers unless a phone measured
it: one SLM pass over 32 rows 15.7 ms; a HyCo round 52.9 ms of device time (MTP head K steps, one SLM
pass, the tree); the on-device head is about 20 ms of that. So: SpecEdge-style 4 x 15.7 ms, HyCo-2P
52.9 + 15.7 ms, the first round (SLM only, D2) 15.7 ms, or nothing when it is the root alone
(``SessionOptions.opening`` ``"root"``).

    >>> [c.name for c in select("hyco,cloud-mtp")]
    ['hyco', 'cloud-mtp']
    >>> CONFIGS["hyco-2p"].device_ms, CONFIGS["specedge"].device_ms
    (68.6, 62.8)
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, replace

from vllm_hyco.errors import ConfigError

#: the paper's device numbers (docs/decisions.md D8), milliseconds
SLM_PASS_MS = 15.7
HYCO_ROUND_MS = 52.9
HEAD_ON_DEVICE_MS = 20.0
#: the SLM alone on the device (paper Table 11, "On-device 8K"): tokens/s and device ms per token
SLM_ONLY_TOK_S = 26.4
SLM_ONLY_MS_PER_TOKEN = 36.8
EPSILON = 0.005
STATIC_BUDGETS = (4, 8, 16, 32)  # the static node budgets the sweep compares with the adaptive policy
MTP_K = 4
#: vLLM's per-batch-size K for the ``-dyn`` configurations (inclusive batch-size ranges, K): long chains
#: while the batch is small, short ones once the forward's rows cost (ours: vLLM ships no default schedule)
MTP_SCHEDULE = ((1, 3, 4), (4, 15, 3), (16, 1024, 2))


@dataclass(frozen=True)
class BenchConfig:
    """One configuration. ``kind``: ``cloud`` (openai requests), ``phone`` (phone sessions), ``modelled``."""

    name: str
    kind: str
    label: str  # as the paper's tables name it
    server: str | None = None  # "mtp" or "hyco"; None: no server
    epsilon: float | None = None  # the server's ε (None: exact); the phones ask for the server's mode
    drafter: str | None = None  # "hybrid", "hybrid-2p", "specedge", "specedge-pd", "chain"
    draft_sample_method: str | None = None  # cloud configurations: vLLM's option (None: its default, greedy)
    draft_sampling: str = "greedy"  # phone configurations: SessionOptions.draft_sampling (the MTP chain)
    values: bool = False  # phone configurations: SessionOptions.values (per-node values on the wire)
    device_ms: float = 0.0  # modelled device ms per round after the first
    node_budget: int | None = None  # hyco servers: a static budget (budget_policy static); None: adaptive
    budget_floor: int | None = None  # hyco servers, adaptive: the fewest nodes verified (None: the default, 1)
    first_round_ms: float = SLM_PASS_MS  # round 0 is the SLM's alone (D2)
    opening: str | None = None  # phone configurations: SessionOptions.opening ("slm" tree or "root" alone)
    order: str | None = None  # phone configurations: SessionOptions.order (None: its default)
    k: int = MTP_K  # cloud configurations: num_speculative_tokens (the most, with a schedule)
    k_schedule: tuple[tuple[int, int, int], ...] | None = None  # cloud: vLLM's per-batch-size K

    @property
    def mode(self) -> str:
        return "exact" if self.epsilon is None else "epsilon"

    def server_spec(self, assistant: str, max_sessions: int = 64, step_gather: str | None = None) -> str:
        """The ``--speculative-config`` JSON for this configuration's server (``step_gather``: the HyCo
        option, when not the server's default)."""
        if self.server == "mtp":
            spec = {"method": "mtp", "model": assistant, "num_speculative_tokens": self.k}
            if self.draft_sample_method:
                spec["draft_sample_method"] = self.draft_sample_method
            if self.k_schedule:
                spec["num_speculative_tokens_per_batch_size"] = [list(r) for r in self.k_schedule]
            return json.dumps(spec)
        spec: dict = {"method": "hyco", "max_sessions": max_sessions}
        if self.epsilon is not None:
            spec["epsilon"] = self.epsilon
        if self.node_budget is not None:
            spec.update(node_budget=self.node_budget, budget_policy="static")
        if self.budget_floor is not None:
            spec["budget_floor"] = self.budget_floor
        if step_gather is not None:
            spec["step_gather"] = step_gather
        return json.dumps(spec)

    def server_key(self) -> tuple:
        """Configurations with equal keys can share one server (same engine arguments)."""
        return (self.server, self.epsilon, self.draft_sample_method, self.node_budget, self.budget_floor, self.k,
                self.k_schedule)


CONFIGS: dict[str, BenchConfig] = {c.name: c for c in (
    BenchConfig("cloud-mtp", "cloud", "Cloud+MTP", server="mtp"),
    BenchConfig("cloud-mtp-prob", "cloud", "Cloud+MTP, sampled drafts", server="mtp",
                draft_sample_method="probabilistic"),
    *(BenchConfig(f"cloud-mtp{p}-{tag}", "cloud", f"Cloud+MTP{label}, {what}", server="mtp",
                  draft_sample_method=method, k=k, k_schedule=schedule)
      for p, label, method in (("", "", None), ("-prob", ", sampled drafts", "probabilistic"))
      for tag, what, k, schedule in (("k2", "K = 2", 2, None), ("k3", "K = 3", 3, None),
                                     ("dyn", "K per batch size", MTP_K, MTP_SCHEDULE))),
    BenchConfig("specedge", "phone", "SpecEdge-style", server="hyco", drafter="specedge",
                device_ms=4 * SLM_PASS_MS),
    BenchConfig("specedge-pd", "phone", "SpecEdge-style + PD", server="hyco", drafter="specedge-pd",
                device_ms=4 * SLM_PASS_MS),
    BenchConfig("specedge-eps", "phone", "SpecEdge-eps", server="hyco", epsilon=EPSILON, drafter="specedge",
                device_ms=4 * SLM_PASS_MS),
    BenchConfig("hyco", "phone", "HyCo", server="hyco", epsilon=EPSILON, drafter="hybrid",
                device_ms=HYCO_ROUND_MS),
    BenchConfig("hyco-chainfirst", "phone", "HyCo, the chain first", server="hyco", epsilon=EPSILON, drafter="hybrid",
                device_ms=HYCO_ROUND_MS, order="chain"),
    BenchConfig("hyco-s32", "phone", "HyCo, static 32 (the paper's)", server="hyco", epsilon=EPSILON,
                drafter="hybrid", device_ms=HYCO_ROUND_MS, node_budget=32),
    BenchConfig("hyco-2p", "phone", "HyCo-2P", server="hyco", epsilon=EPSILON, drafter="hybrid-2p",
                device_ms=round(HYCO_ROUND_MS + SLM_PASS_MS, 3)),
    BenchConfig("hyco-exact", "phone", "HyCo exact", server="hyco", drafter="hybrid", device_ms=HYCO_ROUND_MS),
    BenchConfig("hyco-exact-chainfirst", "phone", "HyCo exact, the chain first", server="hyco", drafter="hybrid",
                device_ms=HYCO_ROUND_MS, order="chain"),
    BenchConfig("hyco-exact-learned", "phone", "HyCo exact, the learned order", server="hyco", drafter="hybrid",
                device_ms=HYCO_ROUND_MS, order="learned"),
    BenchConfig("hyco-exact-floor4", "phone", f"HyCo exact, at least K = {MTP_K} nodes, root opening", server="hyco",
                drafter="hybrid", device_ms=HYCO_ROUND_MS, budget_floor=MTP_K, opening="root"),
    BenchConfig("hyco-exact-floor4-slm0", "phone", f"HyCo exact, at least K = {MTP_K} nodes, SLM opening",
                server="hyco", drafter="hybrid", device_ms=HYCO_ROUND_MS, budget_floor=MTP_K, opening="slm"),
    BenchConfig("hyco-exact-slm0", "phone", "HyCo exact, round 0 the SLM's", server="hyco", drafter="hybrid",
                device_ms=HYCO_ROUND_MS, opening="slm"),
    BenchConfig("hyco-exact-root0", "phone", "HyCo exact, round 0 the root alone", server="hyco", drafter="hybrid",
                device_ms=HYCO_ROUND_MS, opening="root"),
    BenchConfig("hyco-exact-prob", "phone", "HyCo exact, sampled drafts", server="hyco", drafter="hybrid",
                device_ms=HYCO_ROUND_MS, draft_sampling="probabilistic"),
    BenchConfig("hyco-exact-values", "phone", "HyCo exact, phone values", server="hyco", drafter="hybrid",
                device_ms=HYCO_ROUND_MS, values=True),
    *(BenchConfig(f"hyco-exact-s{b}", "phone", f"HyCo exact, static {b}", server="hyco", drafter="hybrid",
                  device_ms=HYCO_ROUND_MS, node_budget=b) for b in STATIC_BUDGETS),
    *(BenchConfig(f"hyco-exact-prob-s{b}", "phone", f"HyCo exact, sampled drafts, static {b}", server="hyco",
                  drafter="hybrid", device_ms=HYCO_ROUND_MS, draft_sampling="probabilistic", node_budget=b)
      for b in STATIC_BUDGETS),
    BenchConfig("hyco-exact-chain", "phone", "HyCo exact, MTP chain alone (static K)", server="hyco",
                drafter="chain", device_ms=HEAD_ON_DEVICE_MS, node_budget=MTP_K, opening="root"),
    BenchConfig("slm-only", "modelled", "SLM alone (modelled)"),
)}

#: configurations the harness knows but does not run, and why
DROPPED = {
    "server-head": "HyCo server head (paper Table 5) is not run: the HyCo engine runs no MTP head for phone "
                   "sessions (NullProposer, docs/decisions.md D1), so a server-side head drafting into the "
                   "phone's tree would need a server drafter that does not exist; its cost would be "
                   "cloud-mtp's head steps plus a 33-row verify, reported by neither.",
}
#: issue 16's sweep: Cloud+MTP (greedy, sampled drafts), HyCo exact (sampled drafts, its best exact form) at
#: static budgets 4..32 and adaptive, HyCo ε adaptive (greedy drafts, the paper's); the greedy-draft exact
#: configurations (``hyco-exact``, ``hyco-exact-s4`` ..) stay selectable with ``--sweep-configs``
SWEEP = ("cloud-mtp", "cloud-mtp-prob", *(f"hyco-exact-prob-s{b}" for b in STATIC_BUDGETS), "hyco-exact-prob",
         "hyco")
DEFAULT = ("cloud-mtp", "cloud-mtp-prob", "specedge", "specedge-pd", "specedge-eps", "hyco", "hyco-2p", "hyco-exact",
           "hyco-exact-prob", "slm-only")


#: the paper's ε sweep (Figure 3); ε = 0.005 is ``hyco`` / ``specedge-eps``, exact ``hyco-exact`` / ``specedge``
EPS_SWEEP = (0.001, 0.005, 0.02, 0.1)


def epsilon_config(tree: str, epsilon: float) -> BenchConfig:
    """HyCo's tree (``tree="hyco"``) or the SLM-only tree (``"specedge"``) verified at ``epsilon``, named
    ``hyco-eps-0.02`` / ``specedge-eps-0.02`` (ε = 0.005: the standing ``hyco`` / ``specedge-eps``), and
    registered in ``CONFIGS``.

    >>> epsilon_config("hyco", 0.02).name, epsilon_config("specedge", 0.005).name
    ('hyco-eps-0.02', 'specedge-eps')
    """
    if epsilon == EPSILON:
        return CONFIGS["hyco" if tree == "hyco" else "specedge-eps"]
    base = CONFIGS["hyco" if tree == "hyco" else "specedge-eps"]
    name = f"{tree}-eps-{epsilon:g}"
    if name not in CONFIGS:
        label = f"{'HyCo' if tree == 'hyco' else 'SpecEdge'}-ε {epsilon:g}"
        CONFIGS[name] = BenchConfig(name, base.kind, label, server="hyco", epsilon=float(epsilon),
                                    drafter=base.drafter, device_ms=base.device_ms)
    return CONFIGS[name]


def sweep_configs(epsilons=EPS_SWEEP) -> list[BenchConfig]:
    """Exact, then each ε, on HyCo's trees and on SLM-only trees."""
    return ([CONFIGS["hyco-exact"]] + [epsilon_config("hyco", e) for e in epsilons]
            + [CONFIGS["specedge"]] + [epsilon_config("specedge", e) for e in epsilons])


def with_static_budget(config: BenchConfig, budget: int) -> BenchConfig:
    """``config`` verified at ``budget_policy`` static with ``node_budget`` ``budget`` when it is a HyCo
    configuration without a static budget of its own (same name: the report compares like with like; the
    results record the budget); any other configuration unchanged. A static budget verifies whole trees, so a
    ``budget_floor`` is dropped (the server would refuse one above a smaller budget).

    >>> with_static_budget(CONFIGS["hyco"], 32).node_budget, with_static_budget(CONFIGS["cloud-mtp"], 32).node_budget
    (32, None)
    >>> with_static_budget(CONFIGS["hyco-exact-floor4"], 2).budget_floor is None
    True
    """
    if config.server != "hyco" or config.node_budget is not None:
        return config
    if budget < 1:
        raise ConfigError(f"--node-budget must be a positive number of nodes, got {budget}")
    return replace(config, node_budget=budget, budget_floor=None)


def select(names: str | list[str] | None) -> list[BenchConfig]:
    """Configurations by comma-separated names (``all`` or None: every runnable one)."""
    if names is None or names == "all":
        return [CONFIGS[n] for n in DEFAULT]
    if names in ("", "none"):
        return []  # e.g. a sweep-only invocation
    items = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    out = []
    for n in filter(None, items):
        if n not in CONFIGS and n.split("-eps-")[0] in ("hyco", "specedge") and "-eps-" in n:
            with contextlib.suppress(ValueError):
                epsilon_config(n.split("-eps-")[0], float(n.split("-eps-")[1]))
        if n in DROPPED:
            raise ConfigError(f"configuration {n!r} is not run: {DROPPED[n]}")
        if n not in CONFIGS:
            raise ConfigError(f"unknown configuration {n!r}; choose from {', '.join(CONFIGS)}")
        out.append(CONFIGS[n])
    return out


def sweep_requests(text: str) -> dict[int, int]:
    """``--sweep-requests`` as {level: requests}.

    >>> sweep_requests("1:48, 64:64"), sweep_requests("")
    ({1: 48, 64: 64}, {})
    """
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        level, _, n = item.partition(":")
        if not (level.isdigit() and n.isdigit() and int(level) > 0 and int(n) > 0):
            raise ConfigError(f"--sweep-requests: {item!r} is not LEVEL:REQUESTS (two positive integers), "
                              "e.g. 1:48,64:64")
        out[int(level)] = int(n)
    return out
