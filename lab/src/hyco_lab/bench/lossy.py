"""Which lossy step of the phone's path costs its MTP chain acceptance (issue 34 item 2), per depth, offline.

    python -m hyco_lab.bench.lossy [--fixtures DIR] [--prompts 40] [--tokens 64] [--out F.json]

The verifier (transformers, fp32) continues each held-out prompt greedily. At every position p of the
continuation the phone's MTP Drafter drafts its chain (K = 4, greedy) from what a hand-off would carry for a
round whose root is the token at p + 1: the K/V rows of positions [0, p + 1) of the two hand-off layers, h at p
and e(root). A chain node at depth d is *reached* when nodes 1..d-1 equal the verifier's next tokens, and
*accepted* when it does too: greedy verification, the same question on every variant and on the same positions,
so the differences are the lossy steps' alone. Variants (each a step of the bench's phone, ``phones.load_phone``:
the torch head over the full vocabulary, so no W4/A16 or keep set, which only the compiled QNN build has):

* ``float``: K/V, h and e(root) in fp32 and the float embedding table: the reference, equal to vLLM's own MTP
  proposer token for token (``tests/client/test_client_drafter_mtp_vllm.py``)
* ``kv8``: the K/V rows through the hand-off's int8 with its fixed per-channel scales
  (``vllm_hyco.handoff.quant``, the bundle's ``handoff_scales.npz``)
* ``x8``: h and e(root) through int8 with theirs
* ``lut8``: the 8-bit embedding table for the chain's own tokens (the inputs of steps 2..K)
* ``phone``: all three, what the bench's phone runs (``HycoPhoneDrafter.apply_handoff``)

Reported per variant and depth: accepted / reached, and the difference from ``float`` with a 95 % bootstrap
interval over prompts (2,000 resamples, seed 0). Not covered: the hand-off's timing (the phone's ring holds
exactly the committed rows here, as it does after every verdict) and the window (contexts stay inside it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

VARIANTS = {"float": (), "kv8": ("kv",), "x8": ("x",), "lut8": ("lut",), "phone": ("kv", "x", "lut")}
K = 4


def greedy(verifier: Any, prompt: list[int], tokens: int) -> list[int]:
    """The verifier's greedy continuation (one full forward per token: the fixtures are tiny)."""
    import torch

    seq = list(prompt)
    with torch.no_grad():
        for _ in range(tokens):
            logits = verifier(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(torch.argmax(logits)))
    return seq


def _q(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    from vllm_hyco.handoff.quant import dequantize, quantize

    return dequantize(quantize(x, scale), scale)


def counts(drafter: Any, lut_float: Any, lut8: Any, steps: tuple[str, ...], seq: list[int], start: int,
           h: np.ndarray, kv: dict, scales: Any, kv_scales: dict, embed: np.ndarray, hidden: int) -> np.ndarray:
    """[2, K] (reached, accepted) per depth over positions start-1 .. len(seq) - K - 2 of one sequence."""
    out = np.zeros((2, K))
    rows = {kind: (_q(k, kv_scales[kind][0]), _q(v, kv_scales[kind][1])) if "kv" in steps else (k, v)
            for kind, (k, v) in kv.items()}
    drafter.lut = lut8 if "lut" in steps else lut_float
    for p in range(start - 1, len(seq) - K - 1):
        root, t = seq[p + 1], p + 1
        drafter.t0 = -1
        drafter.apply_handoff(t, 0, {kind: (k[:t], v[:t]) for kind, (k, v) in rows.items()})
        e, hp = embed[root] * math.sqrt(hidden), h[p]
        if "x" in steps:
            e, hp = _q(e, scales.e), _q(hp, scales.h)
        chain = drafter.draft(np.concatenate([e, hp]).astype(np.float32)).chain
        for d in range(K):
            out[0, d] += 1
            if chain[d] != seq[p + 2 + d]:
                break
            out[1, d] += 1
    return out


def _boot(a: np.ndarray, b: np.ndarray, rng: np.random.Generator, n: int = 2000) -> list[list[float]]:
    """95 % interval per depth of (accepted/reached of a) - (of b), prompts resampled together."""
    idx = rng.integers(0, len(a), size=(n, len(a)))
    sa, sb = a[idx].sum(1), b[idx].sum(1)  # [n, 2, K]
    diff = sa[:, 1] / np.maximum(sa[:, 0], 1) - sb[:, 1] / np.maximum(sb[:, 0], 1)
    lo, hi = np.percentile(diff, [2.5, 97.5], axis=0)
    return [[round(float(x), 4), round(float(y), 4)] for x, y in zip(lo, hi)]


def run(fx: Path, prompts: int, tokens: int, log=print) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from hyco_lab.bench.__main__ import bench_prompts
    from hyco_lab.bench.phones import prompt_ids
    from mobile_client.bundle import handoff_spec, keep_ids, read_hf_dir
    from mobile_client.drafters.mtp import EmbedLut, MtpDrafter, MtpHead, torch_step
    from mobile_client.drafters.spec import MtpSpec
    from mobile_client.phone_drafter import HycoPhoneDrafter
    from mobile_client.quant.capture import verifier_states

    verifier = AutoModelForCausalLM.from_pretrained(fx / "verifier", dtype=torch.float32).eval()
    spec, scales = handoff_spec(fx)
    kv_scales = {}
    for layer in spec.layers:
        k_s, v_s = scales.layer(layer.layer_id)
        kv_scales[HycoPhoneDrafter.KINDS[layer.kind]] = (k_s, k_s if v_s is None else v_s)
    acfg, asd = read_hf_dir(fx / "assistant")
    mspec = MtpSpec.from_hf_config(acfg)
    embed_t = verifier.get_input_embeddings().weight.detach().float()
    keep = keep_ids(fx, embed_t.shape[0], None)
    drafter = MtpDrafter(mspec, keep, EmbedLut.from_embedding(embed_t, keep, bits=None),
                         torch_step(MtpHead.from_hf_state_dict(mspec, asd, keep)), window=1024)
    lut_float, lut8 = drafter.lut, EmbedLut.from_embedding(embed_t, keep)
    embed, hidden = embed_t.numpy(), mspec.backbone
    tok = fx / "tokenizer" if (fx / "tokenizer").exists() else fx / "verifier"
    per: dict[str, list[np.ndarray]] = {v: [] for v in VARIANTS}
    for i, p in enumerate(bench_prompts("family", prompts)):
        prompt = prompt_ids(tok, p["messages"])
        seq = greedy(verifier, prompt, tokens)
        h, kv = verifier_states(verifier, seq)
        for name, steps in VARIANTS.items():
            per[name].append(counts(drafter, lut_float, lut8, steps, seq, len(prompt), h, kv, scales, kv_scales,
                                    embed, hidden))
        log(f"[lossy] prompt {i + 1}/{prompts}: {len(seq) - len(prompt)} tokens")
    rng = np.random.default_rng(0)
    base = np.stack(per["float"])
    out: dict[str, Any] = {"fixtures": str(fx), "prompts": prompts, "tokens": tokens, "k": K, "variants": {}}
    for name in VARIANTS:
        a = np.stack(per[name])
        tot = a.sum(0)
        out["variants"][name] = {"reached": tot[0].astype(int).tolist(),
                                 "rate": [round(float(x), 4) for x in tot[1] / np.maximum(tot[0], 1)],
                                 "diff_ci": None if name == "float" else _boot(a, base, rng)}
    return out


def markdown(r: dict[str, Any]) -> str:
    base = r["variants"]["float"]["rate"]
    lines = [f"Greedy acceptance per depth of the phone's MTP chain by hand-off variant ({r['prompts']} family "
             f"prompts x {r['tokens']} tokens; `python -m hyco_lab.bench.lossy`); difference from `float` [95 %]:",
             "", "| variant | " + " | ".join(f"depth {d + 1}" for d in range(r["k"])) + " |",
             "|---|" + "---|" * r["k"]]
    for name, v in r["variants"].items():
        cells = []
        for d in range(r["k"]):
            c = f"{v['rate'][d]:.3f} ({v['reached'][d]})"
            if v["diff_ci"] is not None:
                lo, hi = v["diff_ci"][d]
                c += f" {v['rate'][d] - base[d]:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            cells.append(c)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyco_lab.bench.lossy", description=__doc__.split("\n")[0])
    p.add_argument("--fixtures", default=None)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from hyco_lab.bench.__main__ import fixtures_dir

    r = run(fixtures_dir(args.fixtures), args.prompts, args.tokens, log=lambda m: print(m, file=sys.stderr))
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=1))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
