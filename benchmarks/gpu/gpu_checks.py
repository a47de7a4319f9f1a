"""GPU checks of what the engine launches, and the synthetic 32-tree x 30-layer step (torch + Triton, no vLLM).

Every case is the engine's own call on vLLM's default cache for the Triton backend: each layer's cache is
the logical ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` view vLLM hands the backend, over
the NHD storage ``[num_blocks, block_size, num_kv_heads, 2 * head_dim]`` that vLLM 0.32 allocates for it
(layout LBNHC, the default when no backend declares one), split by ``kernels.tree_rows.block_major_views``
into separate K and V (Gemma 4's full layers store V apart from K, so the kernel's K_EQ_V path is not
the engine's and is not run). bf16, the two layer types of Gemma 4 26B-A4B:

* sliding: 16 query heads, 8 KV heads, head_dim 256, window 1024, block 16;
* full: 16 query heads, 2 KV heads (8 query heads per KV head), head_dim 512, block 32.

Checks (Triton vs the torch twin on the same GPU; tolerances from ``tests/tolerances.py``):

1. ``attention/<layer>/<no_split|split>``: ``paged_tree_rows_attention`` (what the CUSTOM backend
   launches) for 32 trees x 33 rows at 2K context (no key split) and 1 tree x 33 rows at 32K (key splits
   chosen by the launcher; the number is recorded);
2. ``compaction``: ``kernels.compact_kv`` over 30 layers' ``kv_cache.transpose(1, 2)`` (25 sliding in one
   KV group, 5 full in another), 32 requests, bit for bit;
3. ``handoff``: ``gather_quantize_kv`` on both layer types' K and V views, ``quantize_int8`` of h and e
   (hidden 2816), bit for bit;
4. ``decision``: ``vllm_adapter.worker.tree_step.decide`` at 262,144 tokens vs the per-tree CPU reference
   (``tests/tree_reference.py``) on the same uniforms: greedy must agree exactly, sampled rows are counted;
5. ``step``: the synthetic step timed with CUDA events: 30 layers of tree-rows attention (32 trees x 33
   rows, 4K context), the decision (greedy and top-k 64 / ε), compaction of 30 layers and the int8
   hand-off (``benchmarks/bench_verify_host.py``'s step), in ms.

The report is rewritten after every check, so a timeout keeps what finished.

    python3 -u benchmarks/gpu/gpu_checks.py --out $OUT/gpu_checks.json
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu/gpu_checks.py --smoke   # CPU dry run, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

# Imported after the sys.path setup above (the repo root, tests/ and benchmarks/ as import roots).
from tolerances import tol  # noqa: E402

from vllm_hyco.handoff import tree_contract  # noqa: E402
from vllm_hyco.kernels import compact_kv, gather_quantize_kv, quantize_int8  # noqa: E402
from vllm_hyco.kernels._backend import next_pow2  # noqa: E402
from vllm_hyco.kernels.tree_attention import _launch_config, _num_splits  # noqa: E402
from vllm_hyco.kernels.tree_rows import block_major_views, paged_tree_rows_attention, tree_rows_metadata  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# name: (q heads, kv heads, head_dim, block, window)
LAYERS = {"sliding": (16, 8, 256, 16, 1024), "full": (16, 2, 512, 32, None)}
SIZES = {"trees": 32, "rows": 33, "ctx": 2048, "long_ctx": 32768, "step_ctx": 4096, "layers": 30,
         "vocab": 262144, "hidden": 2816}
SMOKE = {"trees": 3, "rows": 9, "ctx": 40, "long_ctx": 200, "step_ctx": 40, "layers": 3, "vocab": 4096,
         "hidden": 64}


def vllm_cache(num_blocks: int, kv_heads: int, block: int, dim: int, gen) -> torch.Tensor:
    """vLLM's logical [B, H, N, 2D] cache over NHD storage [B, N, H, 2D] (its default for Triton)."""
    storage = torch.randn(num_blocks, block, kv_heads, 2 * dim, generator=gen, device=DEVICE).to(torch.bfloat16)
    return storage.permute(0, 2, 1, 3)


def tree_batch(kind: str, contexts: list[int], rows: int, seed: int):
    hq, hkv, dim, block, window = LAYERS[kind]
    if SIZES is SMOKE:
        hq, hkv, dim, window = hq // 4, max(1, hkv // 4), dim // 8, window and 16
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(t + rows) // block) for t in contexts]
    ids = list(range(1, sum(need) + 1))
    rng.shuffle(ids)  # non-contiguous blocks; block 0 stays vLLM's null block
    table = torch.zeros(len(contexts), max(need), dtype=torch.int32)
    for r, n in enumerate(need):
        table[r, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    kv = vllm_cache(sum(need) + 1, hkv, block, dim, gen)
    masks, depths = [], []
    for _ in range(len(contexts)):
        parents = [-1] + [rng.randrange(max(0, j - 6), j) for j in range(1, rows)]
        masks += tree_contract.ancestor_mask(parents).tolist()
        depths += tree_contract.depths(parents).tolist()
    q = torch.randn(len(contexts) * rows, hq, dim, generator=gen, device=DEVICE).to(torch.bfloat16)
    return dict(q=q, kv=kv, dim=dim, table=table.to(DEVICE), contexts=contexts, rows=[rows] * len(contexts),
                masks=torch.tensor(masks, dtype=torch.int64, device=DEVICE),
                depths=torch.tensor(depths, dtype=torch.int32, device=DEVICE), scale=dim ** -0.5, window=window)


def run_attention(c, backend: str) -> torch.Tensor:
    k, v = block_major_views(c["kv"], c["dim"])
    return paged_tree_rows_attention(c["q"], k, v, c["table"], c["contexts"], c["rows"], c["masks"], c["depths"],
                                     c["scale"], c["window"], None, backend=backend)


def splits_of(c) -> int:
    """The key splits the launcher picks for this batch (what the engine gets)."""
    meta = tree_rows_metadata(c["table"], c["contexts"], c["rows"], c["masks"], c["depths"])
    hq, dim = c["q"].shape[1], c["q"].shape[2]
    hkv = c["kv"].shape[1]
    block_q, tile_n, _ = _launch_config(max(16, next_pow2(dim)), next_pow2(hq // hkv), meta.max_query_len, False)
    programs = meta.num_reqs * hkv * max(1, -(-meta.max_query_len // block_q))
    return _num_splits(meta, programs, tile_n, DEVICE)


def check_attention(kind: str, long: bool) -> dict:
    contexts = [SIZES["long_ctx"]] if long else [SIZES["ctx"] - (37 * i) % SIZES["ctx"] for i in range(SIZES["trees"])]
    c = tree_batch(kind, contexts, SIZES["rows"], seed=1 if long else 2)
    got, want = run_attention(c, "triton"), run_attention(c, "torch")
    t = tol("attention", torch.bfloat16)
    diff = (got.float() - want.float()).abs()
    ok = bool((diff <= t["atol"] + t["rtol"] * want.float().abs()).all() and torch.isfinite(got).all())
    splits = splits_of(c)
    if DEVICE.type == "cuda":  # the case must exercise what its name says (1 split on CPU)
        ok &= (splits > 1) == long
    return {"ok": ok, "max_abs_diff": float(diff.max()), "splits": splits, "trees": len(contexts),
            "strides": list(block_major_views(c["kv"], c["dim"])[0].stride())}


def _compaction_case():
    rng, gen = random.Random(0), torch.Generator(device=DEVICE).manual_seed(0)
    n_layers, trees, rows = SIZES["layers"], SIZES["trees"], SIZES["rows"]
    n_full = max(1, n_layers // 6)
    caches, groups, src, dst = [], [], [], []
    prefix = [rng.randint(0, SIZES["ctx"]) for _ in range(trees)]
    accepted = [[0] + sorted(rng.sample(range(1, rows), rng.randint(0, min(8, rows - 1)))) for _ in prefix]
    for g, kind in enumerate(("sliding", "full")):
        _, hkv, dim, block, _ = LAYERS[kind]
        if SIZES is SMOKE:
            hkv, dim = max(1, hkv // 4), dim // 8
        need = [-(-(t + rows) // block) for t in prefix]
        ids = list(range(1, sum(need) + 1))
        rng.shuffle(ids)
        s_row, d_row = [], []
        for t, n, acc in zip(prefix, need, accepted):
            table, ids = ids[:n], ids[n:]

            def slot(p, table=table, block=block):
                return table[p // block] * block + p % block

            s_row += [slot(t + r) for r in acc[1:]] + [-1] * (rows - len(acc))
            d_row += [slot(t + i + 1) for i in range(len(acc) - 1)] + [-1] * (rows - len(acc))
        src.append(s_row)
        dst.append(d_row)
        count = n_layers - n_full if kind == "sliding" else n_full
        for _ in range(count):
            caches.append(vllm_cache(sum(need) + 1, hkv, block, dim, gen).transpose(1, 2))  # tree_step's view
            groups.append(g)

    def int64_tensor(v):
        return torch.tensor(v, dtype=torch.int64, device=DEVICE)

    loc = torch.arange(0, (trees + 1) * (rows - 1), rows - 1, dtype=torch.int32, device=DEVICE)
    # rows - 1 moves per request, -1 past its path: tree_step pads every request to the deepest path
    return caches, int64_tensor(src), int64_tensor(dst), loc, groups


def check_compaction() -> dict:
    caches, src, dst, loc, groups = _compaction_case()
    twin = [c.clone() for c in caches]
    compact_kv(twin, src, dst, loc, groups, backend="torch")
    compact_kv(caches, src, dst, loc, groups, backend="triton")
    return {"ok": all(torch.equal(a, b) for a, b in zip(caches, twin)), "layers": len(caches),
            "moves": int((src >= 0).sum())}


def check_handoff() -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    mism = 0
    for kind in LAYERS:
        c = tree_batch(kind, [SIZES["ctx"]], SIZES["rows"], seed=5)
        k, v = block_major_views(c["kv"], c["dim"])
        scale = torch.rand(k.shape[2], k.shape[3], generator=gen, device=DEVICE) * 0.05 + 0.005
        slots = torch.randperm(k.shape[0] * k.shape[1], device=DEVICE, generator=gen)[:SIZES["rows"] * 2]
        for view in (k, v):
            a = gather_quantize_kv(view, slots, scale, backend="triton")
            b = gather_quantize_kv(view, slots, scale, backend="torch")
            mism += int((a != b).sum())
    x = torch.randn(SIZES["trees"], SIZES["hidden"], generator=gen, device=DEVICE) * 2
    xs = torch.rand(SIZES["hidden"], generator=gen, device=DEVICE) * 0.03 + 0.001
    ties = (torch.randint(-200, 200, x.shape, generator=gen, device=DEVICE).float() + 0.5) * xs
    for val in (x, ties):
        mism += int((quantize_int8(val, xs, backend="triton") != quantize_int8(val, xs, backend="torch")).sum())
    return {"ok": mism == 0, "mismatches": mism}


def _step_args(sampled_layers: int):
    return SimpleNamespace(trees=SIZES["trees"], rows=SIZES["rows"], vocab=SIZES["vocab"], context=96,
                           layers=sampled_layers, reps=1, hidden=None)


def check_decision() -> dict:
    import bench_verify_host as bv
    from tree_reference import decide_one_tree

    from vllm_hyco.vllm_adapter.worker import tree_step

    out = {"ok": True}
    for name, sampled in (("greedy", False), ("sampled", True)):
        s = bv.build_step(_step_args(2), DEVICE, sampled)
        st = tree_step.StepTrees.build(s.trees, [tr.q_start for tr in s.trees], DEVICE)
        dec = tree_step.decide(s.runner, st, s.logits, lambda rid, p: torch.Generator().manual_seed(9))
        same = 0
        for b, tr in enumerate(s.trees):
            p = s.requests[tr.req_id].sampling_params
            want = decide_one_tree(s.logits[tr.q_start: tr.q_start + tr.num_rows], tr.tokens, tr.parents,
                                   p.temperature, p.top_k, p.top_p, tr.eps, torch.Generator().manual_seed(9))
            same += int((dec.path_rows[b], dec.bonus[b], dec.samples[b]) ==
                        (want["path_rows"], want["bonus"], want["samples"]))
        out[name] = {"trees_equal": same, "trees": len(s.trees)}
        out["ok"] &= same == len(s.trees) if not sampled else same >= len(s.trees) - 1
        del s
    return out


def _time(fn, reps: int = 3) -> float:
    """Median ms of ``fn`` (CUDA events on a GPU, wall time otherwise), after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if DEVICE.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def check_step() -> dict:
    """The synthetic step, timed part by part (ms)."""
    import bench_verify_host as bv

    from vllm_hyco.vllm_adapter.worker import handoff_step, tree_step

    n_full = max(1, SIZES["layers"] // 6)
    out = {"ok": True}
    attn = {}
    for kind in LAYERS:
        c = tree_batch(kind, [SIZES["step_ctx"]] * SIZES["trees"], SIZES["rows"], seed=7)
        attn[kind] = _time(lambda c=c: run_attention(c, "auto"))
        del c
    out["attention_ms_per_layer"] = attn
    out["attention_ms_30_layers"] = attn["sliding"] * (SIZES["layers"] - n_full) + attn["full"] * n_full
    for name, sampled in (("greedy", False), ("sampled", True)):
        s = bv.build_step(_step_args(SIZES["layers"]), DEVICE, sampled)
        st = tree_step.StepTrees.build(s.trees, [tr.q_start for tr in s.trees], DEVICE)
        gens = {tr.req_id: torch.Generator().manual_seed(3) for tr in s.trees}
        dec_ms = _time(lambda s=s, st=st, g=gens: tree_step.decide(s.runner, st, s.logits, lambda r, p: g[r]))
        dec = tree_step.decide(s.runner, st, s.logits, lambda r, p, g=gens: g[r])
        out[f"decision_ms_{name}"] = dec_ms
        out[f"compaction_ms_{name}"] = _time(lambda s=s, st=st, dec=dec: tree_step.compact(s.runner, st, dec.verdict))
        out[f"handoff_ms_{name}"] = _time(lambda s=s, st=st, dec=dec: handoff_step.handoff(s.runner, st, dec, s.hidden))
        del s, st, dec
    return out


def run_all(out_path: Path) -> dict:
    cuda = DEVICE.type == "cuda"
    import triton

    report = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter dry run)",
              "torch": torch.__version__, "triton": triton.__version__, "sizes": dict(SIZES), "checks": []}
    jobs = [(f"attention/{k}/{'split' if long else 'no_split'}", check_attention, (k, long))
            for k in LAYERS for long in (False, True)]
    jobs += [("compaction", check_compaction, ()), ("handoff", check_handoff, ()),
             ("decision", check_decision, ()), ("step", check_step, ())]
    for name, fn, args in jobs:
        t0 = time.time()
        try:
            res = fn(*args)
        except Exception as e:  # record and go on: one failure must not hide the others
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        res.update(name=name, seconds=round(time.time() - t0, 2))
        print(json.dumps({k: v for k, v in res.items() if k != "trace"}), flush=True)
        report["checks"].append(res)
        report["all_ok"] = all(c.get("ok") for c in report["checks"])
        out_path.write_text(json.dumps(report, indent=1))
        if cuda:
            torch.cuda.empty_cache()
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/gpu/gpu_checks.json"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU dry run under TRITON_INTERPRET=1)")
    args = p.parse_args()
    global SIZES
    if args.smoke:
        SIZES = SMOKE
    if DEVICE.type != "cuda" and not args.smoke:
        raise SystemExit("gpu_checks.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    if DEVICE.type == "cpu":
        torch.set_num_threads(1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = run_all(out)
    print(f"all_ok={report['all_ok']} -> {out}", flush=True)


if __name__ == "__main__":
    main()
