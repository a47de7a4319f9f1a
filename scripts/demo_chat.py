"""Stream one chat completion from a HyCo server with the official ``openai`` client (used by demo.sh).

    python scripts/demo_chat.py --base-url http://127.0.0.1:8011/v1 --model hyco-tiny \\
        [--prompt TEXT] [--temperature 0] [--top-p 1] [--seed 0] [--max-tokens 64]

The defaults are the demo's: the shipped fixture family is a tiny model trained on Genesis 1-25
(docs/fixtures.md); greedy decoding gives its most fluent answer (at T = 1 its answers drift between
verses). The sampling settings are printed before the answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8011/v1")
    parser.add_argument("--model", default="hyco-tiny")
    parser.add_argument("--prompt", default="Tell me a verse from Genesis.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="the request's sampling seed (T > 0)")
    args = parser.parse_args()

    import openai

    root = args.base_url.rsplit("/v1", 1)[0]
    with urllib.request.urlopen(f"{root}/v1/hyco/info", timeout=10) as resp:
        info = json.load(resp)
    print(f"[demo] server: vllm_hyco {info['vllm_hyco']} on vLLM {info['vllm']}, "
          f"HyCo config {info['config']}")
    mode = "greedy" if args.temperature == 0 else f"top-p {args.top_p:g}, seed {args.seed}"
    print(f"[demo] chat sampling: temperature {args.temperature:g} ({mode}), max_tokens {args.max_tokens}")
    client = openai.OpenAI(base_url=args.base_url, api_key="unused-by-the-demo", timeout=120)
    print(f"[demo] user: {args.prompt}\n[demo] model (streaming): ", end="", flush=True)
    start, chunks = time.perf_counter(), 0
    messages = [{"role": "user", "content": args.prompt}]
    seeded = {"seed": args.seed} if args.temperature > 0 else {}
    stream = client.chat.completions.create(model=args.model, stream=True, max_tokens=args.max_tokens,
                                            temperature=args.temperature, top_p=args.top_p, messages=messages,
                                            **seeded)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            print(chunk.choices[0].delta.content, end="", flush=True)
    print(f"\n[demo] {chunks} streamed chunks in {time.perf_counter() - start:.2f} s (CPU-measured)")
    return 0 if chunks else 1


if __name__ == "__main__":
    sys.exit(main())
