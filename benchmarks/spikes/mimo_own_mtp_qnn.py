"""The compiled MiMo MTP layer (``own_mtp_ctx.onnx``) on real h rows: does W4/A16 + HTP move the phone's chains?

    python benchmarks/spikes/mimo_own_mtp_qnn.py calib FAMILY_DIR OUT.npz            # captured hand-offs
    python -m mobile_client.export.build BUILD --fixtures FAMILY_DIR [--calib-streams OUT.npz]
    python benchmarks/spikes/mimo_own_mtp_qnn.py eval FAMILY_DIR BUILD [--prompts 8] [--tokens 32] [--out F.json]

FAMILY_DIR: ``python -m hyco_lab.fixtures DIR --shape mimo --weights trained --fp32``. ``calib`` writes 14
hand-off streams for ``--calib-streams``: the trunk's h rows (the trainer's torch MiMo, before the final norm,
through the wire's int8 with the family's scales) on the family's training samples, 64 .. 1,400 positions each.
``eval`` continues held-out family requests greedily with the trunk (as ``mimo_int8_h.py``) and runs three
phones side by side on the same int8 h rows, one position a round: the torch layer (float), the build's QDQ
graph on ORT-CPU (simulated(cpu-qdq)) and its context on the x86 HTP emulator (emulated(x86-HTP)). Prints
conditional acceptance per depth of each, and how many chains the cpu-qdq and emulated phones drew equal.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def _wire_h(model, ids: list[int], scale: np.ndarray) -> np.ndarray:
    """The trunk's h rows of ``ids`` (before the final norm) through the hand-off's int8."""
    from hyco_lab.fixtures.check_mimo import hidden
    from vllm_hyco.handoff.quant import dequantize, quantize

    return dequantize(quantize(hidden(model, ids), scale), scale).astype(np.float32)


def calib(family: Path, out: Path, n: int = 14, seed: int = 0) -> None:
    from tokenizers import Tokenizer

    from hyco_lab.fixtures.check_mimo import load_torch
    from hyco_lab.fixtures.kinds import build_samples
    from vllm_hyco.handoff.quant import load_scales

    model = load_torch(family / "verifier")
    tok = Tokenizer.from_file(str(family / "verifier" / "tokenizer.json"))
    scale = load_scales(family / "handoff_scales.npz").h
    samples, rng, arrays, j = build_samples("train"), np.random.default_rng(seed), {}, 0
    for i in range(n):
        t, ids = int(rng.integers(64, 1400)), []
        while len(ids) < t + 1:
            ids += tok.encode(samples[j % len(samples)]).ids
            j += 1
        arrays[f"h_{i}"], arrays[f"tokens_{i}"] = _wire_h(model, ids[:t], scale), np.asarray(ids[: t + 1])
    np.savez(out, **arrays)
    print(f"{n} streams, {sum(len(v) for k, v in arrays.items() if k.startswith('h_'))} rows -> {out}")


def evaluate(family: Path, build: Path, prompts: int, tokens: int) -> dict:
    from hyco_lab.fixtures.check_mimo import chain_acceptance, greedy_continuation, load_torch
    from hyco_lab.fixtures.kinds import eval_prompts
    from hyco_lab.fixtures.report import _prompt_ids
    from mobile_client.drafters.own_mtp import OwnMtpDrafter
    from mobile_client.export import qnn
    from mobile_client.export.build import MTP_WINDOW
    from vllm_hyco.handoff.quant import load_scales

    model = load_torch(family / "verifier")
    cfg, sd = model.cfg, model.state_dict()
    scale = load_scales(family / "handoff_scales.npz").h
    keep = [int(i) for i in np.load(build / "keep_ids.npy")]
    cpu, htp = qnn.cpu_session(build / "own_mtp.qdq.onnx"), qnn.htp_session(build / "own_mtp_ctx.onnx")
    steps = {"float": None, "cpu_qdq": lambda f: qnn.run(cpu, f), "emulator": lambda f: qnn.run(htp, f)}
    reached = {name: np.zeros(4) for name in steps}
    accepted = {name: np.zeros(4) for name in steps}
    chains: dict[str, list] = {name: [] for name in steps}
    for ids in _prompt_ids(family / "verifier", eval_prompts(max(prompts, 60))[:prompts]):
        seq = greedy_continuation(model, ids, tokens + 4)
        hr = _wire_h(model, seq, scale)
        for name, step in steps.items():
            phone = OwnMtpDrafter(cfg, sd, keep, window=MTP_WINDOW, step=step)
            r, a, c = chain_acceptance(phone, hr, seq, len(ids), tokens)
            reached[name] += r
            accepted[name] += a
            chains[name] += c
    out: dict = {name: {"reached": reached[name].tolist(), "accepted": accepted[name].tolist(),
                        "conditional": (accepted[name] / np.maximum(reached[name], 1)).round(4).tolist(),
                        "accepted_per_chain": round(float(accepted[name].sum() / reached[name][0]), 4)}
                 for name in steps}
    out["chains"] = len(chains["float"])
    out["equal_chains"] = {f"{a}={b}": sum(x == y for x, y in zip(chains[a], chains[b]))
                           for a, b in (("cpu_qdq", "emulator"), ("float", "cpu_qdq"))}
    out["calibration"] = json.loads((build / "manifest.json").read_text()).get("own_mtp_calibration")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("calib", "eval"))
    p.add_argument("family", type=Path)
    p.add_argument("path", type=Path, help="calib: the .npz to write; eval: the build folder")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.what == "calib":
        calib(args.family, args.path)
        return 0
    out = {**evaluate(args.family, args.path, args.prompts, args.tokens), "command": " ".join(sys.argv)}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
