"""Record real tree batches from the CPU engine, for replay against the Triton kernel on a GPU machine.

Runs the tiny fp32 Gemma-4 fixture of ``tests/integration/test_engine_sessions.py`` on vLLM 0.32's CPU build,
opens a few HyCo sessions whose contexts cross the sliding window and block boundaries, and drives tree
rounds. Every call the CPU attention backend makes to ``tree_attention_dense_ref`` is captured. The calls
are grouped by layer signature (heads, head_dim, window, softcap, scale), and each group becomes one paged
batch case in ``benchmarks/gpu/replay/``, which ``tests/kernels/test_kernels_replay.py`` replays through the
kernel.

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .venv/bin/python benchmarks/gpu/record_engine_cases.py
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "integration")]
for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                   ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")):
    os.environ.setdefault(key, value)


def install_recorder(calls: list[dict]) -> None:
    """Wrap the twin the CPU attention backend calls; keep its bound arguments and its result."""
    import vllm_hyco.vllm_adapter.worker.cpu_attention as cpu_attention

    real = cpu_attention.tree_attention_dense_ref
    sig = inspect.signature(real)

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append({**{k: (v.clone() if hasattr(v, "clone") else v) for k, v in bound.arguments.items()},
                      "out": out.clone()})
        return out

    cpu_attention.tree_attention_dense_ref = recording


def drive_engine(rounds: int, seed: int) -> None:
    from test_engine_sessions import BLOCK, VOCAB, _build_tiny, _reference, _tree
    from vllm import LLM

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    with tempfile.TemporaryDirectory() as tmp:
        path = _build_tiny(Path(tmp))
        llm = LLM(model=path, dtype="float32", max_model_len=512, max_num_seqs=16, enforce_eager=True,
                  distributed_executor_backend="uni", skip_tokenizer_init=True, block_size=BLOCK, seed=0,
                  enable_prefix_caching=False, speculative_config={"method": "hyco"})
        rng = random.Random(seed)
        prompts = [[2] + [rng.randrange(5, VOCAB) for _ in range(n)] for n in (5, 31, 47)]
        refs = _reference(llm, prompts, max_tokens=40)
        hy = HycoEngine(llm)
        handles = [hy.open(prompt_token_ids=p, temperature=0.0, max_tokens=40, ignore_eos=True)
                   for p in prompts]
        done = {h.sid: 0 for h in handles}
        roots = {h.sid: h.root for h in handles}
        for rnd in range(rounds):
            batch = []
            for h, ref in zip(handles, refs):
                shape = rng.choice(["deep", "slm", "sibling"])
                toks, pars, _ = _tree(roots[h.sid], ref[done[h.sid]:], shape, rng)
                batch.append((h.sid, rnd, toks, pars))
            for v in hy.submit_many(batch):
                done[v.sid] += len(v.committed)
                roots[v.sid] = v.bonus
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def write_cases(calls: list[dict], out_dir: Path, per_case: int) -> list[Path]:
    from vllm_hyco.kernels.replay import record_dense_calls

    groups: dict[tuple, list[dict]] = {}
    for c in calls:
        sig = (tuple(c["q"].shape[1:]), tuple(c["k"].shape[1:]), c["sliding_window"], c["softcap"],
               c["scale"], str(c["q"].dtype))
        groups.setdefault(sig, []).append(c)
    paths = []
    for i, (sig, group) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
        picked = group[-per_case:]  # the last calls: longest contexts
        name = f"engine_cpu_{i}_h{sig[0][0]}x{sig[0][1]}_w{sig[2] or 0}.pt"
        note = f"CPU engine (vLLM 0.32 CPU build, tiny fp32 Gemma-4 fixture), layer signature {sig}"
        paths.append(record_dense_calls(out_dir / name, picked, block_size=16, note=note))
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--per-case", type=int, default=4, help="requests packed into each recorded batch")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks/gpu/replay"))
    args = p.parse_args()
    calls: list[dict] = []
    install_recorder(calls)
    drive_engine(args.rounds, args.seed)
    paths = write_cases(calls, Path(args.out_dir), args.per_case)
    print(f"recorded {len(calls)} twin calls -> {len(paths)} cases")
    for path in paths:
        print(f"  {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
