"""Issue 35: in live HyCo sessions, is each chain the phone drafts the one vLLM's drafter would draft there?

    python benchmarks/spikes/mimo_session_chains.py FAMILY_DIR [--prompts 12] [--out FILE.json]

``mimo_drafts_vs_vllm.py`` seeds a fresh phone drafter with float h for every step. This checks the other half,
the session's bookkeeping: a bench run of ``hyco-exact-chain`` (one phone, T = 1 / top-k 64 / top-p 0.95, 32
tokens, a real server on loopback) with ``OwnMtpDrafter.apply_handoff`` / ``draft`` wrapped to record each
round's committed tokens and chain; the phone's cache is extended round by round from the hand-offs' int8 h
rows. Afterwards each chain is compared with a fresh drafter's from float h of the same committed tokens (the
trainer's torch trunk; ``mimo_drafts_vs_vllm.py`` shows that drafter is vLLM's ``mimo_mtp``, step for step).
Printed: the share of rounds whose first d chain tokens are the same, per depth.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("family", type=Path)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import numpy as np

    from hyco_lab.bench.__main__ import main as bench
    from hyco_lab.fixtures.check_mimo import float_chain, hidden, load_torch
    from mobile_client.drafters import own_mtp

    rounds: list[dict] = []
    apply, draft = own_mtp.OwnMtpDrafter.apply_handoff, own_mtp.OwnMtpDrafter.draft

    def recording_apply(self, t, a, h_rows, tokens):
        self.spike_tokens = [int(x) for x in tokens[: t + 1]]
        return apply(self, t, a, h_rows, tokens)

    def recording_draft(self, x_hat, sampling=None):
        d = draft(self, x_hat, sampling)
        rounds.append({"root": self.t0, "tokens": self.spike_tokens, "chain": list(d.chain)})
        return d

    own_mtp.OwnMtpDrafter.apply_handoff, own_mtp.OwnMtpDrafter.draft = recording_apply, recording_draft
    with tempfile.TemporaryDirectory() as out:
        bench(["--fixtures", str(args.family), "--configs", "hyco-exact-chain", "--prompt-set", "family",
               "--prompts", str(args.prompts), "--runs", "1", "--phones", "1", "--max-tokens", "32", "--link", "lan",
               "--replay", "", "--out", out])
    own_mtp.OwnMtpDrafter.apply_handoff, own_mtp.OwnMtpDrafter.draft = apply, draft

    trunk = load_torch(args.family / "verifier")
    same, diffs = np.zeros(4), []
    for r in rounds:
        seq, root = r["tokens"], r["root"]
        chain = float_chain(trunk, hidden(trunk, seq), seq, root)
        same += [chain[: d + 1] == r["chain"][: d + 1] for d in range(4)]
        if chain != r["chain"] and len(diffs) < 10:
            diffs.append({"root": root, "session": r["chain"], "fresh_float_h": chain})
    result = {"rounds": len(rounds), "same_prefix_per_depth": (same / max(len(rounds), 1)).round(4).tolist(),
              "diffs": diffs, "command": " ".join(sys.argv)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
