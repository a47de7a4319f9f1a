"""The one build command for a phone app: ``python -m mobile_client.export.build OUT [--full]``.

Writes under OUT: for each drafter step (``mtp`` or ``own_mtp``, ``slm``) the float ONNX, the QDQ ONNX, its
encodings JSON, the compiled QNN context model (``*_ctx.onnx`` + ``*_ctx_qnn.bin``, SM8850 / HTP v81, CPU fallback
disabled), golden input/output vectors (``*_golden.npz``: inputs, ORT-CPU QDQ outputs and HTP-emulator
outputs), ``keep_ids.npy``, the MTP Drafter's 8-bit embedding table, a copy of docs/protocol.md when the
repo has one, and ``manifest.json`` (versions, shapes, ladder numbers, sha256 of every file).

Without a checkpoint directory the drafters are the random-weight toy twins (same graphs as production,
tiny widths, production windows and row counts). ``--mtp-dir``/``--slm-dir`` take Hugging Face folders
(``config.json`` + ``model.safetensors``; e.g. the trained fixtures). ``--full`` exports full-size
random-weight graphs instead and compiles them only (no emulation; slow, never in CI).

A verifier whose hand-off carries h rows (MiMo: its MTP layer owns its KV; ``--target-dir`` or ``--fixtures``
with ``verifier/`` and ``slm/``, no ``assistant/``) gets the ``own_mtp`` step instead of ``mtp``: the one-row
static step of its first MTP layer (``build_own_mtp``; no embedding table: the layer reads float e rows).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from mobile_client.drafters.mtp import MTP_INPUTS, MTP_OUTPUTS, EmbedLut, MtpHead
from mobile_client.drafters.own_mtp import STEP_INPUTS, STEP_OUTPUTS, OwnMtpDrafter
from mobile_client.drafters.spec import MtpSpec, SlmSpec, full_mtp_spec, random_mtp_state_dict, toy_mtp_spec
from mobile_client.export import qnn
from mobile_client.export.calib import load_streams, mtp_feeds, own_mtp_feeds
from mobile_client.export.pipeline import StepArtifacts, build_step, fake_quant_copy, sha256, write_golden

ROOT = Path(__file__).resolve().parents[4]
MTP_WINDOW = 1024


def load_hf_dir(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return cfg, sd


def build_mtp(
    out: Path,
    spec: MtpSpec,
    sd: dict,
    keep_ids: list[int],
    target_embed: torch.Tensor,
    compile: bool = True,
    emulate: bool = True,
    n_calib: int = 12,
    n_golden: int = 2,
    head: torch.nn.Module | None = None,
    feeds: list[dict] | None = None,
) -> tuple[StepArtifacts, dict]:
    """MTP step: float head -> W4/A16 copy (or the given QAT ``head``) -> ONNX/QDQ/context + ladder.

    ``feeds`` (calibration then golden, e.g. verifier captures) default to synthetic hand-offs."""
    float_head = MtpHead.from_hf_state_dict(spec, sd, keep_ids)
    lut = EmbedLut.from_embedding(target_embed, keep_ids)
    if feeds is None:
        feeds = mtp_feeds(spec, float_head, lut, keep_ids, MTP_WINDOW, n_calib + n_golden, seed=1)
    qhead = fake_quant_copy(head if head is not None else float_head, feeds[:n_calib], MTP_INPUTS)
    art = build_step("mtp", qhead, out, MTP_INPUTS, MTP_OUTPUTS, feeds[:n_calib], compile=compile)
    np.savez(out / "mtp_embed_lut.npz", table=lut.table, scale=lut.scale)
    ladder = write_golden(
        out / "mtp_golden.npz", float_head, qhead, art, feeds[n_calib:], MTP_INPUTS, emulate and compile
    )
    return art, ladder


def build_own_mtp(
    out: Path,
    cfg: dict,
    sd: dict,
    keep_ids: list[int],
    compile: bool = True,
    emulate: bool = True,
    n_calib: int = 12,
    n_golden: int = 2,
    window: int = MTP_WINDOW,
    feeds: list[dict] | None = None,
) -> tuple[StepArtifacts, dict]:
    """The MTP layer with its own KV (MiMo, ``drafters.own_mtp``): its one-row static step (``OwnMtpStep``:
    the ring in, the row's K/V out) -> W4/A16 copy -> ONNX/QDQ/context + ladder on the logits.

    ``cfg``/``sd`` are the verifier folder's config and weights (``model.mtp_layers.0.*``, embedding,
    ``lm_head``). ``feeds`` (calibration then golden) default to steps recorded from the float drafter over
    random hand-offs and chains (``calib.own_mtp_feeds``)."""
    drafter = OwnMtpDrafter(cfg, sd, keep_ids, window=window)
    float_step = drafter.static_step()
    if feeds is None:
        feeds = own_mtp_feeds(drafter, n_calib + n_golden, seed=1)
    qstep = fake_quant_copy(float_step, feeds[:n_calib], STEP_INPUTS)
    art = build_step("own_mtp", qstep, out, STEP_INPUTS, STEP_OUTPUTS, feeds[:n_calib], compile=compile)
    ladder = write_golden(out / "own_mtp_golden.npz", float_step, qstep, art, feeds[n_calib:], STEP_INPUTS,
                          emulate and compile, output=STEP_OUTPUTS.index("logits"))
    return art, ladder


def build_slm(
    out: Path, spec: SlmSpec, sd: dict, keep_ids: list[int], compile: bool = True, emulate: bool = True
) -> tuple[StepArtifacts, dict] | None:
    """SLM 32-row step (see ``mobile_client.drafters.slm``); None when that module is unavailable."""
    try:
        from mobile_client.export.slm_build import build_slm_step
    except ImportError:
        return None
    return build_slm_step(out, spec, sd, keep_ids, compile=compile, emulate=emulate)


def manifest(
    out: Path, steps: dict[str, tuple[StepArtifacts, dict]], keep_ids: list[int], extra: dict
) -> dict:
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "manifest.json")
    info = {
        "format": "hyco-phone-build/1",
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": {
            "soc": "SM8850",
            "soc_model": qnn.SOC_MODEL,
            "htp_arch": qnn.HTP_ARCH,
            "cpu_fallback": "disabled",
        },
        "versions": {
            **qnn.versions(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "onnx": __import__("onnx").__version__,
        },
        "keep_set": {
            "size": len(keep_ids),
            "sha256": _keep_hash(keep_ids, extra.get("vocab_size")),
            "hash_rule": "mobile_client.keepset.KeepSet.hash (sent at session start)",
        },
        "labels": {
            "float": "simulated(torch fp32)",
            "fake_quant": "simulated(fake-quant)",
            "ort_cpu_qdq": "simulated(cpu-qdq)",
            "htp_emulator": "emulated(x86-HTP)",
        },
        "steps": {
            name: {
                "inputs": art.input_shapes,
                "ops": art.ops,
                "compile": art.compile,
                "ladder": lad,
                "encodings_sha256": sha256(art.float_onnx.with_suffix(".encodings.json")),
            }
            for name, (art, lad) in steps.items()
        },
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files},
        **extra,
    }
    (out / "manifest.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    return info


def _keep_hash(keep_ids: list[int], vocab_size: int | None) -> str:
    from mobile_client.keepset import KeepSet

    return KeepSet.from_ids(keep_ids, vocab_size or (max(keep_ids) + 1)).hash


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mobile_client.export.build", description=__doc__.split("\n")[0]
    )
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--fixtures", type=Path, help="a fixtures root or bundle (assistant/ unless MiMo, verifier/, slm/ inside)"
    )
    ap.add_argument(
        "--mtp-dir",
        type=Path,
        help="HF gemma4_assistant folder (default: random toy twin; refused with a MiMo verifier)",
    )
    ap.add_argument(
        "--target-dir",
        type=Path,
        help="HF verifier folder (its embed_tokens feed the 8-bit LUT; a MiMo verifier's own MTP layer is built)",
    )
    ap.add_argument("--slm-dir", type=Path, help="HF Gemma-4 text folder for the SLM Drafter")
    ap.add_argument("--no-slm", action="store_true", help="build no SLM step (only the MTP step)")
    ap.add_argument("--keep-ids", type=Path, help=".npy/.json list of kept token ids (default: every id)")
    ap.add_argument(
        "--handoff-scales",
        type=Path,
        help="MiMo: the hand-off's scales file, whose h scales shape the calibration rows (default: next to verifier/)",
    )
    ap.add_argument(
        "--calib-streams",
        type=Path,
        help="MiMo: .npz of captured hand-offs (h_<i> [T, hidden] h rows, tokens_<i> [T + 1] ids) to calibrate on",
    )
    ap.add_argument("--full", action="store_true", help="full-size random graphs, compile only (slow)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    mtp_dir_given = args.mtp_dir is not None
    if args.fixtures:
        args.mtp_dir = args.mtp_dir or args.fixtures / "assistant"
        args.target_dir = args.target_dir or args.fixtures / "verifier"
        args.slm_dir = args.slm_dir or args.fixtures / "slm"
    torch.manual_seed(args.seed)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    compile = not args.no_compile
    emulate = compile and not args.full

    if args.target_dir and own_kv_mtp(args.target_dir):
        if mtp_dir_given:
            from vllm_hyco.errors import ConfigError

            raise ConfigError(f"--mtp-dir {args.mtp_dir}: {args.target_dir} is a MiMo verifier, whose phone step is "
                              "its own MTP layer (built from --target-dir); leave --mtp-dir out")
        steps, keep, extra = _own_mtp_steps(args, out, compile, emulate)
    else:
        steps, keep, extra = _mtp_steps(args, out, compile, emulate)
    slm = None if args.no_slm else _maybe_slm(args, out, keep, compile, emulate)
    if slm is not None:
        steps["slm"] = slm
    np.save(out / "keep_ids.npy", np.asarray(keep, dtype=np.int32))
    proto = ROOT / "docs" / "protocol.md"
    if proto.exists():
        shutil.copy(proto, out / "protocol.md")
    info = manifest(out, steps, keep, {**extra, "full_size": args.full})
    print(json.dumps({k: v["compile"] for k, v in info["steps"].items()}, indent=1))
    return 0


def _mtp_steps(args, out: Path, compile: bool, emulate: bool) -> tuple[dict, list[int], dict]:
    """The Gemma-4 assistant head's step (``mtp``): ({name: (artifacts, ladder)}, keep ids, manifest extras)."""
    if args.mtp_dir:
        cfg, msd = load_hf_dir(args.mtp_dir)
        mspec = MtpSpec.from_hf_config(cfg)
        msd = {k: v.float() for k, v in msd.items()}
    else:
        mspec = full_mtp_spec() if args.full else toy_mtp_spec(sliding_window=MTP_WINDOW // 2)
        msd = random_mtp_state_dict(mspec, seed=args.seed)
    keep = _load_keep(args.keep_ids, mspec.vocab)
    if args.full and not args.keep_ids:
        keep = keep[:86_089]  # the paper's keep-set size (ids are placeholders without a corpus)
    if args.target_dir:
        _, tsd = load_hf_dir(args.target_dir)
        embed = next(v for k, v in tsd.items() if k.endswith("embed_tokens.weight")).float()
    else:
        embed = torch.randn(mspec.vocab, mspec.backbone, generator=torch.Generator().manual_seed(args.seed))
    feeds = _captured_feeds(args.target_dir, mspec, keep, 14) if args.target_dir and not args.full else None
    step = build_mtp(
        out,
        mspec,
        msd,
        keep,
        embed,
        compile=compile,
        emulate=emulate,
        n_calib=4 if args.full else 12,
        n_golden=0 if args.full else 2,
        feeds=feeds,
    )
    weights = "random" if not args.mtp_dir else str(args.mtp_dir)
    return {"mtp": step}, keep, {"weights": weights, "vocab_size": mspec.vocab}


def own_kv_mtp(verifier_dir: Path) -> bool:
    """Whether the verifier folder's hand-off carries h rows (a ``hidden`` layer: an MTP layer with its own KV,
    MiMo), so its phone step is the own-KV MTP layer's (``build_own_mtp``), not the assistant head's."""
    from vllm_hyco.errors import ConfigError
    from vllm_hyco.handoff.sizes import layers_from_hf_config
    from vllm_hyco.models import HIDDEN

    try:
        _, layers = layers_from_hf_config(json.loads((verifier_dir / "config.json").read_text()))
    except (ConfigError, OSError):
        return False
    return any(layer.kind == HIDDEN for layer in layers)


def _own_mtp_steps(args, out: Path, compile: bool, emulate: bool) -> tuple[dict, list[int], dict]:
    """A MiMo bundle: the verifier's own MTP layer (``own_mtp``), calibrated on ``--calib-streams`` (captured
    hand-offs) when given, else on synthetic hand-off rows shaped by the hand-off's h scales when a scales file
    is found, else on standard normal rows."""
    cfg, sd = load_hf_dir(args.target_dir)
    sd = {k: v.float() for k, v in sd.items()}
    vocab = int(cfg["vocab_size"])
    keep = _load_keep(args.keep_ids, vocab)
    scales = args.handoff_scales or args.target_dir.parent / "handoff_scales.npz"
    drafter = OwnMtpDrafter(cfg, sd, keep, window=MTP_WINDOW)
    streams, rows = None, "standard normal h rows (no hand-off scales file)"
    if args.calib_streams:
        streams = load_streams(args.calib_streams, int(cfg["hidden_size"]), drafter.k)
        rows = f"captured hand-offs {args.calib_streams.name} ({len(streams)} requests)"
    elif scales.exists():
        from vllm_hyco.handoff.quant import load_scales

        streams = _scaled_h_streams(load_scales(scales).h, vocab, 14, seed=args.seed)
        rows = f"h rows drawn with the per-channel h scales of {scales.name}, on the int8 grid"
    feeds = own_mtp_feeds(drafter, 14, seed=args.seed + 1, streams=streams)  # --seed 0: seed 1, as documented
    step = build_own_mtp(out, cfg, sd, keep, compile=compile, emulate=emulate, feeds=feeds)
    return {"own_mtp": step}, keep, {"weights": str(args.target_dir), "vocab_size": vocab, "own_mtp_calibration": rows}


def _scaled_h_streams(h_scale: np.ndarray, vocab: int, n: int, seed: int) -> list[tuple[np.ndarray, list[int]]]:
    """``n`` (h rows, tokens) requests of 8 .. 1.5 W + 6 rows (a length drawn in 2 .. 1.5 W, plus 6: every
    stream then holds more than the k + 2 = 6 rows ``own_mtp_feeds`` needs at K = 4; kept so the documented
    builds reproduce): per channel c, h ~ N(0, (127 s_c / 4)^2) (the scales are the 99.99th percentile of
    |h| / 127) rounded to the hand-off's int8 grid; random tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(2, int(1.5 * MTP_WINDOW) + 1)) + 6
        q = np.clip(np.round(rng.standard_normal((t, len(h_scale))) * (127 / 4)), -127, 127)
        out.append(((q * h_scale).astype(np.float32), rng.integers(0, vocab, t + 1).tolist()))
    return out


def _maybe_slm(args, out: Path, keep: list[int], compile: bool, emulate: bool):
    try:
        from mobile_client.drafters.spec import e2b_slm_spec, random_slm_state_dict, toy_slm_spec
    except ImportError:
        return None
    if args.slm_dir:
        cfg, ssd = load_hf_dir(args.slm_dir)
        sspec = SlmSpec.from_hf_config(cfg)
    else:
        sspec = e2b_slm_spec(num_layers=35) if args.full else toy_slm_spec(vocab=max(keep) + 1)
        ssd = random_slm_state_dict(sspec, seed=args.seed + 1)
    skeep = [k for k in keep if k < sspec.vocab]
    return build_slm(out, sspec, ssd, skeep, compile=compile, emulate=emulate)


def _captured_feeds(target_dir: Path, spec: MtpSpec, keep: list[int], n: int) -> list[dict]:
    """MTP step inputs captured from the verifier (transformers, fp32) on random token sequences."""
    from transformers import AutoModelForCausalLM

    from mobile_client.quant.capture import capture_feeds

    verifier = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, spec.vocab, (MTP_WINDOW + 200,), generator=g).tolist() for _ in range(2)]
    feeds = capture_feeds(spec, verifier, seqs, keep, MTP_WINDOW, every=(MTP_WINDOW + 200) // (n // 2))
    return feeds[:n]


def _load_keep(path: Path | None, vocab: int) -> list[int]:
    if path is None:
        return list(range(vocab))
    ids = np.load(path) if path.suffix == ".npy" else np.asarray(json.loads(path.read_text()))
    return sorted(int(i) for i in ids)


if __name__ == "__main__":
    sys.exit(main())
