"""``hyco-phone``: run a HyCo phone on this machine against a ``vllm_hyco`` server and stream the answer.

    hyco-phone --server http://127.0.0.1:8000 --model-dir BUNDLE --prompt "In the beginning" \\
               --max-tokens 64 --temperature 0

prints the text as it commits (stdout) and one line of statistics per round plus a summary (stderr).

The model bundle (``--model-dir``) is what a phone app ships (docs/phone-loop.md)::

    verifier/config.json          the server model's HF config: hand-off layers and the model fingerprint
    verifier/model.safetensors    torch backend only: its embed_tokens feed the MTP Drafter's 8-bit table
    assistant/                    the Gemma-4 assistant (MTP head), HF folder
    slm/                          the SLM Drafter, HF folder
    handoff_scales.npz            the model's fixed hand-off scales (without it: SLM-only trees)
    keep_ids.npy                  optional keep set (default: the whole vocabulary)
    tokenizer/                    optional (else verifier/): only for --prompt / --messages-json

``--backend compiled`` runs the steps built by ``python -m mobile_client.export.build`` (``--build-dir``,
default BUNDLE/build: ``mtp_ctx.onnx``, ``slm_ctx.onnx``, ``mtp_embed_lut.npz``, ``keep_ids.npy``) on QNN's
HTP backend (the x86 HTP emulator here, the NPU on a phone); a step without a compiled model runs in torch,
and the console says so. ``--prompt-ids`` sends a completions request with token ids (no tokenizer).
``--slm-passes 2`` drafts HyCo-2P trees (a second SLM pass; torch SLM step only: the compiled SLM graph is
a static 32-row one-pass step, and hyco-phone refuses the combination).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mobile_client.client import HycoClient, Timeouts
from mobile_client.session import HycoPhoneDrafter, PhoneSession, SessionOptions, fmt_round
from vllm_hyco.errors import ConfigError, HycoError
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET

MTP_WINDOW = 1024  # the paper's W: columns of the MTP ring and of the SLM's full-attention ring


@dataclass
class PhoneBundle:
    drafter: HycoPhoneDrafter
    spec: Any  # HandoffSpec, or None without a scales file
    notes: list[str]
    keep_set_hash: bytes | None = None  # sha256 of the drafters' keep set, sent in ``start``


def _hf_dir(path: Path) -> tuple[dict, dict]:
    from mobile_client.export.build import load_hf_dir

    if not (path / "config.json").exists():
        raise ConfigError(f"{path} is not a Hugging Face model folder (no config.json)")
    return load_hf_dir(path)


def _keep_ids(model_dir: Path, vocab: int, build_dir: Path | None) -> list[int]:
    for d in (build_dir, model_dir):
        if d is not None and (d / "keep_ids.npy").exists():
            return [int(i) for i in np.load(d / "keep_ids.npy")]
    return list(range(vocab))


def _handoff_spec(model_dir: Path):
    from vllm_hyco.handoff.quant import load_scales
    from vllm_hyco.handoff.schema import HandoffSpec
    from vllm_hyco.handoff.sizes import layers_from_hf_config

    path = model_dir / "handoff_scales.npz"
    if not path.exists():
        return None, None
    cfg = json.loads((model_dir / "verifier" / "config.json").read_text())
    _, layers = layers_from_hf_config(cfg)
    scales = load_scales(path)
    return HandoffSpec.from_scales(cfg, layers, scales), scales


def load_bundle(model_dir: Path, backend: str = "torch", build_dir: Path | None = None,
                window: int = MTP_WINDOW, slm_passes: int = 1) -> PhoneBundle:
    """The phone's drafters from a model bundle: MTP head + SLM (HyCo), or SLM only without scales.

    ``slm_passes=2`` is HyCo-2P (Algorithm 3 line 15): a second SLM pass under the nodes the first pass
    added, through ``MultiPassSlm`` (the second pass's rows and their ancestors in one forward, up to 96
    rows). The compiled SLM step is a static 32-row graph, so HyCo-2P needs the torch SLM step."""
    from mobile_client.drafters.base import HybridDrafter
    from mobile_client.drafters.multipass import ROWS, MultiPassSlm
    from mobile_client.drafters.slm import SlmDrafter
    from mobile_client.drafters.spec import SlmSpec
    from mobile_client.keepset import KeepSet

    if slm_passes not in (1, 2):
        raise ConfigError(f"--slm-passes must be 1 (HyCo) or 2 (HyCo-2P), got {slm_passes}")
    notes: list[str] = []
    build_dir = build_dir or model_dir / "build"
    scfg, ssd = _hf_dir(model_dir / "slm")
    sspec = SlmSpec.from_hf_config(scfg)
    keep = _keep_ids(model_dir, sspec.vocab, build_dir if backend == "compiled" else None)
    slm_ctx = build_dir / "slm_ctx.onnx"
    if slm_passes == 2 and backend == "compiled" and slm_ctx.exists():
        raise ConfigError(
            f"--slm-passes 2 (HyCo-2P) runs the second pass's rows together with their first-pass "
            f"ancestors (up to {ROWS} rows per forward); the compiled SLM step {slm_ctx} is a static "
            f"32-row graph. Use --backend torch with --slm-passes 2, or --slm-passes 1 with --backend "
            f"compiled")
    slm_step = _compiled_step(slm_ctx, notes, "SLM") if backend == "compiled" else None
    slm = SlmDrafter(sspec, ssd, keep, window=window, step=slm_step)
    rows = MultiPassSlm(slm) if slm_passes == 2 else slm
    if slm_passes == 2:
        notes.append("HyCo-2P: two SLM passes per tree (torch SLM step)")
    spec, scales = _handoff_spec(model_dir)
    mtp = None
    if scales is None:
        notes.append(f"no {model_dir / 'handoff_scales.npz'}: SLM-only trees (no MTP chain)")
    else:
        mtp = _mtp_drafter(model_dir, keep, backend, build_dir, window, notes)
    drafter = HycoPhoneDrafter(HybridDrafter(mtp, rows, two_pass=slm_passes == 2), slm=slm, mtp=mtp,
                               scales=scales)
    return PhoneBundle(drafter, spec, notes, KeepSet.from_ids(keep, sspec.vocab).hash_bytes)


def _mtp_drafter(model_dir: Path, keep: list[int], backend: str, build_dir: Path, window: int, notes):
    import torch

    from mobile_client.drafters.mtp import EmbedLut, MtpDrafter, MtpHead, torch_step
    from mobile_client.drafters.spec import MtpSpec

    acfg, asd = _hf_dir(model_dir / "assistant")
    mspec = MtpSpec.from_hf_config(acfg)
    step = _compiled_step(build_dir / "mtp_ctx.onnx", notes, "MTP") if backend == "compiled" else None
    lut_file = build_dir / "mtp_embed_lut.npz"
    if backend == "compiled" and lut_file.exists():
        z = np.load(lut_file)
        lut = EmbedLut(z["table"], z["scale"])
    else:
        _, vsd = _hf_dir(model_dir / "verifier")
        embed = vsd.get("model.embed_tokens.weight", vsd.get("model.language_model.embed_tokens.weight"))
        if embed is None:
            raise ConfigError(f"{model_dir / 'verifier'} has no embed_tokens weight for the MTP table")
        lut = EmbedLut.from_embedding(embed.to(torch.float32), keep)
    if step is None:
        step = torch_step(MtpHead.from_hf_state_dict(mspec, asd, keep))
    return MtpDrafter(mspec, keep, lut, step, window=window)


def _compiled_step(ctx: Path, notes: list[str], name: str):
    if not ctx.exists():
        notes.append(f"{name} step: no compiled model at {ctx}; running it in torch")
        return None
    from mobile_client.export import qnn

    session = qnn.htp_session(ctx)
    notes.append(f"{name} step: QNN HTP context {ctx.name} (on x86 the HTP emulator: numerics, not timing)")

    def run(feeds):
        out = qnn.run(session, feeds)
        return tuple(out) if name == "MTP" else out

    return run


def build_request(args, tokenizer_dir: Path | None) -> tuple[str, dict, list[int]]:
    """(endpoint, OpenAI body, prompt ids as the server tokenizes them)."""
    body: dict = {"max_tokens": args.max_tokens, "stream": True}
    if args.model_name:
        body["model"] = args.model_name
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.prompt_ids:
        ids = [int(t) for t in args.prompt_ids.split(",")]
        return "completions", {**body, "prompt": ids}, ids
    tok = _tokenizer(tokenizer_dir)
    if args.messages_json:
        messages = json.loads(Path(args.messages_json).read_text() if Path(args.messages_json).exists()
                              else args.messages_json)
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]  # vLLM's chat path: the template adds <bos>
        return "chat.completions", {**body, "messages": messages}, ids
    ids = tok(args.prompt)["input_ids"]
    return "completions", {**body, "prompt": args.prompt}, ids


def _tokenizer(path: Path | None):
    if path is None:
        raise ConfigError("a text prompt needs a tokenizer: pass --model-dir with tokenizer/ or verifier/")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="hyco-phone", description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="http(s)://host:port of the vllm_hyco server")
    ap.add_argument("--api-key", help="the server's --api-key")
    ap.add_argument("--backend", choices=("torch", "compiled"), default="torch")
    ap.add_argument("--model-dir", type=Path, required=True, help="the phone's model bundle (see --help)")
    ap.add_argument("--build-dir", type=Path, help="compiled drafters (default MODEL_DIR/build)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a completions prompt (text)")
    src.add_argument("--messages-json", help="chat messages: a JSON list, or a file holding one")
    src.add_argument("--prompt-ids", help="a completions prompt as comma-separated token ids")
    ap.add_argument("--model-name", help="the OpenAI `model` field (default: the server's only model)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, help="omit for the server's default; 0 = greedy")
    ap.add_argument("--mode", choices=("exact", "epsilon"), default="exact")
    ap.add_argument("--epsilon", type=float, help="with --mode epsilon: a stricter ε than the operator's")
    ap.add_argument("--max-nodes", type=int, default=DEFAULT_NODE_BUDGET)
    ap.add_argument("--slm-passes", type=int, choices=(1, 2), default=1,
                    help="SLM passes per tree: 1 = HyCo, 2 = HyCo-2P (a second pass under the first "
                         "pass's new nodes; torch SLM step only)")
    ap.add_argument("--window", type=int, default=MTP_WINDOW, help="MTP/SLM ring columns (paper: 1,024)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one frame")
    ap.add_argument("--retries", type=int, default=8, help="reconnects in a row without progress")
    ap.add_argument("--failovers", type=int, default=2,
                    help="times a session may be reopened on another replica when the server lost it "
                         "(prompt + committed tokens; 0: never)")
    ap.add_argument("--json-out", type=Path, help="write the round statistics as JSON")
    ap.add_argument("--quiet", action="store_true", help="no per-round lines")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except HycoError as e:
        print(f"\nhyco-phone: {type(e).__name__} [{e.code}]: {e}", file=sys.stderr)
        return 2


async def _main(args) -> int:
    bundle = load_bundle(args.model_dir, args.backend, args.build_dir, args.window, args.slm_passes)
    for note in bundle.notes:
        print(f"hyco-phone: {note}", file=sys.stderr)
    tok_dir = next((d for d in (args.model_dir / "tokenizer", args.model_dir / "verifier")
                    if (d / "tokenizer.json").exists()), None)
    endpoint, request, ids = build_request(args, tok_dir)
    opts = SessionOptions(mode=args.mode, epsilon=args.epsilon, max_nodes=args.max_nodes,
                          keep_set_hash=bundle.keep_set_hash)

    def on_text(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    session = PhoneSession(bundle.drafter, prompt_tokens=ids, request=request, endpoint=endpoint,
                           spec=bundle.spec, options=opts, on_text=on_text)
    client = HycoClient(args.server, args.api_key, timeouts=Timeouts(frame_s=args.timeout),
                        max_retries=args.retries, max_failovers=args.failovers)
    on_round = None if args.quiet else (lambda s: print(f"\n{fmt_round(s)}", file=sys.stderr))
    result = await client.run(session, on_round=on_round)
    summary = result.summary()
    if result.final is not None:
        summary["server"] = {"rounds": result.final.rounds, "mat": result.final.mat,
                             "bytes_up": result.final.bytes_up, "bytes_down": result.final.bytes_down}
    print(f"\nhyco-phone: {json.dumps(summary)}", file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(json.dumps({"summary": summary, "rounds": [vars(r) for r in result.rounds]},
                                            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
