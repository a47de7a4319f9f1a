"""Bytes on the wire per round (up: tree frame; down: verdict with its hand-off) and for the seed.

    .venv/bin/python benchmarks/bench_wire_bytes.py [--out FILE.json] [--fixture-config PATH]

Counts are exact (every number is the length of a real encoding, vllm_hyco.handoff.sizes), for Gemma 4
26B-A4B (config inferred from the paper's byte counts, docs/decisions.md) and for the tiny fixture verifier
(its built config.json when one is found under .cache/fixtures, else the FixtureOptions defaults). The
ratio column compares our hand-off to the paper's 44 B + 2H + values-per-position count. Protocol version 2:
the schema (layer list, fingerprint, scales id) travels once per session in the `session` frame.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_hyco.handoff.limits import DEFAULT_LIMITS  # noqa: E402
from vllm_hyco.handoff.sizes import FIXTURE_VERIFIER_CONFIG, size_report  # noqa: E402
from vllm_hyco.models.gemma4 import GEMMA4_26B_A4B_CONFIG  # noqa: E402


def fixture_config(path: str | None) -> tuple[dict, str]:
    if path:
        return json.loads(Path(path).read_text()), path
    found = sorted((ROOT / ".cache" / "fixtures").glob("*/verifier/config.json"))
    if found:
        return json.loads(found[-1].read_text()), str(found[-1].relative_to(ROOT))
    return FIXTURE_VERIFIER_CONFIG, "vllm_hyco.handoff.sizes.FIXTURE_VERIFIER_CONFIG"


def print_report(name: str, r: dict, seed_positions: int) -> None:
    print(
        f"\n== {name}: hidden {r['hidden_size']}, layers "
        + ", ".join(f"{ly['id']}:{ly['kind']} {ly['kv_heads']}x{ly['head_dim']}" for ly in r["layers"])
    )
    print(f"values: {r['values_per_round']} per round (e, h), {r['values_per_position']} per position (K/V)")
    print(
        f"hand-off bytes: {r['handoff_fixed_bytes']} fixed + {r['handoff_bytes_per_position']} per position "
        f"(paper: {r['paper_fixed_bytes']} + {r['values_per_position']}): "
        f"{r['handoff_over_paper_bytes']} B over the paper per round; the session frame (schema, once per "
        f"session) {r['session_frame_bytes']} B"
    )
    t = r["tree_frame_bytes"]
    print(
        "up   (tree frame, labels / no labels / labels and values): "
        + ", ".join(
            f"{n} nodes {t[n]}/{r['tree_frame_bytes_no_labels'][n]}/{r['tree_frame_bytes_values'][n]} B"
            for n in t
        )
    )
    print(
        f"{'accepted':>8} {'positions':>9} {'verdict B':>10} {'hand-off B':>10} {'paper B':>9} "
        f"{'ours/paper':>10}"
    )
    for a, row in r["rounds"].items():
        print(
            f"{a:>8} {a + 1:>9} {row['verdict']:>10} {row['handoff']:>10} {row['paper_handoff']:>9} "
            f"{row['handoff'] / row['paper_handoff']:>10.4f}"
        )
    s = r["seed"]
    print(
        f"seed ({seed_positions} positions): hand-off {s['handoff']} B (paper {s['paper_handoff']} B), "
        f"{s['chunks']} chunk(s) of <= {s['chunk_bytes']} B, largest frame {s['max_frame']} B"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "wire_bytes.json"))
    parser.add_argument(
        "--fixture-config", default=None, help="a verifier config.json to use for the fixture"
    )
    parser.add_argument("--max-accepted", type=int, default=4)
    args = parser.parse_args(argv)
    fix_cfg, fix_src = fixture_config(args.fixture_config)
    fix_w = int(fix_cfg.get("text_config", fix_cfg).get("sliding_window", 128))
    models = {
        "gemma-4-26B-A4B": (GEMMA4_26B_A4B_CONFIG, 1024, "inferred (docs/decisions.md; vllm_hyco/models/gemma4.py)"),
        "fixture-verifier": (fix_cfg, fix_w, fix_src),
    }
    results = {
        "limits": {
            "chunk_bytes": DEFAULT_LIMITS.chunk_bytes,
            "max_server_frame_bytes": DEFAULT_LIMITS.max_server_frame_bytes,
        },
        "models": {},
    }
    for name, (cfg, w, src) in models.items():
        r = size_report(cfg, w, args.max_accepted)
        print_report(f"{name} [{src}]", r, w)
        results["models"][name] = {"config_source": src, "seed_positions": w, **r}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
