"""Issue 35: what a MiMo session loses when it switches to server mode, whose MTP-layer cache phone mode never
wrote.

    python benchmarks/spikes/mimo_server_mode_switch.py FAMILY_DIR [--phone-rounds 8] [--prompts 20] [--out F]

FAMILY_DIR: ``python -m hyco_lab.fixtures DIR --shape mimo --weights trained --fp32``. One in-process HyCo engine
(``{"method": "hyco", "model": VERIFIER, "num_speculative_tokens": 2}``, vLLM's ``mimo_mtp`` drafting for server
mode). Each held-out request decodes greedily to 40 tokens twice: in server mode from the start (vLLM's MTP
layer wrote its cache from the prefill on), and after ``--phone-rounds`` phone rounds of a root-only tree (one
token each; the server runs no MTP head for them, so that layer's cache holds nothing of the prompt or of those
positions). Printed: tokens committed per server-mode step, by the position the step starts at, both ways (the
text is the same greedy text, so the positions are the same).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("family", type=Path)
    p.add_argument("--phone-rounds", type=int, default=8)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM

    from hyco_lab.fixtures.kinds import eval_prompts
    from hyco_lab.fixtures.report import _prompt_ids
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    verifier = str(args.family / "verifier")
    llm = LLM(model=verifier, dtype="float32", max_model_len=1024, max_num_seqs=4, enforce_eager=True,
              distributed_executor_backend="uni", seed=0, trust_remote_code=True,
              speculative_config={"method": "hyco", "model": verifier, "num_speculative_tokens": 2,
                                  "budget_policy": "static"})
    hy = HycoEngine(llm)
    steps: dict[str, list[tuple[int, int]]] = {"server_from_start": [], "after_phone_rounds": []}
    for ids in _prompt_ids(args.family / "verifier", eval_prompts(max(args.prompts, 60))[: args.prompts]):
        for arm, rounds in (("server_from_start", 0), ("after_phone_rounds", args.phone_rounds)):
            s = hy.open(prompt_token_ids=ids, temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
            out, root = [], s.root
            for rnd in range(rounds):
                v = hy.submit(s.sid, rnd, [root], [-1])
                out, root = out + v.committed, v.bonus
            hy.set_mode(s.sid, "server")
            while len(out) < args.tokens:
                v = hy.decode_server(s.sid, steps=1)
                if v.committed:
                    steps[arm].append((len(out), len(v.committed)))
                out += v.committed
                if v.finished:
                    break
            hy.close(s.sid)
    llm.llm_engine.engine_core.shutdown()
    bands = [(args.phone_rounds + 8 * i, args.phone_rounds + 8 * (i + 1)) for i in range(3)]
    result = {"phone_rounds": args.phone_rounds, "prompts": args.prompts, "k": 2, "bands": {}}
    for lo, hi in bands:
        row = {}
        for arm, xs in steps.items():
            n = [c for pos, c in xs if lo <= pos < hi]
            row[arm] = {"tokens_per_step": round(sum(n) / max(len(n), 1), 3), "steps": len(n)}
        result["bands"][f"{lo}-{hi}"] = row
    result["command"] = " ".join(sys.argv)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
