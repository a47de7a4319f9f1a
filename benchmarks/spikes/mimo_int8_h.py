"""Issue 35: does the h-row hand-off's int8 quantization move the phone's MiMo MTP chain? (greedy, offline)

    python benchmarks/spikes/mimo_int8_h.py FAMILY_DIR [--prompts 40] [--tokens 48] [--out FILE.json]

FAMILY_DIR: ``python -m hyco_lab.fixtures DIR --shape mimo --weights trained --fp32``. The trunk (the trainer's
torch MiMo, ``hyco_lab.fixtures.train_mimo``, which matches vLLM's log-probabilities within 1.6e-5) continues
each held-out family request greedily. At every position the phone's drafter (``mobile_client.drafters.
own_mtp``) takes that round's h row (one position a round) and drafts a K = 4 greedy chain from the next root;
a chain token at depth d counts as reached when depths 1..d-1 equal the trunk's next tokens, accepted when it
equals the trunk's token too. Two phones side by side: h in float32, and h through the wire's int8 with the
family's scales. Prints and writes conditional acceptance per depth for both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("family", type=Path)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from hyco_lab.fixtures.check_mimo import chain_acceptance, greedy_continuation, hidden, load_torch
    from hyco_lab.fixtures.kinds import eval_prompts
    from hyco_lab.fixtures.report import _prompt_ids
    from mobile_client.drafters.own_mtp import OwnMtpDrafter
    from vllm_hyco.handoff.quant import dequantize, load_scales, quantize

    model = load_torch(args.family / "verifier")
    cfg, sd = model.cfg, model.state_dict()
    scales = load_scales(args.family / "handoff_scales.npz")
    keep = list(range(cfg["vocab_size"]))
    reached = {name: np.zeros(4) for name in ("float", "int8")}
    accepted = {name: np.zeros(4) for name in ("float", "int8")}
    for ids in _prompt_ids(args.family / "verifier", eval_prompts(max(args.prompts, 60))[: args.prompts]):
        seq = greedy_continuation(model, ids, args.tokens + 4)
        h = hidden(model, seq)  # [T, H] before the final norm
        rows = {"float": h, "int8": dequantize(quantize(h, scales.h), scales.h)}
        for name, hr in rows.items():
            r, a, _ = chain_acceptance(OwnMtpDrafter(cfg, sd, keep), hr, seq, len(ids), args.tokens)
            reached[name] += r
            accepted[name] += a
    out = {name: {"reached": reached[name].tolist(), "accepted": accepted[name].tolist(),
                  "conditional": (accepted[name] / np.maximum(reached[name], 1)).round(4).tolist()}
           for name in reached}
    out["command"] = " ".join(sys.argv)
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
