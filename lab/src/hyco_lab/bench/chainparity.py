"""Chain parity (issue 34 item 2): per depth, how often the phone's MTP chain is accepted, against vLLM's MTP, from
one benchmark run's records (``records.json`` of ``python -m hyco_lab.bench``: the same prompts, seeds and
sampling for every configuration).

    python -m hyco_lab.bench.chainparity benchmarks/results/cpu     # writes chain_parity.{json,md} there

**The metric**, the same on both sides: the *conditional* acceptance at depth d, the share of drafts at depth d
that were accepted among those whose drafts at depths 1 .. d-1 were all accepted.

* **Phone** (a HyCo configuration's rounds, ``RoundRecord.tree``): the chain is the run of ``chain``-labelled
  nodes from the root (each the chain-labelled child of the one before). At depth d it counts when its node was
  verified (inside the server's cut: ``min(RoundRecord.nodes, RoundRecord.budget)``, the adaptive budget's
  grant; every node sent under a static one and in a request's last round, whose grant is 0) and the chain's
  nodes 1 .. d-1 are on the accepted path; it is accepted when it is on the path too. Sample-and-match accepts
  a node exactly when the server's sample at its parent is its token, with probability p_target(token) for a
  greedy draft, as vLLM's rejection sampler accepts a greedy draft; a sibling (runner-up, SLM child) cannot
  take a chain node's place, since siblings hold distinct tokens.
* **vLLM's MTP** (a Cloud+MTP configuration): vLLM's counters over the run (``spec_counters``: drafts and
  accepted tokens per position); depth 1 is ``accepted[0] / drafts``, depth d ``accepted[d-1] / accepted[d-2]``.

**Intervals**: 95 % percentile bootstrap (2,000 resamples, seed 0). The phone's counts are resampled by request
(each prompt of each run); vLLM's counters exist per pass only (the harness reads them around each pass, the
requests of a pass being concurrent), so its side is resampled by pass: by prompt at one phone in a split
sweep (``--sweep-split``: each prompt its own pass), by run in Table 2 (3 runs: a coarse interval). The
difference resamples both sides independently.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mobile_client.tree import chain_rows

#: (phone configuration, vLLM configuration) pairs compared by default. ``hyco-exact-chain`` sends the chain
#: alone at a static budget of K, so its rounds have vLLM's step shape (the accepted chain prefix, then the
#: bonus): the drafters compared at the same kind of positions. The static-32 runs (``hyco-exact-s32``,
#: ``hyco-exact-prob-s32``) verify every chain node, so no budget cut selects which sessions reach a depth;
#: but a runner-up or SLM child on the path moves where the next round starts. ``hyco-exact-floor4`` and
#: ``-floor4-slm0`` (``budget_floor`` K) verify the chain to depth K in every round after round 0, whatever
#: else the cut keeps
PAIRS = (("hyco-exact-chain", "cloud-mtp"), ("hyco-exact", "cloud-mtp"), ("hyco-exact-prob", "cloud-mtp-prob"),
         ("hyco-exact-floor4", "cloud-mtp"), ("hyco-exact-floor4-slm0", "cloud-mtp"),
         ("hyco-exact-s32", "cloud-mtp"),
         ("hyco-exact-prob-s32", "cloud-mtp-prob"))
RESAMPLES = 2000


def chain_counts(rounds: Sequence[dict], depth: int) -> tuple[np.ndarray, np.ndarray]:
    """(reached, accepted) per depth 1..``depth`` over one request's rounds (module docstring).

    >>> r = {"nodes": 5, "tree": {"parents": [-1, 0, 1, 2, 0, 1], "sources": [0, 1, 1, 1, 3, 3], "path": [1, 5]}}
    >>> [x.tolist() for x in chain_counts([r], 4)]  # depth 1 accepted, depth 2 rejected (an SLM sibling matched)
    [[1, 1, 0, 0], [1, 0, 0, 0]]
    """
    reached, accepted = np.zeros(depth, np.int64), np.zeros(depth, np.int64)
    for rd in rounds:
        tree = rd.get("tree")
        if not tree:
            continue
        parents, sources, path = tree["parents"], tree["sources"], set(tree.get("path") or ())
        # rows inside the server's cut, root included: the adaptive budget verifies min(sent, the verdict's
        # grant) nodes (BudgetPolicy.next_budget), a static one every node sent. A request's last round grants 0
        # and so says nothing of its cut: counted as verified whole (vLLM's counters count its last step too);
        # under the adaptive budget that can only lower the phone's rate
        sent = int(rd.get("nodes", len(parents) - 1))
        verified = (sent if not rd.get("budget") else min(sent, int(rd["budget"]))) + 1
        for d, child in enumerate(chain_rows(parents, sources)[:depth]):
            if child >= verified:
                break
            reached[d] += 1
            if child not in path:
                break
            accepted[d] += 1
    return reached, accepted


def _phone_units(records: list[dict], config: str, depth: int) -> np.ndarray:
    units = [np.stack(chain_counts(q.get("rounds") or [], depth)) for r in records
             if r["config"] == config and r["run"] >= 0 for q in r["requests"] if not q.get("error")]
    return np.stack(units) if units else np.zeros((0, 2, depth), np.int64)


def _cloud_units(records: list[dict], config: str, depth: int) -> np.ndarray:
    """Per pass: (reached, accepted) per depth from vLLM's counters."""
    out = []
    for r in records:
        c = r.get("spec_counters") or {}
        if r["config"] != config or r["run"] < 0 or not c.get("accepted_per_pos"):
            continue
        acc = np.zeros(depth)
        per_pos = c["accepted_per_pos"][:depth]
        acc[: len(per_pos)] = per_pos
        reached = np.concatenate([[c["drafts"]], acc[:-1]])
        out.append(np.stack([reached, acc]))
    return np.stack(out) if out else np.zeros((0, 2, depth))


def _rates(units: np.ndarray) -> np.ndarray:
    total = units.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total[0] > 0, total[1] / np.maximum(total[0], 1), np.nan)


def _boot(units: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if len(units) == 0:
        return np.full((RESAMPLES, units.shape[-1]), np.nan)
    idx = rng.integers(0, len(units), size=(RESAMPLES, len(units)))
    return np.stack([_rates(units[i]) for i in idx])


def _ci(samples: np.ndarray) -> list[list[float | None]]:
    lo, hi = np.nanpercentile(samples, 2.5, axis=0), np.nanpercentile(samples, 97.5, axis=0)
    return [[None if np.isnan(a) else round(float(a), 4), None if np.isnan(b) else round(float(b), 4)]
            for a, b in zip(lo, hi)]


def parity(records: list[dict], depth: int = 4, pairs: Sequence[tuple[str, str]] = PAIRS) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    out = []
    for phone_cfg, cloud_cfg in pairs:
        p, c = _phone_units(records, phone_cfg, depth), _cloud_units(records, cloud_cfg, depth)
        if len(p) == 0 or len(c) == 0:
            continue
        bp, bc = _boot(p, rng), _boot(c, rng)
        rp, rc = _rates(p), _rates(c)
        out.append({"phone": phone_cfg, "cloud": cloud_cfg, "phone_requests": len(p), "cloud_runs": len(c),
                    "phone_reached": p.sum(axis=0)[0].tolist(), "cloud_reached": c.sum(axis=0)[0].tolist(),
                    "phone_rate": [round(float(x), 4) for x in rp], "phone_ci": _ci(bp),
                    "cloud_rate": [round(float(x), 4) for x in rc], "cloud_ci": _ci(bc),
                    "diff": [round(float(x), 4) for x in rp - rc], "diff_ci": _ci(bp - bc)})
    return out


def markdown(rows: list[dict[str, Any]], source: str) -> str:
    out = [f"# Chain parity: the phone's MTP chain against vLLM's MTP, per depth ({source})", "",
           "Conditional acceptance at depth d (accepted / reached, reached = drafts at depth d whose drafts at "
           "depths 1..d-1 were all accepted); 95 % bootstrap intervals. Method: "
           "`lab/src/hyco_lab/bench/chainparity.py`.", "",
           "| phone config (requests) | vLLM config (runs) | depth | phone [95 %] | vLLM MTP [95 %] | "
           "phone - vLLM [95 %] | reached (phone / vLLM) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for d in range(len(r["phone_rate"])):
            pc, cc, dc = r["phone_ci"][d], r["cloud_ci"][d], r["diff_ci"][d]
            out.append(f"| {r['phone']} ({r['phone_requests']}) | {r['cloud']} ({r['cloud_runs']}) | {d + 1} | "
                       f"{r['phone_rate'][d]:.3f} [{pc[0]}, {pc[1]}] | {r['cloud_rate'][d]:.3f} [{cc[0]}, {cc[1]}] | "
                       f"{r['diff'][d]:+.3f} [{dc[0]}, {dc[1]}] | {r['phone_reached'][d]} / "
                       f"{int(r['cloud_reached'][d])} |")
    return "\n".join(out + [""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyco_lab.bench.chainparity", description=__doc__.split("\n")[0])
    p.add_argument("dir", help="a benchmark result folder with records.json")
    p.add_argument("--depth", type=int, default=4)
    args = p.parse_args(argv)
    folder = Path(args.dir)
    records = json.loads((folder / "records.json").read_text())
    rows = parity(records, args.depth)
    if not rows:
        print(f"{folder}: no pair of {PAIRS} with chain trees and vLLM counters", file=sys.stderr)
        return 2
    (folder / "chain_parity.json").write_text(json.dumps({"source": str(folder), "rows": rows}, indent=1))
    md = markdown(rows, str(folder))
    (folder / "chain_parity.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
