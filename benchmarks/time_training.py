"""Time a few optimizer steps of each training stage and extrapolate to the default plan (docs/fixtures.md).

    python benchmarks/time_training.py [--steps 4] [--threads 1,2] [--out timing.json]

For each thread count: ``torch.set_num_threads(n)``, fresh models (``train.make_models``, the shipped shapes),
then for each stage (verifier, assistant, SLM) one warm-up step and ``--steps`` timed steps of the real
training loop (``train.train_lm`` / ``train.train_head``, bf16 autocast, AdamW, the plan's batch sizes),
and once the evaluation and calibration that ``train_all`` runs after training (validation losses, the
head's teacher-forced metrics, the hand-off scales). Wall seconds and this process's CPU seconds are both
recorded: on a shared box wall time includes waiting for a core. Estimate = plan steps x seconds per step
+ evaluation. No weights are written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from hyco_lab.fixtures import train


def _clock(fn, *args) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - t0, time.process_time() - c0


def time_stages(threads: int, steps: int) -> dict:
    torch.set_num_threads(threads)
    plan = dataclasses.replace(train.TrainPlan(), threads=threads, warmup=1)
    opts = train.fixture_options()
    blocks = train.token_blocks("train", plan.seq_len)
    val = train.token_blocks("validation", plan.seq_len)[: plan.eval_blocks]
    verifier, head, slm = train.make_models(opts, 4096, plan.seed)
    os.environ.setdefault("TQDM_DISABLE", "1")
    stages = {
        "verifier": (plan.verifier_steps, lambda n: train.train_lm(verifier, blocks, plan, n, plan.verifier_lr,
                                                                   "verifier")),
        "assistant": (plan.head_steps, lambda n: train.train_head(
            head, verifier, blocks, dataclasses.replace(plan, head_steps=n), opts.window)),
        "slm": (plan.slm_steps, lambda n: train.train_lm(slm, blocks, plan, n, plan.slm_lr, "slm")),
    }
    out: dict = {"threads": threads, "timed_steps": steps, "stages": {}}
    total_wall = total_cpu = 0.0
    for name, (plan_steps, run) in stages.items():
        _clock(run, 1)  # warm-up: allocator, autocast caches, first-call overheads
        wall, cpu = _clock(run, steps)
        per_wall, per_cpu = wall / steps, cpu / steps
        out["stages"][name] = {"plan_steps": plan_steps, "s_per_step_wall": round(per_wall, 3),
                               "s_per_step_cpu": round(per_cpu, 3), "stage_s_wall": round(per_wall * plan_steps, 1)}
        total_wall += per_wall * plan_steps
        total_cpu += per_cpu * plan_steps
        print(f"threads {threads} {name}: {per_wall:.3f} s/step wall, {per_cpu:.3f} CPU", file=sys.stderr, flush=True)

    def evaluate():
        for m in (verifier, head, slm):
            m.eval()
        train.lm_loss(verifier, val)
        train.lm_loss(slm, val)
        train.head_eval(head, verifier, val, plan.head_depth, opts.window)
        train.calibrate_scales(verifier, val)

    ev_wall, ev_cpu = _clock(evaluate)
    out["evaluation_s_wall"], out["evaluation_s_cpu"] = round(ev_wall, 1), round(ev_cpu, 1)
    out["estimate_min_wall"] = round((total_wall + ev_wall) / 60, 1)
    out["estimate_min_cpu"] = round((total_cpu + ev_cpu) / 60, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = [time_stages(int(t), args.steps) for t in args.threads.split(",") if t]
    text = json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "load_average": os.getloadavg(), "runs": rows}, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
