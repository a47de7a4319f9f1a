"""Verify-round time of a 33-row tree vs a 5-row chain vs a 1-row decode, one run, as ratios (CPU-measured).

All three go through the same engine path (HyCo session, tree positions, CPU_ATTN override with the
torch twin, the core's decision, compaction, hand-off): the 5-row chain is what vLLM's built-in MTP with
K=4 verifies, the 1-row "tree" is a plain decode step. Shapes are interleaved round by round so drift in a
shared machine hits all three alike. Also reported: host-side time per round spent in HyCo's hooks (plan,
decision, compaction, hand-off; not the attention twin, which is the CPU attention path), the API wall
time per round, and the distinct MoE experts the rows of one round touch per layer (router hook on the
fixture, plus the expectation E * (1 - (1 - k/E)^R) for 128 experts top-8).

    .venv/bin/python benchmarks/bench_verify.py [--rounds 12] [--prompt-len 256]

Writes benchmarks/out/bench_verify.json. On CPU compute grows with rows; the GPU ratio comes from the
kernel issue's GPU run (docs/decisions.md D8).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import env_info, write_json

SHAPES = {"tree33": 33, "chain5": 5, "decode1": 1}


def expected_experts(num_experts: int, top_k: int, rows: int) -> float:
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def _tree(root: int, rows: int, vocab: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A chain of up to 4 plus siblings and random leaves (Algorithm 3's shape), ``rows`` rows in all."""
    tokens, parents = [root], [-1]
    for i in range(1, rows):
        parent = i - 1 if i <= 4 else rng.randrange(i)
        while True:
            tok = rng.randrange(3, vocab)
            if all(not (p == parent and t == tok) for t, p in zip(tokens, parents)):
                break
        tokens.append(tok)
        parents.append(parent)
    return tokens, parents


class RouterProbe:
    """Forward hooks on every Gemma-4 router: the top-k experts each row of a step picked, per layer."""

    def __init__(self, model, top_k: int):
        self.top_k, self.steps, self.handles = top_k, [], []
        for name, mod in model.named_modules():
            if type(mod).__name__ == "Gemma4Router":
                self.handles.append(mod.register_forward_hook(self._hook(name)))
        self.current: dict[str, set[int]] = {}

    def _hook(self, name):
        def hook(_mod, _inp, logits):  # logits [T, E]
            self.current[name] = set(logits.topk(self.top_k, dim=-1).indices.flatten().tolist())
        return hook

    def take(self) -> dict[str, int]:
        out, self.current = {k: len(v) for k, v in self.current.items()}, {}
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds per shape")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    args = ap.parse_args(argv)

    from vllm import LLM

    from hyco_lab.fixtures import ensure_fixtures
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    cache = Path(os.environ.get("HYCO_CACHE", Path(__file__).resolve().parents[1] / ".cache"))
    verifier = ensure_fixtures(cache, fp32=True, window=128, seed=0, progress=False).verifier
    llm = LLM(model=str(verifier), dtype="float32", max_model_len=2048, max_num_seqs=4, enforce_eager=True,
              distributed_executor_backend="uni", seed=0, enable_prefix_caching=False,
              speculative_config={"method": "hyco"})
    hf = llm.llm_engine.vllm_config.model_config.hf_text_config
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    probe = RouterProbe(runner.model, hf.top_k_experts)
    hy = HycoEngine(llm)
    rng = random.Random(0)
    prompt = [2] + [rng.randrange(3, hf.vocab_size) for _ in range(args.prompt_len - 1)]
    total = (args.rounds + args.warmup) * 3 + 4
    s = hy.open(prompt_token_ids=prompt, temperature=0.0, max_tokens=total * 34, ignore_eos=True)
    root, rnd = s.root, 0
    rows = {k: {"wall_s": [], "host_s": [], "experts": []} for k in SHAPES}
    for i in range(args.warmup + args.rounds):
        for shape, n in SHAPES.items():
            toks, pars = _tree(root, n, hf.vocab_size, rng)
            probe.take()
            t0 = time.perf_counter()
            v = hy.submit(s.sid, rnd, toks, pars)
            wall = time.perf_counter() - t0
            experts = probe.take()
            root, rnd = v.bonus, rnd + 1
            if i >= args.warmup:
                rows[shape]["wall_s"].append(wall)
                rows[shape]["host_s"].append(v.stats["host_s"])
                rows[shape]["experts"].append(statistics.mean(experts.values()) if experts else 0.0)
    hy.close(s.sid)
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in rows.items()}
    result = {
        "env": env_info(), "label": "CPU-measured", "fixture": str(verifier), "prompt_len": args.prompt_len,
        "rounds": args.rounds, "median": med,
        "ratio_tree33_vs_decode1": med["tree33"]["wall_s"] / med["decode1"]["wall_s"],
        "ratio_chain5_vs_decode1": med["chain5"]["wall_s"] / med["decode1"]["wall_s"],
        "ratio_tree33_vs_chain5": med["tree33"]["wall_s"] / med["chain5"]["wall_s"],
        "host_overhead_s_per_round": {k: med[k]["host_s"] for k in SHAPES},
        "experts_per_layer_measured": {k: med[k]["experts"] for k in SHAPES},
        "fixture_experts": {"num_experts": hf.num_experts, "top_k": hf.top_k_experts},
        "experts_per_layer_expected_128_top8": {k: expected_experts(128, 8, n) for k, n in SHAPES.items()},
    }
    for key in ("ratio_tree33_vs_decode1", "ratio_chain5_vs_decode1", "ratio_tree33_vs_chain5"):
        print(f"{key:28s} {result[key]:.2f}")
    for k, n in SHAPES.items():
        print(f"{k:8s} wall {med[k]['wall_s'] * 1e3:8.1f} ms  hooks {med[k]['host_s'] * 1e3:6.2f} ms  "
              f"experts/layer {med[k]['experts']:.2f} of {hf.num_experts} (128/top-8 expectation "
              f"{expected_experts(128, 8, n):.1f})")
    print("wrote", write_json("bench_verify", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
