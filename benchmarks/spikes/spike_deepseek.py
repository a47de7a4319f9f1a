"""Spike (issue 35, step 1): what plain vLLM 0.32 does on this CPU with a DeepSeek-V3-shaped (MLA + MTP) model.

    python benchmarks/spikes/spike_deepseek.py OUT_DIR [--steps a,b1,...] [--timeout 420]

Builds the tiny fixtures (``hyco_lab.fixtures.deepseek.build_deepseek``) under OUT_DIR, then runs each step in
its own Python process (in-process engine, ``distributed_executor_backend="uni"``, the CPU recipe of
tests/conftest.py ``_LLMFactory``), killed after ``--timeout`` seconds if it hangs. Fixtures (same main
weights in all but model_v512)::

    model              DeepSeek-V3 shaped, YaRN rope (as the real config), random MTP layer
    model_repeat       the same main weights, MTP layer built with mtp_init="repeat" (drafts get accepted)
    model_v512         v_head_dim 512 instead of 128 (other weights differ)
    model_rope_default the same main weights as model, plain (default) rope, repeat MTP layer

Steps::

    a          plain vLLM, greedy, 3 prompts (token ids) x 32 tokens, float32: attention backend (log line),
               block size; e (the MLA KV cache as allocated: shape/dtype of one layer's tensor) is probed here
               and in b2r (where the MTP layer adds its own cache)
    a_bf16     the same in bfloat16 (does the CPU MLA path take both?)
    a_v512     the same on model_v512 (the kernel's value width is the latent's, not v_head_dim)
    b1, b2     {"method": "mtp", "num_speculative_tokens": 1 | 2}, greedy: token-identical to a? spec counters
    b1r, b2r   the same on model_repeat (multi-token acceptance exercised)
    c          mtp k=2 on model_repeat, sampled (T 1, top_k 64, top_p 0.95, seeded), HyCo plugin loaded (its
               CPU expand-kernel fix)
    c_stock    the same with the plugin off (VLLM_HYCO_DISABLE=1): stock vLLM 0.32 CPU
    d          {"method": "hyco"} with the plugin active: expected refusal naming the family
    pf         prefill reference: each prompt + a's 32 tokens as one prompt (prompt_logprobs), alone and all
               three together: is the forward batch-invariant, and does a's decode path agree with prefill?
    rope_probe vLLM's CPU rotary op on MLA-shaped inputs (3-D q_pe [T, H, 64], strided k_pe) vs torch
    a_rd, b2r_rd, pf_rd   a / b2r / pf on model_rope_default (the default-rope code path)

Each step prints worked / failed (exception class, message, innermost vLLM file:function) and its wall time;
OUT_DIR/results.json holds everything, OUT_DIR/logs/STEP.log each step's engine log.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 32
PROMPT_LENS = (7, 19, 41)
SAMPLED = dict(temperature=1.0, top_k=64, top_p=0.95)
LLM_DEFAULTS = dict(dtype="float32", max_model_len=1024, max_num_seqs=4, enforce_eager=True,
                    distributed_executor_backend="uni", seed=0)
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
FIXTURES = {"model": {}, "model_repeat": {"mtp_init": "repeat"}, "model_v512": {"v_head_dim": 512},
            "model_rope_default": {"rope_type": "default", "mtp_init": "repeat"}}


def _mtp(k: int) -> dict:
    return {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}}


# step -> kind ("generate" | "prefill" | "rope_probe"), model folder, extra LLM kwargs, sampled?, extra env,
# baseline step (greedy tokens compared with)
PLAN: dict[str, dict] = {
    "a": dict(model="model"),
    "a_bf16": dict(model="model", llm={"dtype": "bfloat16"}, base="a"),
    "a_v512": dict(model="model_v512"),
    "b1": dict(model="model", llm=_mtp(1), base="a"),
    "b2": dict(model="model", llm=_mtp(2), base="a"),
    "b1r": dict(model="model_repeat", llm=_mtp(1), base="a"),
    "b2r": dict(model="model_repeat", llm=_mtp(2), base="a"),
    "c": dict(model="model_repeat", llm=_mtp(2), sampled=True),
    "c_stock": dict(model="model_repeat", llm=_mtp(2), sampled=True, env={"VLLM_HYCO_DISABLE": "1"}),
    "d": dict(model="model", llm={"speculative_config": {"method": "hyco"}}),
    "pf": dict(kind="prefill", model="model", base="a"),
    "rope_probe": dict(kind="rope_probe", model="model"),
    "a_rd": dict(model="model_rope_default"),
    "b2r_rd": dict(model="model_rope_default", llm=_mtp(2), base="a_rd"),
    "pf_rd": dict(kind="prefill", model="model_rope_default", base="a_rd"),
}
STEPS = tuple(PLAN)


def prompts(vocab: int) -> list[list[int]]:
    """Three prompts of token ids (bos first; ids past the special pieces), fixed by a seed."""
    rng = random.Random(35)
    return [[2] + [rng.randrange(32, vocab) for _ in range(n - 1)] for n in PROMPT_LENS]


# ----------------------------------------------------------------------------------------------- child side
def _innermost_vllm(exc: BaseException) -> dict:
    """The exception chain's root and the innermost frame inside the vllm package (file:function:line)."""
    chain = [exc]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain:
        chain.append(nxt)
    out = {"class": type(exc).__name__, "message": str(exc)[:2000]}
    root = chain[-1]
    if root is not exc:
        out["root_class"], out["root_message"] = type(root).__name__, str(root)[:2000]
    for e in (root, exc):
        frames = traceback.extract_tb(e.__traceback__)
        inside = [f for f in frames if "/site-packages/vllm/" in f.filename]
        if inside:
            f = inside[-1]
            out["vllm_frame"] = f"vllm/{f.filename.split('/site-packages/vllm/', 1)[1]}:{f.name}:{f.lineno}"
            break
    frames = traceback.extract_tb(root.__traceback__)
    ours = [f for f in frames if "/vllm_hyco/" in f.filename]
    if ours:
        f = ours[-1]
        out["vllm_hyco_frame"] = f"vllm_hyco/{f.filename.split('/vllm_hyco/', 1)[1]}:{f.name}:{f.lineno}"
    if frames:
        f = frames[-1]
        out["innermost_frame"] = f"{f.filename.split('/site-packages/')[-1]}:{f.name}:{f.lineno}"
    out["traceback"] = "".join(traceback.format_exception(exc))[-6000:]
    return out


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def _kv_layout(llm) -> dict:
    """Shape/dtype of the KV cache tensors the runner allocated (one entry per distinct layout)."""
    runner = _runner(llm)
    layouts: dict = {}
    ctx = runner.vllm_config.compilation_config.static_forward_context
    for name, layer in ctx.items():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, list):  # older layout: one per virtual engine
            kv = kv[0] if kv else None
        if kv is None or not hasattr(kv, "shape"):
            continue
        key = f"{tuple(kv.shape)} {kv.dtype}"
        entry = layouts.setdefault(key, {"shape": list(kv.shape), "dtype": str(kv.dtype), "stride": list(
            kv.stride()), "layers": [], "impl": type(getattr(layer, "impl", None)).__name__})
        entry["layers"].append(name)
    caches = getattr(runner, "kv_caches", None) or []
    spec = None
    try:
        groups = runner.kv_cache_config.kv_cache_groups
        spec = [{"layers": len(g.layer_names), "spec": type(g.kv_cache_spec).__name__,
                 "block_size": g.kv_cache_spec.block_size,
                 "head_size": getattr(g.kv_cache_spec, "head_size", None),
                 "num_kv_heads": getattr(g.kv_cache_spec, "num_kv_heads", None),
                 "page_size_bytes": g.kv_cache_spec.page_size_bytes} for g in groups]
    except Exception as e:  # noqa: BLE001  (a probe: report what is there)
        spec = repr(e)
    return {"by_layout": list(layouts.values()), "runner_kv_caches": len(caches),
            "runner_kv_caches_first": (list(caches[0].shape) if len(caches) else None),
            "kv_cache_groups": spec,
            "num_blocks": getattr(runner.kv_cache_config, "num_blocks", None)}


def _spec_counters(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        if "spec_decode" not in m.name:
            continue
        value = list(m.values) if hasattr(m, "values") else m.value
        out[m.name] = value
    return out


def rope_probe() -> dict:
    """vLLM's CPU rotary op (``RotaryEmbedding.forward_cpu``) on MLA-shaped inputs vs ``forward_native``."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    out = {}
    with set_current_vllm_config(VllmConfig()):
        torch.manual_seed(0)
        rope = get_rope(64, max_position=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        is_neox_style=False)
        n, pos = 7, torch.arange(7)
        cases = {
            "2d_q[T,H*64]_k[T,64]": (torch.randn(n, 4 * 64), torch.randn(n, 64)),
            "3d_q[T,4,64]_k[T,1,64]": (torch.randn(n, 4, 64), torch.randn(n, 1, 64)),
            "3d_q[T,1,64]_k[T,1,64]": (torch.randn(n, 1, 64), torch.randn(n, 1, 64)),
        }
        for name, (q, k) in cases.items():
            qn, kn = rope.forward_native(pos, q.clone(), k.clone())
            qc, kc = rope.forward_cpu(pos, q.clone(), k.clone())
            out[name] = {"q_max_err": round((qc - qn).abs().max().item(), 6),
                         "k_max_err": round((kc - kn).abs().max().item(), 6)}
        # exactly as vllm/model_executor/layers/mla.py hands them over: q[..., nope:] and k_pe of the fused output
        big, fused = torch.randn(n, 4, 192), torch.randn(n, 640)
        qn, kn = rope.forward_native(pos, big[..., 128:].clone(), fused[:, 576:].unsqueeze(1).clone())
        qv, kv = big.clone(), fused.clone()
        qc, kc = rope.forward_cpu(pos, qv[..., 128:], kv[:, 576:].unsqueeze(1))
        out["mla_views_q[T,4,192][...,128:]_k[T,640][:,576:]"] = {
            "q_max_err": round((qc - qn).abs().max().item(), 6), "k_max_err": round((kc - kn).abs().max().item(), 6),
            "latent_part_overwritten": bool((kv[:, :576] != fused[:, :576]).any())}
    return out


def prefill_check(llm, prompt_ids: list[list[int]], base: dict) -> dict:
    """Each prompt + the baseline's tokens as one prompt, alone and together (prompt_logprobs)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    seqs = [p + t for p, t in zip(prompt_ids, base["tokens"])]

    def run(idx: list[int]) -> list[list[tuple[float, bool]]]:
        outs = llm.generate([{"prompt_token_ids": seqs[i]} for i in idx], sp, use_tqdm=False)
        n = [len(prompt_ids[i]) for i in idx]
        return [[(d[t].logprob, d[t].rank == 1) for d, t in zip(o.prompt_logprobs[k:], seqs[i][k:])]
                for o, i, k in zip(outs, idx, n)]

    alone = [run([i])[0] for i in range(len(seqs))]
    together = run(list(range(len(seqs))))
    decode = [[top[0][1] for top in rows] for rows in base["top2"]]
    rows = []
    for i in range(len(seqs)):
        rows.append({
            "prompt": i,
            "alone_vs_together_max_abs": round(max(abs(a[0] - b[0]) for a, b in zip(alone[i], together[i])), 6),
            "decode_vs_prefill_max_abs": round(max(abs(a[0] - d) for a, d in zip(alone[i], decode[i])), 6),
            "baseline_tokens_are_prefill_argmax": all(a[1] for a in alone[i])})
    return {"rows": rows}


def run_step(step: str, out_dir: Path) -> dict:
    plan = PLAN[step]
    extra, sampled, kind = plan.get("llm", {}), plan.get("sampled", False), plan.get("kind", "generate")
    model = out_dir / plan["model"]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    res: dict = {"step": step, "model": str(model), "llm_kwargs": {**LLM_DEFAULTS, **extra}}
    t0 = time.perf_counter()
    llm = None
    try:
        from vllm import LLM, SamplingParams

        res["import_s"] = round(time.perf_counter() - t0, 2)
        if kind == "rope_probe":
            res["rope_probe"] = rope_probe()
            res["status"] = "worked"
            return res
        t1 = time.perf_counter()
        llm = LLM(model=str(model), disable_log_stats=False, **{**LLM_DEFAULTS, **extra})
        res["start_s"] = round(time.perf_counter() - t1, 2)
        cfg = llm.llm_engine.vllm_config
        res["block_size"] = cfg.cache_config.block_size
        res["chunked_prefill"] = cfg.scheduler_config.enable_chunked_prefill
        res["prefix_caching"] = cfg.cache_config.enable_prefix_caching
        res["max_num_batched_tokens"] = cfg.scheduler_config.max_num_batched_tokens
        if cfg.speculative_config is not None:
            sc = cfg.speculative_config
            res["spec"] = {"method": sc.method, "k": sc.num_speculative_tokens,
                           "draft_arch": sc.draft_model_config.architectures if sc.draft_model_config else None}
        try:
            runner = _runner(llm)
            res["attn_backends"] = sorted({type(layer.impl).__name__ for layer in
                                           runner.vllm_config.compilation_config.static_forward_context.values()
                                           if hasattr(layer, "impl")})
        except Exception as e:  # noqa: BLE001
            res["attn_backends"] = repr(e)
        if kind == "prefill":
            base = json.loads((out_dir / "steps" / f"{plan['base']}.json").read_text())
            t2 = time.perf_counter()
            res["prefill_check"] = prefill_check(llm, prompts(vocab), base)
            res["generate_s"] = round(time.perf_counter() - t2, 2)
            res["status"] = "worked"
            return res
        if step in ("a", "b2r"):  # e: the KV cache layout (b2r: with the MTP layer's own cache)
            t2 = time.perf_counter()
            try:
                res["kv_layout"] = _kv_layout(llm)
            except Exception as e:  # noqa: BLE001
                res["kv_layout"] = {"error": _innermost_vllm(e)}
            res["kv_probe_s"] = round(time.perf_counter() - t2, 3)
        if sampled:
            params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=100 + i, **SAMPLED)
                      for i in range(len(PROMPT_LENS))]
        else:
            params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0, logprobs=2)
        t3 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab)], params, use_tqdm=False)
        res["generate_s"] = round(time.perf_counter() - t3, 2)
        res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        if not sampled:  # each position's top-2 (token, logprob): how close was the argmax?
            res["top2"] = [[sorted(((t, round(lp.logprob, 6)) for t, lp in pos.items()), key=lambda x: -x[1])[:2]
                            for pos in (o.outputs[0].logprobs or [])] for o in outs]
        res["spec_counters"] = _spec_counters(llm)
        res["status"] = "worked"
    except Exception as e:  # noqa: BLE001  (the spike records every failure)
        res["status"] = "failed"
        res["error"] = _innermost_vllm(e)
    finally:
        with contextlib.suppress(Exception):  # tests/conftest.py _LLMFactory.close, in this process
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            from vllm.distributed import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
    res["child_s"] = round(time.perf_counter() - t0, 2)
    return res


# ---------------------------------------------------------------------------------------------- parent side
def _backend_lines(log: str) -> list[str]:
    pat = re.compile(r"(Using \S+ backend|MLA prefill backend|block_size|chunked prefill|MoE backend|"
                     r"[Ss]peculative|MTP|Cannot use)")
    seen, out = set(), []
    for line in log.splitlines():
        if pat.search(line):
            text = re.sub(r"^.*?\] ", "", line).strip()[:300]
            if text not in seen:
                seen.add(text)
                out.append(text)
    return out[:20]


def acceptance(counters: dict, k: int) -> dict | None:
    drafts = counters.get("vllm:spec_decode_num_drafts")
    if not drafts:
        return None
    per_pos = counters.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    per_pos = (list(per_pos) + [0] * k)[:k]
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {"drafts": drafts, "draft_tokens": counters.get("vllm:spec_decode_num_draft_tokens"),
            "accepted": accepted, "accepted_per_pos": per_pos,
            "rate_per_pos": [round(c / drafts, 4) for c in per_pos],
            "mean_acceptance_length": round(1 + accepted / drafts, 4)}


def build(out_dir: Path) -> dict:
    sys.path.insert(0, str(ROOT / "lab" / "src"))
    from safetensors import safe_open

    from hyco_lab.fixtures.deepseek import build_deepseek

    t0 = time.perf_counter()
    for name, opts in FIXTURES.items():
        build_deepseek(out_dir / name, seed=0, fp32=True, progress=name == "model", **opts)
    manifest = json.loads((out_dir / "model" / "fixture.json").read_text())
    manifest["build_s"] = round(time.perf_counter() - t0, 2)
    mtp = f"model.layers.{manifest['options']['num_hidden_layers']}."
    same = {}
    with safe_open(str(out_dir / "model" / "model.safetensors"), "pt") as fa:
        names = [n for n in fa.keys() if not n.startswith(mtp)]  # noqa: SIM118  (safe_open has no __iter__)
        for other in ("model_repeat", "model_rope_default"):
            with safe_open(str(out_dir / other / "model.safetensors"), "pt") as fb:
                same[other] = all(fa.get_tensor(n).equal(fb.get_tensor(n)) for n in names)
    manifest["main_weights_identical_to_model"] = same
    return manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--timeout", type=int, default=420, help="seconds per step before it is killed")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out_dir = args.out_dir.resolve()
    if args.child:
        res = run_step(args.child, out_dir)
        (out_dir / "steps" / f"{args.child}.json").write_text(json.dumps(res, indent=2) + "\n")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "steps").mkdir(exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    results: dict = {"fixture": build(out_dir), "steps": {}}
    print(f"fixture: {results['fixture']['params']} built in {results['fixture']['build_s']} s", flush=True)
    for step in [s for s in args.steps.split(",") if s]:
        env = {**os.environ, **ENV, **PLAN[step].get("env", {})}
        env.setdefault("VLLM_CACHE_ROOT", str(out_dir / "vllm-cache"))
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "lab" / "src"), str(ROOT), env.get("PYTHONPATH", "")])
        log_path = out_dir / "logs" / f"{step}.log"
        (out_dir / "steps" / f"{step}.json").unlink(missing_ok=True)
        t0 = time.perf_counter()
        with log_path.open("w") as log:
            proc = subprocess.Popen([sys.executable, __file__, str(out_dir), "--child", step], env=env,
                                    stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
            try:
                proc.wait(timeout=args.timeout)
                hung = False
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                hung = True
        wall = round(time.perf_counter() - t0, 2)
        path = out_dir / "steps" / f"{step}.json"
        if path.exists():
            res = json.loads(path.read_text())
        else:
            res = {"step": step, "status": "hung" if hung else "crashed",
                   "error": {"class": "Timeout" if hung else f"exit {proc.returncode}",
                             "message": log_path.read_text()[-1500:]}}
        log_text = log_path.read_text(errors="replace")
        res["wall_s"] = wall
        res["log_lines"] = _backend_lines(log_text)
        res["refusal_lines"] = [ln.strip()[:500] for ln in log_text.splitlines()
                                if "HyCo" in ln or "ConfigError" in ln][:5]
        k = ((PLAN[step].get("llm", {}).get("speculative_config") or {}).get("num_speculative_tokens")) or 0
        if k and res.get("spec_counters"):
            res["acceptance"] = acceptance(res["spec_counters"], k)
        base_step = PLAN[step].get("base")
        base = results["steps"].get(base_step, {}).get("tokens") if base_step else None
        if res.get("tokens") and base:
            res["identical_to_base"] = res["tokens"] == base
            res["first_divergence"] = [next((i for i, (x, y) in enumerate(zip(t, b)) if x != y), None)
                                       for t, b in zip(res["tokens"], base)]
            top2 = results["steps"][base_step].get("top2") or []
            res["divergence_detail"] = [
                {"prompt": p, "pos": i, "a_token": base[p][i], "token": res["tokens"][p][i],
                 "a_top2": top2[p][i] if p < len(top2) and i < len(top2[p]) else None,
                 "a_gap": (round(top2[p][i][0][1] - top2[p][i][1][1], 6)
                           if p < len(top2) and i < len(top2[p]) and len(top2[p][i]) > 1 else None)}
                for p, i in enumerate(res["first_divergence"]) if i is not None]
        results["steps"][step] = res
        line = f"[{step:8s}] {res['status']:7s} {wall:7.1f}s"
        if res["status"] == "worked":
            line += f" block {res.get('block_size')} backends {res.get('attn_backends')}"
            if "identical_to_base" in res:
                line += f" identical_to_{base_step}={res['identical_to_base']}"
            if res.get("prefill_check"):
                line += f" {res['prefill_check']['rows']}"
            if res.get("rope_probe"):
                line += f" {res['rope_probe']}"
            if res.get("acceptance"):
                line += f" acceptance {res['acceptance']['rate_per_pos']}"
        else:
            err = res.get("error", {})
            line += f" {err.get('class')}: {str(err.get('message'))[:300]} @ {err.get('vllm_frame')}"
        print(line, flush=True)
        (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
