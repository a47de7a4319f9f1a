"""Batched tree verification time against the LM-head matmul that produced its logits.

For B = 1, 16, 64 requests, each with a HyCo-like 33-row tree (root + 32 nodes), the LM head
``logits = h @ W.T`` (hidden 2,816, vocabulary 262,144, bf16; Gemma-4 26B-A4B shapes, docs/decisions.md) is
the denominator. The numerator is ``verify_batch`` on those logits with the paper's sampling (T = 1,
top-k 64, top-p 0.95), exact and ε = 0.005: p̃ (``sampling_support``), one seeded sample per row, the
decision and the compaction plan. Ratios are measured inside one run (CPU-measured, docs/decisions.md D8).

    .venv/bin/python benchmarks/bench_acceptance.py                 # prints a table, writes JSON
    .venv/bin/python benchmarks/bench_acceptance.py --batches 1 16 --sampling default nucleus --threads 1
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import env_info, print_table, time_fn, write_json

from vllm_hyco.spec_decode.sampling import SamplingSpec, sampling_support
from vllm_hyco.spec_decode.tree import TokenTree
from vllm_hyco.spec_decode.verify import PackedTrees, verify_batch

HIDDEN, VOCAB, ROWS = 2816, 262_144, 33
PAPER = SamplingSpec(temperature=1.0, top_k=64, top_p=0.95)
SPECS = {
    "paper": PAPER,  # T 1, top-k 64, top-p 0.95 (sparse support)
    "default": SamplingSpec(),  # vLLM's defaults: no truncation (dense softmax)
    "nucleus": SamplingSpec(top_p=0.9),  # top-p only: one full-vocabulary sort per row (dense)
}


def hyco_tree(seed: int) -> TokenTree:
    """Chain of 4 from the root, runner-ups at depths 1-2, the rest SLM children (32 nodes)."""
    rng = random.Random(seed)
    parents, labels = [-1, 0, 1, 2, 3, 0, 1], [0, 1, 1, 1, 1, 2, 2]
    while len(parents) < ROWS:
        parents.append(rng.randrange(len(parents)))
        labels.append(3)
    tokens = [rng.randrange(VOCAB) for _ in parents]
    return TokenTree.from_parents(tokens, parents, vocab_size=VOCAB, labels=labels)


def bench_batch(batch: int, weight: torch.Tensor, reps: int, warmup: int, spec_name: str) -> list[dict]:
    spec = SPECS[spec_name]
    gen = torch.Generator().manual_seed(batch)
    hidden = torch.randn(batch * ROWS, HIDDEN, generator=gen).to(torch.bfloat16)  # [N, H]
    packed = PackedTrees.pack([hyco_tree(1000 * batch + b) for b in range(batch)])
    matmul = time_fn(lambda: hidden @ weight.T, warmup=warmup, reps=reps)
    logits = hidden @ weight.T  # [N, V] bf16
    rows = []
    for eps in (None, 0.005):
        def run(eps=eps):
            gens = [torch.Generator().manual_seed(b) for b in range(batch)]
            return verify_batch(packed, logits, spec, eps, gens)

        t = time_fn(run, warmup=warmup, reps=reps)
        rows.append({"batch": batch, "rows": batch * ROWS, "sampling": spec_name,
                     "mode": "exact" if eps is None else f"eps={eps}",
                     "matmul_ms": matmul["median_s"] * 1e3, "verify_ms": t["median_s"] * 1e3,
                     "ratio": t["median_s"] / matmul["median_s"],
                     "mean_accepted": float(run().num_accepted.float().mean())})
    probs_t = time_fn(lambda: sampling_support(logits, spec.temperature, spec.top_k, spec.top_p),
                      warmup=0, reps=max(1, reps // 2))
    for r in rows:
        r["p_tilde_ms"] = probs_t["median_s"] * 1e3
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--sampling", nargs="+", default=["paper"], choices=sorted(SPECS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/out)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    weight = (torch.randn(VOCAB, HIDDEN) * 0.02).to(torch.bfloat16)  # [V, H] LM head
    rows = []
    for name in args.sampling:
        for batch in args.batches:
            rows += bench_batch(batch, weight, args.reps, args.warmup, name)
    env = env_info()
    print(f"bench_acceptance ({env['label']}, torch {env.get('torch')}, {env.get('torch_threads')} threads)")
    print_table(rows, ["sampling", "batch", "rows", "mode", "matmul_ms", "verify_ms", "p_tilde_ms", "ratio",
                       "mean_accepted"])
    sampling = {k: SPECS[k].__dict__ for k in args.sampling}
    path = write_json("bench_acceptance", {"env": env, "hidden": HIDDEN, "vocab": VOCAB, "sampling": sampling,
                                           "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
