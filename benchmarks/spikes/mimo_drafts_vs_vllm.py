"""Issue 35: is the phone's MiMo MTP chain vLLM's? Every draft vLLM's ``mimo_mtp`` makes, against the phone's.

    python benchmarks/spikes/mimo_drafts_vs_vllm.py FAMILY_DIR [--prompts 40] [--tokens 48] [--out FILE.json]

FAMILY_DIR: ``python -m hyco_lab.fixtures DIR --shape mimo --weights trained --fp32``. One in-process vLLM engine
(fp32, eager, ``{"method": "mtp", "num_speculative_tokens": 4}``) decodes each held-out family request greedily;
a wrapper around ``SpecDecodeBaseProposer.propose`` records, for every step, the next root's position, the
bonus and vLLM's 4 drafts. For each step the phone's drafter (``mobile_client.drafters.own_mtp``) is seeded with
float h of every committed position before that root (the trainer's torch trunk, which matches vLLM's
log-probabilities within 1.6e-5) and drafts its chain; printed: the share of steps whose first d drafts are
the same, per depth.
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
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the requests' temperature (> 0: sampled with --top-k / --top-p, seeded per request; "
                        "vLLM's drafts stay greedy)")
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--stop-at-eos", action="store_true",
                   help="answers end at EOS, as the bench's (default: ignore_eos)")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode import llm_base_proposer as lbp

    from hyco_lab.fixtures.check_mimo import float_chain, hidden, load_torch
    from hyco_lab.fixtures.kinds import eval_prompts
    from hyco_lab.fixtures.report import _prompt_ids

    steps: list[tuple[int, int, list[int]]] = []
    propose = lbp.SpecDecodeBaseProposer.propose

    def recording(self, *a, **kw):  # vLLM's runner passes its arguments by name
        out = propose(self, *a, **kw)
        positions, to_sample = kw["target_positions"], kw["token_indices_to_sample"]
        last = int(to_sample[0]) if to_sample is not None else int(positions.shape[0] - 1)
        steps.append((int(positions[last]) + 1, int(kw["next_token_ids"][0]), out[0].tolist()))
        return out

    lbp.SpecDecodeBaseProposer.propose = recording
    verifier = str(args.family / "verifier")
    llm = LLM(model=verifier, dtype="float32", max_model_len=1024, max_num_seqs=1, enforce_eager=True,
              distributed_executor_backend="uni", seed=0, trust_remote_code=True,
              speculative_config={"method": "mtp", "model": verifier, "num_speculative_tokens": 4})
    trunk = load_torch(args.family / "verifier")
    same, total, diffs = np.zeros(4), 0, []
    sampled = {} if args.temperature == 0 else {"top_k": args.top_k, "top_p": args.top_p}
    reached, accepted = np.zeros(4), np.zeros(4)  # vLLM's own chain, per depth, read from the committed tokens
    per_step: list[list[int]] = []  # (request, the root's offset in the answer, drafts accepted)
    prompts = _prompt_ids(args.family / "verifier", eval_prompts(max(args.prompts, 60))[: args.prompts])
    for i, ids in enumerate(prompts):
        steps.clear()
        params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=not args.stop_at_eos,
                                seed=i, **sampled)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        seq = list(ids) + list(out.token_ids)
        h = hidden(trunk, seq)
        for root, bonus, drafts in steps:
            if root >= len(seq) or seq[root] != bonus:
                continue  # the last step's drafts (after max_tokens)
            chain = float_chain(trunk, h, seq, root)
            total += 1
            same += [chain[: d + 1] == drafts[: d + 1] for d in range(4)]
            if root + len(drafts) < len(seq):  # steps whose drafts all lie inside the answer
                n = next((d for d, t in enumerate(drafts) if seq[root + 1 + d] != t), len(drafts))
                reached[: n + 1] += 1
                accepted[:n] += 1
                per_step.append([i, root - len(ids), n])
            if chain != drafts and len(diffs) < 10:
                diffs.append({"root": root, "phone": chain, "vllm": drafts})
    llm.llm_engine.engine_core.shutdown()
    result = {"steps": total, "same_prefix_per_depth": (same / max(total, 1)).round(4).tolist(), "diffs": diffs,
              "vllm_reached": reached.tolist(),
              "vllm_accepted_per_depth": (accepted / np.maximum(reached, 1)).round(4).tolist(),
              "steps_inside": per_step, "command": " ".join(sys.argv)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
