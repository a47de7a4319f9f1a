"""MAT by vLLM's formula (1 + accepted / drafts) per configuration, recomputed from a bench run's records.

    python benchmarks/spikes/mat_from_records.py RESULT_DIR

For a run made before the bench's ``mat`` took vLLM's formula (issue 35): a phone's rounds that verified a draft
count (a root-only opening round is left out, as vLLM's prefill step is), each with its whole accepted path;
Cloud+MTP from vLLM's counters per pass. ``committed/round``: the committed tokens per drafted round (the last
round's path cut at the answer's end). 95 % bootstrap over requests (phones) or passes (Cloud+MTP).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

RESAMPLES = 2000


def units(records: list[dict]) -> dict[str, list[tuple[int, int, int | None]]]:
    """Per configuration: (drafts, accepted, committed or None) per request (phones) or pass (Cloud+MTP)."""
    out: dict[str, list[tuple[int, int, int | None]]] = {}
    for run in records:
        c = run["config"]
        if run.get("spec_counters"):
            sc = run["spec_counters"]
            out.setdefault(c, []).append((int(sc.get("drafts", 0)), int(sc.get("accepted", 0)), None))
        for q in run["requests"]:
            drafted = [x for x in q["rounds"] if x["nodes"] > 0]
            if drafted:
                out.setdefault(c, []).append((len(drafted), sum(x["accepted"] for x in drafted),
                                              sum(x["committed"] for x in drafted)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    print("| configuration | MAT [95 %] | units | committed / round |\n| --- | --- | --- | --- |")
    for c, xs in units(json.loads((args.dir / "records.json").read_text())).items():
        a = np.array([(x[0], x[1]) for x in xs], float)
        i = rng.integers(0, len(a), (RESAMPLES, len(a)))
        boot = 1 + a[i, 1].sum(1) / a[i, 0].sum(1)
        committed = [x[2] for x in xs if x[2] is not None]
        per_round = f"{sum(committed) / a[:, 0].sum():.3f}" if committed else "–"
        print(f"| {c} | {1 + a[:, 1].sum() / a[:, 0].sum():.3f} [{np.percentile(boot, 2.5):.3f}, "
              f"{np.percentile(boot, 97.5):.3f}] | {len(a)} | {per_round} |")


if __name__ == "__main__":
    main()
