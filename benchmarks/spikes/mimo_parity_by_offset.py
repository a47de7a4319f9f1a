"""Issue 35: chain parity inside the answer, by where in the answer each round starts.

    python benchmarks/spikes/mimo_parity_by_offset.py RESULT_DIR CONFIG VLLM_STEPS.json [--out FILE.json]

RESULT_DIR: a bench run's folder (``records.json``) holding the phone configuration CONFIG (``hyco-exact-chain``:
the MTP chain alone, vLLM's step shape). VLLM_STEPS.json: ``mimo_drafts_vs_vllm.py --temperature 1
--stop-at-eos --out`` on the same family, prompts and sampling (its ``steps_inside``: vLLM's own steps, each
with its root's offset in the answer and how many of its drafts the committed tokens accepted).

Both sides keep only the rounds (steps) whose K drafts all lie inside the answer, so nothing past EOS or
``max_tokens`` is counted (the bench's counters count a last round's path past the answer's end, and vLLM's
count its last step's). Per depth: the conditional acceptance (accepted / reached), over all rounds and by the
root's offset in the answer; the difference with a 95 % bootstrap interval, requests resampled on each side.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

K = 4
BANDS = ((0, 10**9), (0, 1), (1, 4), (4, 10), (10, 10**9))
RESAMPLES = 2000


def phone_requests(records: list[dict], config: str) -> list[list[tuple[int, int]]]:
    """Per request: (root offset, chain drafts accepted) of each round after the first whose K drafts lie inside
    the answer. A round's root is the last committed token, answer index ``committed before - 1``."""
    from hyco_lab.bench.chainparity import chain_counts

    out = []
    for r in records:
        if r["config"] != config or r["run"] < 0:
            continue
        for q in r["requests"]:
            steps, before = [], 0
            for rd in q.get("rounds") or []:
                if rd.get("tree") and before >= 1 and before + K - 1 < q["tokens"]:
                    reached, accepted = chain_counts([rd], K)
                    if reached[0]:
                        steps.append((before - 1, int(accepted.sum())))
                before += rd["committed"]
            out.append(steps)
    return out


def vllm_requests(steps_inside: list[list[int]]) -> list[list[tuple[int, int]]]:
    by: dict[int, list[tuple[int, int]]] = {}
    for req, offset, n in steps_inside:
        by.setdefault(req, []).append((offset, n))
    return list(by.values())


def rates(requests, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    reached, accepted = np.zeros(K), np.zeros(K)
    for steps in requests:
        for offset, n in steps:
            if lo <= offset < hi:
                reached[: min(n + 1, K)] += 1
                accepted[:n] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(reached > 0, accepted / np.maximum(reached, 1), np.nan), reached


def _boot(requests, lo, hi, rng) -> np.ndarray:
    idx = rng.integers(0, len(requests), size=(RESAMPLES, len(requests)))
    return np.stack([rates([requests[i] for i in row], lo, hi)[0] for row in idx])


def compare(phone, vllm) -> list[dict]:
    rng, rows = np.random.default_rng(0), []
    for lo, hi in BANDS:
        rp, np_ = rates(phone, lo, hi)
        rv, nv = rates(vllm, lo, hi)
        diff = _boot(phone, lo, hi, rng) - _boot(vllm, lo, hi, rng)
        ci = np.nanpercentile(diff, [2.5, 97.5], axis=0).T
        rows.append({"offsets": [lo, None if hi >= 10**9 else hi], "phone": rp.round(4).tolist(),
                     "phone_reached": np_.astype(int).tolist(), "vllm": rv.round(4).tolist(),
                     "vllm_reached": nv.astype(int).tolist(), "diff": (rp - rv).round(4).tolist(),
                     "diff_ci": ci.round(4).tolist()})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| root offset in the answer | depth | phone (reached) | vLLM (reached) | phone - vLLM [95 %] |",
           "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lo, hi = r["offsets"]
        band = "all" if (lo, hi) == (0, None) else f"[{lo}, {hi if hi is not None else 'end'})"
        for d in range(K):
            ci = r["diff_ci"][d]
            out.append(f"| {band} | {d + 1} | {r['phone'][d]:.3f} ({r['phone_reached'][d]}) | "
                       f"{r['vllm'][d]:.3f} ({r['vllm_reached'][d]}) | "
                       f"{r['diff'][d]:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}] |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("config")
    p.add_argument("vllm_steps", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    records = json.loads((args.results / "records.json").read_text())
    phone = phone_requests(records, args.config)
    vllm = vllm_requests(json.loads(args.vllm_steps.read_text())["steps_inside"])
    rows = compare(phone, vllm)
    md = markdown(rows)
    print(md)
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "phone_requests": len(phone), "vllm_requests": len(vllm),
                                        "command": " ".join(sys.argv)}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
