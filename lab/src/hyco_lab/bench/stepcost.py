"""Where a step's server time goes: HyCo trees against vLLM's MTP, per component, at 1 and N requests.

``python -m hyco_lab.bench.stepcost --requests 1,16 --nodes 4,32 --steps 24 [--tree-attn padded,loop]
[--shape tree,chain] [--chain-attn stock,tree] [--mtp-k 2,4] [--fixtures DIR] [--out F]``

One engine per setup, in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; each setup in its own child
process so the two engines never share one), on the bench fixtures. HyCo: ``n`` sessions submit a tree of
``nodes`` nodes each round, all in the same step (``HycoEngine.submit_many``); the trees are value-ordered
chains of the greedy continuation planted at depth 0..3 plus random siblings, so every round commits a few
tokens. MTP: ``n`` plain requests with vLLM's MTP (K = 4, or each of ``--mtp-k``) decode. Each component is
timed with process CPU time by wrapping it with a recorded ``Patch`` (``PROFILE_PATCHES``; the wrappers' own
cost is inside the totals; a few microseconds a call), per step:

* ``step``: ``EngineCore.step`` (schedule + model call + sampling + update) + ``post_step``
* ``forward``: the runner's ``_model_forward`` (all layers; HyCo's tree attention is inside it)
* ``tree_attn``: HyCo's tree-row recompute in the attention override: the K/V gathers and the attention (per
  tree with ``loop``, the padded layout and one call per layer with ``padded``; the Python around them is in
  ``forward``)
* ``logits``: ``compute_logits``
* ``decide`` / ``compact`` / ``handoff`` / ``plan``: ``worker/tree_step.py``, ``worker/handoff_step.py``: the
  tree decision, KV compaction, int8 hand-off, step index tensors
* ``schedule`` / ``update``: the scheduler's ``schedule`` / ``update_from_output`` (HyCo's cut included)
* ``utility``: the scheduler's side of the HyCo utility calls (tree submission, verdict take): once per session
  per round
* ``propose``: MTP: vLLM's draft proposer (K sequential head steps)
* ``sample``: MTP: the rejection sampler; HyCo: ``decide``

Reported per step and per committed token (the CPU build: compare ratios within one run).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import multiprocessing as mp
import os
import random
import time
from collections import defaultdict
from collections.abc import Iterator

from vllm_hyco.vllm_adapter.patches import Patch

COMPONENTS = ("step", "forward", "tree_attn", "logits", "plan", "decide", "compact", "handoff", "schedule",
              "update", "utility", "propose", "sample")


class Clock:
    """Process CPU seconds and calls per component; one per profiled process (:data:`CLOCK`)."""

    def __init__(self):
        self.cpu = defaultdict(float)
        self.calls = defaultdict(int)
        self.depth = defaultdict(int)

    def snapshot(self) -> dict:
        return {"cpu": dict(self.cpu), "calls": dict(self.calls)}


CLOCK = Clock()


def _timed(original, name: str):
    """``original`` with its process CPU time and calls counted under ``name`` (a ``Patch``'s ``make``)."""

    @functools.wraps(original)
    def timed(*a, **k):
        if CLOCK.depth[name]:  # recursion (a wrapped super() call): count the outer call only
            return original(*a, **k)
        CLOCK.depth[name] += 1
        c0 = time.process_time()
        try:
            return original(*a, **k)
        finally:
            CLOCK.depth[name] -= 1
            CLOCK.cpu[name] += time.process_time() - c0
            CLOCK.calls[name] += 1

    return timed


def _profile(target: str, attr: str, name: str) -> Patch:
    return Patch(target, attr, functools.partial(_timed, name=name),
                 why=f"the step profiler attributes process CPU time to its {name!r} component",
                 how=f"wrap {attr}: process CPU time and calls around the original (revert() restores it)",
                 upstream="none (a benchmark-only profiler)", removal="with this profiler")


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_WORKER = "vllm_hyco.vllm_adapter.worker"
_SCHED = "vllm_hyco.vllm_adapter.engine_core.scheduler:HycoScheduler"
# Every engine: the step, the forward, the logits. HyCo's: tree attention, the tree step, the scheduler, the
# utility calls. vLLM's MTP: the proposer, the rejection sampler, the scheduler. (Recorded Patch objects:
# tests/unit/test_vllm_surface.py checks the vLLM targets against vllm_adapter/surface.py.)
COMMON_PATCHES = [_profile("vllm.v1.engine.core:EngineCore", "step", "step"),
                  _profile("vllm.v1.engine.core:EngineCore", "post_step", "step"),
                  _profile(_RUNNER, "_model_forward", "forward"),
                  _profile("vllm.model_executor.layers.logits_processor:LogitsProcessor", "forward", "logits")]
HYCO_PATCHES = [_profile(f"{_WORKER}.cpu_attention", "tree_attention_dense_ref", "tree_attn"),
                _profile(f"{_WORKER}.cpu_attention", "tree_attention_padded", "tree_attn"),
                _profile(f"{_WORKER}.tree_plan:PaddedTrees", "build", "tree_attn"),
                _profile(f"{_WORKER}.kv_view:CpuAttnKVView", "gather", "tree_attn"),
                _profile(f"{_WORKER}.tree_step", "decide", "decide"),
                _profile(f"{_WORKER}.tree_step", "compact", "compact"),
                _profile(f"{_WORKER}.handoff_step", "handoff", "handoff"),
                _profile(f"{_WORKER}.tree_step:StepTrees", "build", "plan"),
                _profile(_SCHED, "schedule", "schedule"),
                _profile(_SCHED, "update_from_output", "update"),
                _profile(_SCHED, "hyco_submit_tree", "utility"),
                _profile(_SCHED, "hyco_take_verdict", "utility")]
MTP_PATCHES = [_profile(_RUNNER, "propose_draft_token_ids", "propose"),
               _profile("vllm.v1.sample.rejection_sampler:RejectionSampler", "forward", "sample"),
               _profile("vllm.v1.core.sched.scheduler:Scheduler", "schedule", "schedule"),
               _profile("vllm.v1.core.sched.scheduler:Scheduler", "update_from_output", "update")]
PROFILE_PATCHES = COMMON_PATCHES + HYCO_PATCHES + MTP_PATCHES


def _install(hyco: bool) -> Clock:
    """Apply this process's profile (each setup runs in its own child process) and return its clock."""
    for p in COMMON_PATCHES + (HYCO_PATCHES if hyco else MTP_PATCHES):
        p.apply()
    return CLOCK


def _prompts(n: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[2] + [rng.randrange(10, 4000) for _ in range(40)] for _ in range(n)]


def _tree(root: int, greedy: list[int], nodes: int, rng: random.Random, vocab: int,
          shape: str = "tree") -> tuple[list, list]:
    """A value-ordered tree: the greedy chain (depth 0..4 planted), then random siblings level by level;
    ``shape="chain"``: one chain of ``nodes`` nodes, the greedy continuation to depth 0..nodes planted and
    random tokens below it (what the adaptive cut keeps at low load: the MTP chain)."""
    depth = min(rng.randrange(0, 5 if shape == "tree" else nodes + 1), len(greedy))
    tokens, parents = [root], [-1]
    for d in range(depth):
        tokens.append(greedy[d])
        parents.append(d)
    if shape == "chain":
        while len(tokens) < nodes + 1:
            tokens.append(rng.randrange(10, vocab))
            parents.append(len(tokens) - 2)
        return tokens, parents
    chain = list(range(len(tokens)))
    used = {p: {tokens[p + 1]} if p + 1 < len(tokens) else set() for p in chain}
    while len(tokens) < nodes + 1:
        for p in chain:
            if len(tokens) >= nodes + 1:
                break
            tok = rng.randrange(10, vocab)
            if tok in used[p]:
                continue
            used[p].add(tok)
            tokens.append(tok)
            parents.append(p)
    return tokens, parents


@contextlib.contextmanager
def _profiled(path: str | None) -> Iterator[None]:
    """cProfile the block into ``path`` (``--cprofile``); nothing when ``path`` is None."""
    if path is None:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        prof.dump_stats(path)


def run_hyco(verifier: str, n: int, nodes: int, steps: int, tree_attn: str, out: dict,
             shape: str = "tree", chain_attn: str = "stock", cprofile: str | None = None) -> None:
    os.environ["VLLM_HYCO_CPU_TREE_ATTN"] = tree_attn
    os.environ["VLLM_HYCO_CHAIN_ATTN"] = chain_attn
    from vllm import LLM, SamplingParams

    clock = _install(hyco=True)
    llm = LLM(model=verifier, dtype="float32", max_model_len=1024, max_num_seqs=max(n, 1), enforce_eager=True,
              distributed_executor_backend="uni", skip_tokenizer_init=True, seed=0, enable_prefix_caching=False,
              speculative_config={"method": "hyco", "budget_policy": "static", "node_budget": nodes,
                                  "max_sessions": max(n, 1)})
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = _prompts(n)
    max_tokens = steps * 6 + 8
    refs = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                    ignore_eos=True), use_tqdm=False)]
    hy = HycoEngine(llm)
    rng = random.Random(0)
    handles = [hy.open(prompt_token_ids=p, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
               for p in prompts]
    st = {h.sid: {"root": h.root, "out": [], "round": 0, "ref": r} for h, r in zip(handles, refs)}
    warm = 3
    tokens, base = 0, None
    timed = contextlib.ExitStack()
    for r in range(steps + warm):
        if r == warm:
            base = clock.snapshot()
            timed.enter_context(_profiled(cprofile))
        batch = []
        for sid, s in st.items():
            toks, pars = _tree(s["root"], list(s["ref"][len(s["out"]):]), nodes, rng, vocab, shape)
            batch.append((sid, s["round"], toks, pars))
        for v in hy.submit_many(batch):
            s = st[v.sid]
            s["out"] += v.committed
            s["root"], s["round"] = v.bonus, s["round"] + 1
            if r >= warm:
                tokens += len(v.committed)
    timed.close()
    name = f"hyco-{shape}{nodes}" + ("" if tree_attn == "padded" else f"-{tree_attn}") \
        + ("" if shape == "tree" or chain_attn == "stock" else f"-{chain_attn}")
    out.update(_result(clock, base, tokens, name, n))


def run_mtp(verifier: str, assistant: str, n: int, steps: int, out: dict, k: int = 4,
            cprofile: str | None = None) -> None:
    from vllm import LLM, SamplingParams

    clock = _install(hyco=False)
    llm = LLM(model=verifier, dtype="float32", max_model_len=1024, max_num_seqs=max(n, 1), enforce_eager=True,
              distributed_executor_backend="uni", skip_tokenizer_init=True, seed=0, enable_prefix_caching=False,
              speculative_config={"method": "mtp", "model": assistant, "num_speculative_tokens": k})
    prompts = _prompts(n)
    params = SamplingParams(temperature=0.0, max_tokens=steps * 3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], SamplingParams(max_tokens=4), use_tqdm=False)
    base = clock.snapshot()
    with _profiled(cprofile):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    out.update(_result(clock, base, tokens, "cloud-mtp" + ("" if k == 4 else f"-k{k}"), n, prefill_tokens=0))


def _result(clock: Clock, base: dict, tokens: int, name: str, n: int, prefill_tokens: int = 0) -> dict:
    now = clock.snapshot()
    cpu = {k: now["cpu"].get(k, 0.0) - base["cpu"].get(k, 0.0) for k in COMPONENTS}
    calls = {k: now["calls"].get(k, 0) - base["calls"].get(k, 0) for k in COMPONENTS}
    steps = max(calls["forward"], 1)
    return {"config": name, "requests": n, "steps": steps, "tokens": tokens,
            "ms_per_step": {k: round(1e3 * v / steps, 3) for k, v in cpu.items()},
            "ms_per_token": {k: round(1e3 * v / max(tokens, 1), 3) for k, v in cpu.items()},
            "calls_per_step": {k: round(v / steps, 2) for k, v in calls.items()}}


def _child(target, args, kwargs, q):
    out: dict = {}
    try:
        target(*args, out, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported in the table
        out = {"error": repr(e)}
    q.put(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyco_lab.bench.stepcost", description=__doc__.split("\n")[0])
    p.add_argument("--requests", default="1,16")
    p.add_argument("--nodes", default="4,32")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--tree-attn", default="padded",
                   help="CPU tree attention paths to compare (VLLM_HYCO_CPU_TREE_ATTN), e.g. padded,loop")
    p.add_argument("--shape", default="tree", help="HyCo trees: tree (chain + siblings), chain, or both")
    p.add_argument("--chain-attn", default="stock",
                   help="chains' attention paths to compare (VLLM_HYCO_CHAIN_ATTN), e.g. stock,tree")
    p.add_argument("--mtp-k", default="4", help="vLLM's MTP chain lengths to compare, e.g. 2,4")
    p.add_argument("--fixtures", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--cprofile", default=None, metavar="DIR",
                   help="also write each setup's timed steps as cProfile stats, DIR/SETUP-REQUESTS.prof "
                        "(python -m pstats; the profiler's own cost inflates every component)")
    args = p.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # as the bench's servers (server.BenchServer.env): one passive OpenMP thread, no binding
    os.environ.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_WAIT_POLICY="PASSIVE")
    from hyco_lab.bench.server import RUNTIME_ENV

    for k, v in RUNTIME_ENV.items():
        os.environ.setdefault(k, v)
    from hyco_lab.bench.__main__ import fixtures_dir

    fx = fixtures_dir(args.fixtures)
    verifier, assistant = str(fx / "verifier"), str(fx / "assistant")
    jobs = []
    for n in [int(x) for x in args.requests.split(",")]:
        def prof(name: str, n: int = n) -> dict:
            return {"cprofile": os.path.join(args.cprofile, f"{name}-{n}.prof")} if args.cprofile else {}

        jobs += [(run_mtp, (verifier, assistant, n, args.steps), {"k": int(k)} | prof(f"cloud-mtp-k{k}"))
                 for k in args.mtp_k.split(",")]
        for nodes in [int(x) for x in args.nodes.split(",")]:
            for shape in args.shape.split(","):
                for mode in args.tree_attn.split(","):
                    for chain in (args.chain_attn.split(",") if shape == "chain" else ["stock"]):
                        jobs.append((run_hyco, (verifier, n, nodes, args.steps, mode),
                                     {"shape": shape, "chain_attn": chain}
                                     | prof(f"hyco-{shape}{nodes}-{mode}-{chain}")))
    if args.cprofile:
        os.makedirs(args.cprofile, exist_ok=True)
    ctx = mp.get_context("spawn")
    rows = []
    for target, a, kw in jobs:
        q = ctx.Queue()
        proc = ctx.Process(target=_child, args=(target, a, kw, q))
        proc.start()
        res = q.get()
        proc.join()
        rows.append(res)
        print(json.dumps(res), flush=True)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def table(rows: list[dict]) -> str:
    cols = [c for c in COMPONENTS if any(r.get("ms_per_step", {}).get(c) for r in rows)]
    head = "| setup | requests | tokens/step | " + " | ".join(f"{c} ms/step" for c in cols) + " | step ms/token |"
    lines = [head, "|" + "---|" * (len(cols) + 4)]
    for r in rows:
        if "error" in r:
            lines.append(f"| error | {r['error']} |")
            continue
        ms = r["ms_per_step"]
        lines.append(f"| {r['config']} | {r['requests']} | {r['tokens'] / r['steps']:.2f} | "
                     + " | ".join(f"{ms[c]:.2f}" for c in cols) + f" | {r['ms_per_token']['step']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
