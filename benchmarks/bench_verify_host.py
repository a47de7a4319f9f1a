"""Host work of one tree step, before and after the device-batched decision: bytes device->host, host ms.

One synthetic step: 32 trees x 33 rows on a 262,144-token vocabulary (Gemma 4's), float32 logits as vLLM's
sampler sees them, the two hand-off layers of Gemma 4 26B-A4B (sliding: 8 KV heads x 256, full: 2 x 512,
bf16 paged caches) plus ``--layers`` cache-owning layers for compaction. Two paths on the same inputs:

* before: the engine's former per-tree path: per tree and layer a clone of the fresh K/V rows (the
  capture), per tree the rows' logits copied to the host and p̃ built there
  (``decide_one_tree`` in tests/tree_reference.py), compaction per tree and layer from the clones, the float
  hand-off copied to the host and quantized there with numpy (the API server's former job);
* after: ``vllm_adapter/tree_step``: decide (all trees, on the device), compact (``kernels.compact_kv``),
  handoff (int8 on the device, one copy).

Bytes are counted at the call sites: every ``Tensor.cpu()/.tolist()/.numpy()/.item()`` during the step (on
a GPU each is a device-to-host copy; on CPU the same calls are what a GPU run would copy). Host ms is the
step's wall time with CUDA synchronized (on CPU it includes the compute, one thread, so compare ratios). The
"forward" beside them is the LM-head projection of the step's rows (``[rows, hidden] x [hidden, V]``, the
only vocabulary-sized part of a forward; hidden 2816 on a GPU, ``--hidden`` on CPU). Scenarios: greedy,
and sampled (temperature 1, top-k 64, top-p 0.95, ε 0.005).

    .venv/bin/python benchmarks/bench_verify_host.py [--trees 32] [--rows 33] [--vocab 262144] [--reps 3]

Writes benchmarks/out/bench_verify_host.json and prints before/after ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(Path(__file__).resolve().parent)]

# Imported after the sys.path setup above (the repo root, tests/ and benchmarks/ as import roots).
from harness import env_info, write_json  # noqa: E402
from tree_reference import decide_one_tree  # noqa: E402

from vllm_hyco.handoff.quant import quantize  # noqa: E402
from vllm_hyco.vllm_adapter.worker import handoff_step, tree_step  # noqa: E402
from vllm_hyco.vllm_adapter.worker.kv_view import BlockMajorKVView  # noqa: E402
from vllm_hyco.vllm_adapter.worker.layers import KVLayers  # noqa: E402
from vllm_hyco.vllm_adapter.worker.state import RunnerState  # noqa: E402
from vllm_hyco.vllm_adapter.worker.tree_plan import TreeRows  # noqa: E402

METHODS = ("cpu", "tolist", "numpy", "item")
BLOCK = 16
LAYERS = {"sliding": (8, 256), "full": (2, 512)}  # kind: (kv heads, head dim) of Gemma 4 26B-A4B


class Transfers:
    """Counts bytes of every Tensor.cpu/.tolist/.numpy/.item call (a device-to-host copy on a GPU)."""

    def __enter__(self):
        self.bytes, self.calls, self._orig = 0, 0, {}
        for name in METHODS:
            orig = getattr(torch.Tensor, name)
            self._orig[name] = orig

            def wrapped(t, *a, _orig=orig, **k):
                self.bytes += t.numel() * t.element_size()
                self.calls += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, orig)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_step(args, dev, sampled: bool):
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    trees, requests, q, ctx = [], {}, 0, args.context
    params = (SimpleNamespace(temperature=1.0, top_k=64, top_p=0.95, min_tokens=0, all_stop_token_ids=set())
              if sampled else SimpleNamespace(temperature=0.0, top_k=-1, top_p=1.0, min_tokens=0,
                                              all_stop_token_ids=set()))
    logits = torch.randn(args.trees * args.rows, args.vocab, generator=gen)
    logits[:, :64] += 4.0
    top = logits.argmax(dim=1).tolist()
    logits = logits.to(dev)
    for b in range(args.trees):
        tokens, parents = [rng.randrange(args.vocab)], [-1]
        for i in range(1, args.rows):  # a chain of the argmax (accepted deep under greedy), random leaves
            parents.append(i - 1 if i < 6 else rng.randrange(i))
            tok = top[q + parents[-1]] if i < 6 else rng.randrange(64)
            while any(pp == parents[-1] and tt == tok for tt, pp in zip(tokens, parents)):
                tok = rng.randrange(args.vocab)
            tokens.append(tok)
        requests[f"r{b}"] = SimpleNamespace(sampling_params=params, output_token_ids=[])
        trees.append(TreeRows.build(req_id=f"r{b}", batch_idx=b, q_start=q, num_rows=args.rows, context_len=ctx,
                                    round=1, tokens=tokens, parents=parents, eps=0.005 if sampled else None))
        q += args.rows
    need = -(-(ctx + args.rows) // BLOCK)
    kinds = dict(LAYERS)
    for i in range(args.layers - 2):
        kinds[f"extra{i}"] = LAYERS["sliding"]
    caches, tables, layers = {}, [], {}
    table = torch.arange(args.trees * need, dtype=torch.int32).view(args.trees, need).to(dev)
    slots = torch.cat([(table[b].long()[torch.arange(ctx, ctx + args.rows, device=dev) // BLOCK] * BLOCK
                        + torch.arange(ctx, ctx + args.rows, device=dev) % BLOCK) for b in range(args.trees)])
    for name, (hkv, dim) in kinds.items():
        caches[name] = torch.randn(args.trees * need + 1, BLOCK, hkv, 2 * dim, generator=gen).to(
            torch.bfloat16).to(dev).transpose(1, 2)  # vLLM's logical [B, H, N, 2D] over NHD storage
        layers[name] = SimpleNamespace(kv_cache=caches[name], kv_cache_dtype="auto")
        tables.append(SimpleNamespace(slot_mapping=SimpleNamespace(gpu=slots), block_size=BLOCK,
                                      block_table=SimpleNamespace(gpu=table)))
    hidden = 2816
    scales = {"e": torch.full((hidden,), 0.02, device=dev), "h": torch.full((hidden,), 0.02, device=dev)}
    for kind, (hkv, dim) in LAYERS.items():
        scales[kind] = (torch.full((hkv, dim), 0.05, device=dev), torch.full((hkv, dim), 0.05, device=dev))
    # the runner's HyCo state: scales, layers.discover's cache owners and hand-off layers, read once
    state = RunnerState(config=None, window=1024, scales=scales,
                        kv_layers=KVLayers(owners=tuple(kinds), handoff={"sliding": "sliding", "full": "full"}))
    embed = torch.randn(64, hidden, generator=gen).to(dev)
    runner = SimpleNamespace(
        requests=requests, hyco=state, device=dev,
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)),  # one TP rank
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[k]) for k in kinds]),
        compilation_config=SimpleNamespace(static_forward_context=layers),
        input_batch=SimpleNamespace(block_table=tables),
        model=SimpleNamespace(embed_input_ids=lambda ids: embed[ids % 64]))
    fresh = {k: torch.randn(q, hkv, 2 * dim, generator=gen).to(torch.bfloat16).to(dev)
             for k, (hkv, dim) in kinds.items()}  # the step's K/V rows as the layers wrote them
    hidden_states = torch.randn(q, hidden, generator=gen).to(dev)
    return SimpleNamespace(trees=trees, requests=requests, logits=logits, runner=runner, fresh=fresh,
                           hidden=hidden_states, scales=scales, kinds=kinds, embed=embed)


def step_before(s, gens):
    """The former path (see the module docstring)."""
    view = BlockMajorKVView()
    captured = {tr.req_id: {k: s.fresh[k][tr.q_start: tr.q_start + tr.num_rows].clone() for k in s.kinds}
                for tr in s.trees}  # do_kv_cache_update's per-tree, per-layer clones
    slots = s.runner.input_batch.block_table[0].slot_mapping.gpu
    np_scales = {k: (v[0].cpu().numpy(), v[1].cpu().numpy()) for k, v in s.scales.items() if k in LAYERS}
    for tr in s.trees:
        p = s.requests[tr.req_id].sampling_params
        dec = decide_one_tree(s.logits[tr.q_start: tr.q_start + tr.num_rows], tr.tokens, tr.parents,
                              p.temperature, p.top_k, p.top_p, tr.eps, gens[tr.req_id])
        path = dec["path_rows"]
        moves = [(i + 1, r) for i, r in enumerate(path) if r != i + 1]
        rows = torch.tensor([0] + path)
        for k, (_hkv, dim) in s.kinds.items():
            cap = captured[tr.req_id][k]
            if moves:
                dst = torch.tensor([i for i, _ in moves]).to(slots.device)
                src = torch.tensor([r for _, r in moves]).to(slots.device)
                kv = cap[src]
                cache = s.runner.compilation_config.static_forward_context[k].kv_cache
                view.scatter(cache, slots[tr.q_start + dst], kv[..., :dim], kv[..., dim:])
            if k in LAYERS:
                kk = cap[rows.to(cap.device)].cpu().clone().float()
                quantize(kk[..., :dim].numpy(), np_scales[k][0])
                quantize(kk[..., dim:].numpy(), np_scales[k][1])
        e = s.embed[dec["bonus"] % 64].float().cpu().clone()
        h = s.hidden[tr.q_start + (path[-1] if path else 0)].float().cpu().clone()
        quantize(e.numpy(), np.full(e.shape, 0.02, np.float32))
        quantize(h.numpy(), np.full(h.shape, 0.02, np.float32))


def step_after(s, gen_for):
    st = tree_step.StepTrees.build(s.trees, [tr.q_start for tr in s.trees], s.logits.device)
    dec = tree_step.decide(s.runner, st, s.logits, gen_for)
    tree_step.compact(s.runner, st, dec.verdict)
    handoff_step.handoff(s.runner, st, dec, s.hidden)


def measure(fn, dev, reps):
    fn()  # warm-up (lazy imports, first-use caches)
    times, moved = [], []
    for _ in range(reps):
        _sync(dev)
        with Transfers() as tr:
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        moved.append((tr.bytes, tr.calls))
    return {"host_ms": 1e3 * statistics.median(times), "d2h_bytes": moved[-1][0], "d2h_calls": moved[-1][1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", type=int, default=32)
    ap.add_argument("--rows", type=int, default=33)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--context", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2, help="cache-owning layers compacted (>= 2; 30 on Gemma 4)")
    ap.add_argument("--hidden", type=int, default=None, help="LM-head width for the forward (default 2816 on GPU)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(1)  # a shared, loaded box: OpenMP spinning would dominate small ops
    hidden = args.hidden or (2816 if dev.type == "cuda" else 256)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.trees * args.rows, hidden, generator=g).to(dev, torch.bfloat16 if dev.type == "cuda"
                                                                      else torch.float32)
    w = torch.randn(hidden, args.vocab, generator=g).to(dev, x.dtype)
    fwd = measure(lambda x=x, w=w: x @ w, dev, args.reps)["host_ms"]
    del w
    result = {"env": env_info(), "device": str(dev), "label": "CPU-measured" if dev.type == "cpu" else str(dev),
              "trees": args.trees, "rows": args.rows, "vocab": args.vocab, "layers": args.layers,
              "forward_lm_head_ms": fwd, "forward_hidden": hidden, "scenarios": {}}
    for name, sampled in (("greedy", False), ("sampled_topk64_eps", True)):
        s = build_step(args, dev, sampled)
        gens_b = {tr.req_id: torch.Generator().manual_seed(7) for tr in s.trees}
        gens_a = {tr.req_id: torch.Generator().manual_seed(7) for tr in s.trees}
        before = measure(lambda s=s, g=gens_b: step_before(s, g), dev, args.reps)
        after = measure(lambda s=s, g=gens_a: step_after(s, lambda rid, p: g[rid]), dev, args.reps)
        row = {"before": before, "after": after,
               "bytes_ratio": before["d2h_bytes"] / max(after["d2h_bytes"], 1),
               "host_ms_ratio": before["host_ms"] / max(after["host_ms"], 1e-9)}
        result["scenarios"][name] = row
        print(f"{name:20s} d2h bytes {before['d2h_bytes']:>13,} -> {after['d2h_bytes']:>9,} "
              f"(x{row['bytes_ratio']:.0f}, calls {before['d2h_calls']} -> {after['d2h_calls']})  host ms "
              f"{before['host_ms']:8.1f} -> {after['host_ms']:7.1f} (x{row['host_ms_ratio']:.1f})  "
              f"forward (LM head, hidden {hidden}) {fwd:.1f} ms", flush=True)
        del s
    print("wrote", write_json("bench_verify_host", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
