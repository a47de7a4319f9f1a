"""``hyco-phone``: run a HyCo phone on this machine against a ``vllm_hyco`` server and stream the answer.

    hyco-phone --server http://127.0.0.1:8000 --model-dir BUNDLE --prompt "In the beginning" \\
               --max-tokens 64 --temperature 0

prints the text as it commits (stdout) and one line of statistics per round plus a summary (stderr).

The model bundle (``--model-dir``) is what a phone app ships (docs/phone-loop.md)::

    verifier/config.json          the server model's HF config: hand-off layers and the model fingerprint
    verifier/model.safetensors    torch backend only: its embed_tokens feed the MTP Drafter's 8-bit table
    assistant/                    the Gemma-4 assistant (MTP head), HF folder; none for MiMo, whose MTP
                                  layer ships in verifier/ (the phone runs it and keeps its own KV)
    slm/                          the SLM Drafter, HF folder
    handoff_scales.npz            the model's fixed hand-off scales (without it: SLM-only trees)
    keep_ids.npy                  optional keep set (default: the whole vocabulary)
    tokenizer/                    optional (else verifier/): only for --prompt / --messages-json

``--backend compiled`` runs the steps built by ``python -m mobile_client.export.build`` (``--build-dir``,
default BUNDLE/build: ``mtp_ctx.onnx`` or, for MiMo, ``own_mtp_ctx.onnx``, ``slm_ctx.onnx``,
``mtp_embed_lut.npz``, ``keep_ids.npy``) on QNN's
HTP backend (the x86 HTP emulator here, the NPU on a phone); a step without a compiled model runs in torch,
and the console says so. ``--prompt-ids`` sends a completions request with token ids (no tokenizer).
``--slm-passes 2`` drafts HyCo-2P trees (a second SLM pass; torch SLM step only: the compiled SLM graph is
a static 32-row one-pass step, and hyco-phone refuses the combination). ``--draft-sampling probabilistic``
with ``--temperature`` > 0 draws the MTP chain from the head's distribution (docs/phone-loop.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from mobile_client.bundle import MTP_WINDOW, load_bundle
from mobile_client.client import HycoClient, Timeouts
from mobile_client.mode_rule import DEFAULT_FLOOR_TPS, ModeRule, ModeRuleConfig, PhoneOnly, ServerOnly
from mobile_client.session import PhoneSession, SessionOptions, fmt_round
from mobile_client.session_options import DRAFT_SAMPLING, OPENINGS, TREE_ORDERS
from vllm_hyco.errors import ConfigError, HycoError
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET


def build_request(args, tokenizer_dir: Path | None) -> tuple[str, dict, list[int]]:
    """(endpoint, OpenAI body, prompt ids as the server tokenizes them)."""
    body: dict = {"max_tokens": args.max_tokens, "stream": True}
    if args.model_name:
        body["model"] = args.model_name
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.seed is not None:
        body["seed"] = args.seed
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
    ap.add_argument("--seed", type=int, help="the request's seed (also seeds sampled drafts)")
    ap.add_argument("--draft-sampling", choices=DRAFT_SAMPLING, default="greedy",
                    help="probabilistic: with --temperature > 0, draw the MTP chain from the head's "
                         "distribution and send it with the tree (lossless); greedy: its argmax")
    ap.add_argument("--mode", choices=("exact", "epsilon"), default="exact")
    ap.add_argument("--opening", choices=OPENINGS, default="slm",
                    help="round 0: the SLM's tree, or the root alone (round 1 then drafts the MTP chain from the "
                         "prompt, as vLLM's first MTP step; docs/phone-loop.md)")
    ap.add_argument("--order", choices=TREE_ORDERS, default="auto",
                    help="the tree's row order (auto: the MTP chain first in exact mode, learned in epsilon mode)")
    ap.add_argument("--epsilon", type=float, help="with --mode epsilon: a stricter ε than the operator's")
    ap.add_argument("--node-budget", "--max-nodes", type=int, default=DEFAULT_NODE_BUDGET, dest="node_budget",
                    help="the largest tree this phone builds (drafted nodes, root excluded; the server grants "
                         "at most this many per round; --max-nodes is its former name)")
    ap.add_argument("--slm-passes", type=int, choices=(1, 2), default=1,
                    help="SLM passes per tree: 1 = HyCo, 2 = HyCo-2P (a second pass under the first "
                         "pass's new nodes; torch SLM step only)")
    ap.add_argument("--window", type=int, default=MTP_WINDOW, help="MTP/SLM ring columns (paper: 1,024)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one frame")
    ap.add_argument("--retries", type=int, default=8, help="reconnects in a row without progress")
    ap.add_argument("--failovers", type=int, default=2,
                    help="times a session may be reopened on another replica when the server lost it "
                         "(prompt + committed tokens; 0: never)")
    ap.add_argument("--drafting", choices=("phone", "server", "auto"), default="phone",
                    help="who drafts: the phone (HyCo), the server's own MTP head (server mode: no round trip per "
                         "round), or auto: the rule of docs/phone-loop.md (phone while it keeps --floor-tps)")
    ap.add_argument("--floor-tps", type=float, default=DEFAULT_FLOOR_TPS,
                    help="auto: the tokens per second phone drafting must keep (default: a reading speed)")
    ap.add_argument("--power-low", action="store_true", help="auto: the phone is hot or low on battery")
    ap.add_argument("--json-out", type=Path,
                    help="write the summary, the committed token ids and the round statistics as JSON")
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
    opts = SessionOptions(mode=args.mode, epsilon=args.epsilon, node_budget=args.node_budget,
                          keep_set_hash=bundle.keep_set_hash, draft_sampling=args.draft_sampling,
                          opening=args.opening, order=args.order)

    def on_text(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    session = PhoneSession(bundle.drafter, prompt_tokens=ids, request=request, endpoint=endpoint,
                           spec=bundle.spec, options=opts, on_text=on_text)
    policy = {"phone": PhoneOnly, "server": ServerOnly}.get(args.drafting)
    policy = policy() if policy is not None else ModeRule(ModeRuleConfig(floor_tps=args.floor_tps),
                                                           power_ok=lambda: not args.power_low)
    client = HycoClient(args.server, args.api_key, timeouts=Timeouts(frame_s=args.timeout),
                        max_retries=args.retries, max_failovers=args.failovers, mode_policy=policy)
    on_round = None if args.quiet else (lambda s: print(f"\n{fmt_round(s)}", file=sys.stderr))
    result = await client.run(session, on_round=on_round)
    summary = result.summary()
    if result.final is not None:
        summary["server"] = {"rounds": result.final.rounds, "mat": result.final.mat,
                             "server_tokens": result.final.server_tokens,
                             "bytes_up": result.final.bytes_up, "bytes_down": result.final.bytes_down}
    print(f"\nhyco-phone: {json.dumps(summary)}", file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(json.dumps({"summary": summary, "token_ids": list(result.token_ids),
                                             "rounds": [vars(r) for r in result.rounds]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
