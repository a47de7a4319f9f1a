"""Spike (issue 35, step 1): what plain vLLM 0.32 does with a MiMo-shaped model (built-in MTP layers) on CPU.

    python benchmarks/spikes/spike_mimo.py OUT_DIR [--steps a,b_k1,...] [--timeout 600]

Builds the tiny MiMo fixtures (``hyco_lab.fixtures.mimo``) under ``OUT_DIR`` (``mimo1``: one MTP layer;
``mimo2``: two, the same trunk and first MTP layer; ``mimo1_agree``: final norms zeroed, every draft
accepted), then runs each step in its own Python process (``--step NAME``), so a hang or a crash costs one
step: the child builds one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the CPU recipe of
``tests/conftest.py``), does its work, shuts the engine down and writes ``OUT_DIR/steps/NAME.json``. The
parent prints a table and writes ``OUT_DIR/spike_mimo.json``.

Steps:

    a          plain greedy (and seeded sampled) generation, no speculation: the reference
    b_k1       {"method": "mtp", "num_speculative_tokens": 1}: greedy == a? spec counters; sampled
               (T 1, top-k 64, top-p 0.95, seed) runs? The drafter's structure (attention layers, KV groups)
    b_k2       the same, K = 2 with one MTP layer (vLLM runs the one layer twice)
    b_k2_l2    K = 2 on the two-MTP-layer checkpoint (vLLM's multi-module MTP: spec_step_idx 1)
    b_k1_pure  b_k1 with the HyCo plugin off (VLLM_HYCO_DISABLE=1): plain vLLM without our CPU patches
    agree_k2   K = 2 on mimo1_agree: every draft must be accepted (the counters' plumbing)
    d_hyco     {"method": "hyco"} with the plugin active: the refusal, verbatim
    d_hyco_model  {"method": "hyco", "model": DIR, "num_speculative_tokens": 1} (ordinary MTP beside trees)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

from hyco_lab.fixtures.report import PER_POS, SPEC_METRICS, spec_counters

ROOT = Path(__file__).resolve().parents[2]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
LLM_KW = dict(dtype="float32", max_model_len=1024, max_num_seqs=4, enforce_eager=True,
              distributed_executor_backend="uni", seed=0, trust_remote_code=True, disable_log_stats=False)
MAX_TOKENS = 32
SAMPLED = dict(temperature=1.0, top_k=64, top_p=0.95)

# step -> (fixture folder, speculative_config or None, extra env)
STEPS: dict[str, tuple[str, dict | None, dict]] = {
    "a": ("mimo1", None, {}),
    "b_k1": ("mimo1", {"method": "mtp", "num_speculative_tokens": 1}, {}),
    "b_k2": ("mimo1", {"method": "mtp", "num_speculative_tokens": 2}, {}),
    "b_k2_l2": ("mimo2", {"method": "mtp", "num_speculative_tokens": 2}, {}),
    "b_k1_pure": ("mimo1", {"method": "mtp", "num_speculative_tokens": 1}, {"VLLM_HYCO_DISABLE": "1"}),
    "agree_k2": ("mimo1_agree", {"method": "mtp", "num_speculative_tokens": 2}, {}),
    "d_hyco": ("mimo1", {"method": "hyco"}, {}),
    "d_hyco_model": ("mimo1", {"method": "hyco", "model": "{model}", "num_speculative_tokens": 1}, {}),
}


def prompts() -> list[list[int]]:
    """Three prompts of token ids (bos + ids well inside the 4096-id vocabulary), 12, 24 and 40 long."""
    rng = random.Random(35)
    return [[2] + [rng.randrange(30, 4000) for _ in range(n - 1)] for n in (12, 24, 40)]


def build(out: Path) -> dict:
    from hyco_lab.fixtures.mimo import build_mimo

    start = time.perf_counter()
    folders = {"mimo1": build_mimo(out / "mimo1", num_mtp_layers=1),
               "mimo2": build_mimo(out / "mimo2", num_mtp_layers=2),
               "mimo1_agree": build_mimo(out / "mimo1_agree", num_mtp_layers=1, agree=True)}
    return {"wall_s": round(time.perf_counter() - start, 2), "folders": {k: str(v) for k, v in folders.items()}}


# ---------------------------------------------------------------- child side (one engine per process)

def _delta(after: dict, before: dict) -> dict:
    d = {name.split(":")[1]: after[name] - before[name] for name in SPEC_METRICS}
    pos = [a - (before[PER_POS][i] if i < len(before[PER_POS]) else 0) for i, a in enumerate(after[PER_POS])]
    d["accepted_per_pos"] = pos
    drafts = d["spec_decode_num_drafts"]
    d["acceptance_per_pos"] = [round(p / drafts, 3) if drafts else None for p in pos]
    return d


def _innermost_frame(exc: BaseException, markers: tuple[str, ...] = ("/vllm/", "/vllm_hyco/", "")) -> str | None:
    """file:function:line of the innermost traceback frame of ``exc`` inside vllm/ (else vllm_hyco/, else any)."""
    frames = traceback.extract_tb(exc.__traceback__)
    for marker in markers:
        hits = [f for f in frames if marker in f.filename.replace(os.sep, "/")]
        if hits:
            path = hits[-1].filename.replace(os.sep, "/").split("site-packages/")[-1]
            return f"{path.split(str(ROOT) + '/')[-1]}:{hits[-1].name}:{hits[-1].lineno}"
    return None


def _error(exc: BaseException) -> dict:
    chain, e, seen = [], exc, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append({"class": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
                      "where": _innermost_frame(e)})
        e = e.__cause__ or e.__context__
    return {"class": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc),
            "where": _innermost_frame(exc), "raised_at": _innermost_frame(exc, ("",)), "chain": chain,
            "vllm_hyco_frames": [f"{f.filename.split(str(ROOT) + '/')[-1]}:{f.name}"
                                 for f in traceback.extract_tb(exc.__traceback__) if "/vllm_hyco/" in f.filename]}


def _drafter_structure(llm) -> dict:
    """The MTP drafter as vLLM built it: its attention layers, KV cache groups, parameters."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    drafter = getattr(runner, "drafter", None)
    info: dict = {"drafter": type(drafter).__name__ if drafter is not None else None}
    groups = []
    for i, g in enumerate(runner.kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        groups.append({"group": i, "layers": list(g.layer_names), "spec": type(spec).__name__,
                       "num_kv_heads": getattr(spec, "num_kv_heads", None),
                       "head_size": getattr(spec, "head_size", None), "block_size": spec.block_size,
                       "is_eagle_group": getattr(g, "is_eagle_group", None)})
    info["kv_cache_groups"] = groups
    info["num_blocks"] = runner.kv_cache_config.num_blocks
    if drafter is None:
        return info
    model = drafter.model
    info["model_class"] = type(model).__name__
    info["draft_attn_layers"] = sorted(getattr(drafter, "_draft_attn_layer_names", []) or [])
    own = {n: p for n, p in model.named_parameters()}
    shared = {"lm_head", "model.embed_tokens"}
    # vLLM's CPU build repacks linear weights (oneDNN / sgl handles) and leaves an empty .weight behind:
    # count those layers by their logical size (input_size_per_partition x output_size_per_partition)
    logical = {}
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if pname == "weight" and p.numel() == 0 and hasattr(mod, "input_size_per_partition"):
                logical[full] = [mod.output_size_per_partition, mod.input_size_per_partition]
            else:
                logical[full] = list(p.shape)
    mtp = {n: shape for n, shape in logical.items() if not any(n.startswith(s) for s in shared)}
    info["params_mtp_layers"] = sum(_numel(shape) for shape in mtp.values())
    info["param_shapes"] = mtp
    info["cpu_repacked_weights"] = sorted(n for n, p in own.items() if p.numel() == 0)
    info["shares_lm_head_with_target"] = model.lm_head is runner.model.lm_head
    info["shares_embed_with_target"] = model.model.embed_tokens is runner.model.model.embed_tokens
    return info


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _watch_drafter(llm) -> dict:
    """Wrap the MTP model's forward: what it is handed per call (hidden-state shape, spec_step_idx)."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    seen: dict = {"calls": 0, "spec_step_idx": [], "hidden_states": None, "positions_first_calls": []}
    drafter = getattr(runner, "drafter", None)
    if drafter is None:
        return seen
    forward = drafter.model.forward

    def wrapped(*args, **kwargs):
        seen["calls"] += 1
        idx = kwargs.get("spec_step_idx", 0)
        if idx not in seen["spec_step_idx"]:
            seen["spec_step_idx"].append(idx)
        hs = kwargs.get("hidden_states", args[2] if len(args) > 2 else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if hs is not None and seen["hidden_states"] is None:
            seen["hidden_states"] = {"shape": list(hs.shape), "dtype": str(hs.dtype)}
        if pos is not None and len(seen["positions_first_calls"]) < 4:
            seen["positions_first_calls"].append(pos.detach().cpu().tolist()[:48])
        return forward(*args, **kwargs)

    drafter.model.forward = wrapped
    return seen


def _shutdown(llm) -> str:
    try:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        return "clean"
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal for the spike
        return f"{type(exc).__name__}: {exc}"


def run_step(name: str, out: Path) -> dict:
    folder, spec, _ = STEPS[name]
    model = out / folder
    result: dict = {"step": name, "model": folder, "speculative_config": spec,
                    "plugin": "off" if os.environ.get("VLLM_HYCO_DISABLE") == "1" else "on"}
    start = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams

        kw = dict(LLM_KW)
        if spec is not None:
            kw["speculative_config"] = {k: v.format(model=model) if isinstance(v, str) else v
                                        for k, v in spec.items()}
        llm = LLM(model=str(model), **kw)
    except Exception as exc:  # noqa: BLE001 - the spike records every failure
        result.update(engine="fails", error=_error(exc), wall_s=round(time.perf_counter() - start, 2))
        try:
            from vllm.distributed import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception:  # noqa: BLE001
            pass
        return result
    result["engine"] = "starts"
    result["engine_start_s"] = round(time.perf_counter() - start, 2)
    inputs = [{"prompt_token_ids": p} for p in prompts()]
    try:
        if spec is not None:
            result["structure"] = _drafter_structure(llm)
    except Exception as exc:  # noqa: BLE001
        result["structure"] = {"error": _error(exc)}
    watch = _watch_drafter(llm) if spec is not None else None
    for mode, params in (("greedy", SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)),
                         ("sampled", SamplingParams(**SAMPLED, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True))):
        t0 = time.perf_counter()
        try:
            before = spec_counters(llm)
            outs = llm.generate(inputs, params, use_tqdm=False)
            result[mode] = {"works": True, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                            "spec": _delta(spec_counters(llm), before) if spec is not None else None}
        except Exception as exc:  # noqa: BLE001
            result[mode] = {"works": False, "error": _error(exc)}
        result[mode]["wall_s"] = round(time.perf_counter() - t0, 2)
    if watch is not None:
        result["drafter_calls"] = watch
    result["shutdown"] = _shutdown(llm)
    result["wall_s"] = round(time.perf_counter() - start, 2)
    return result


# ---------------------------------------------------------------- parent side

def _child(name: str, out: Path, timeout: int) -> dict:
    env = {**os.environ, **ENV, **STEPS[name][2]}
    env.setdefault("VLLM_CACHE_ROOT", str(out / "vllm_cache"))
    plugins = env.get("VLLM_PLUGINS")
    if plugins is not None and "hyco" not in plugins.split(","):
        env.pop("VLLM_PLUGINS")  # d_hyco needs the plugin; the others must not differ from it
    log = out / "steps" / f"{name}.log"
    start = time.perf_counter()
    try:
        with log.open("w") as fh:
            proc = subprocess.run([sys.executable, __file__, str(out), "--step", name], env=env, stdout=fh,
                                  stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        return {"step": name, "engine": "hangs", "error": {"class": "TimeoutExpired",
                                                           "message": f"killed after {timeout} s"},
                "wall_s": round(time.perf_counter() - start, 2)}
    path = out / "steps" / f"{name}.json"
    if not path.exists():
        tail = log.read_text()[-1500:]
        return {"step": name, "engine": "crashes", "error": {"class": f"exit {rc}", "message": tail},
                "wall_s": round(time.perf_counter() - start, 2)}
    result = json.loads(path.read_text())
    result["process_wall_s"] = round(time.perf_counter() - start, 2)
    return result


def _row(r: dict, ref: dict | None) -> str:
    def cell(mode: str) -> str:
        m = r.get(mode)
        if m is None:
            return "-"
        if not m["works"]:
            e = m["error"]
            return f"fails: {e['class'].rsplit('.', 1)[-1]} @ {e['where']}"
        same = ""
        if ref is not None and ref.get(mode, {}).get("works") and r["step"] != "a":
            same = " identical" if m["tokens"] == ref[mode]["tokens"] else " DIFFERS"
        if r["step"] == "agree_k2":
            same = " all-0" if all(t == 0 for seq in m["tokens"] for t in seq) else " not-all-0"
        spec = m.get("spec")
        acc = f" acc/pos {spec['acceptance_per_pos']}" if spec else ""
        return f"works{same}{acc} ({m['wall_s']}s)"

    if r.get("engine") != "starts":
        e = r.get("error", {})
        return (f"| {r['step']} | {r.get('engine')}: {e.get('class')}: {str(e.get('message'))[:200]!r} "
                f"@ {e.get('where')} (raised at {e.get('raised_at')}) | - | - | {r.get('wall_s')} |")
    return (f"| {r['step']} | starts ({r['engine_start_s']}s) | {cell('greedy')} | {cell('sampled')} "
            f"| {r['wall_s']} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", default=",".join(STEPS), help="comma-separated steps (default: all)")
    ap.add_argument("--step", help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--timeout", type=int, default=600, help="seconds per step before it is killed")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    if args.step:
        for key, value in ENV.items():
            os.environ.setdefault(key, value)
        result = run_step(args.step, out)
        (out / "steps" / f"{args.step}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k not in ("structure",)}, default=str)[:4000])
        return 0

    (out / "steps").mkdir(parents=True, exist_ok=True)
    report: dict = {"build": build(out)}
    print(f"built fixtures in {report['build']['wall_s']} s: {report['build']['folders']}", flush=True)
    results: dict[str, dict] = {}
    for name in args.steps.split(","):
        stale = out / "steps" / f"{name}.json"
        stale.unlink(missing_ok=True)
        print(f"step {name} ...", flush=True)
        results[name] = _child(name, out, args.timeout)
        print(_row(results[name], results.get("a")), flush=True)
    report["steps"] = results
    (out / "spike_mimo.json").write_text(json.dumps(report, indent=1) + "\n")
    print("\n| step | engine | greedy (vs a) | sampled (vs a) | wall s |\n|---|---|---|---|---|")
    for r in results.values():
        print(_row(r, results.get("a")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
