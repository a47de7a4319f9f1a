"""The SLM Drafter's 32-row step through the same pipeline as the MTP step (export, QDQ, QNN, ladder).

Calibration feeds come from an ``SlmDrafter`` run on the torch float step: a random prefill of up to W
committed tokens, then one-pass trees (root + a chain + siblings), recorded as the static graph sees them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mobile_client.drafters.slm import (
    ROWS,
    SlmDrafter,
    SlmStep,
    slm_input_names,
    slm_output_names,
    torch_slm_step,
)
from mobile_client.drafters.spec import SlmSpec
from mobile_client.export.pipeline import StepArtifacts, build_step, fake_quant_copy, write_golden

SLM_WINDOW = 1024  # full layers; sliding layers keep W / 2 = 512


def slm_feeds(
    spec: SlmSpec,
    step: SlmStep,
    sd: dict,
    keep_ids,
    window: int,
    n: int,
    seed: int = 0,
    max_prefill: int | None = None,
) -> list[dict[str, np.ndarray]]:
    """``n`` recorded step inputs: a prefill of random length in [0, max_prefill or W], then one 32-row
    tree forward (the ring shape is always W / W/2; a short prefill only leaves columns masked)."""
    from mobile_client.tree import DraftTree, frontier_plan

    rng = np.random.default_rng(seed)
    inner = torch_slm_step(step)
    last: list[dict[str, np.ndarray]] = []

    def recording(feeds):
        last[:] = [{k: v.copy() for k, v in feeds.items()}]
        return inner(feeds)

    out = []
    for _ in range(n):
        d = SlmDrafter(spec, sd, keep_ids, window=window, step=recording)
        d.prefill(rng.integers(0, spec.vocab, int(rng.integers(0, (max_prefill or window) + 1))).tolist())
        parents = [-1] + [int(rng.integers(0, j)) for j in range(1, ROWS)]
        d.forward_rows(
            frontier_plan(DraftTree.make_dummy(rng.integers(0, spec.vocab, ROWS).tolist(), parents))
        )
        out.append(last[0])
    return out


def build_slm_step(
    out: Path,
    spec: SlmSpec,
    sd: dict,
    keep_ids,
    compile: bool = True,
    emulate: bool = True,
    n_calib: int = 6,
    n_golden: int = 1,
    window: int = SLM_WINDOW,
    max_prefill: int | None = None,
) -> tuple[StepArtifacts, dict]:
    step = SlmStep.from_hf_state_dict(spec, {k: v.float() for k, v in sd.items()}, keep_ids)
    names, outs = slm_input_names(spec), slm_output_names(spec)
    feeds = slm_feeds(spec, step, sd, keep_ids, window, n_calib + n_golden, seed=2, max_prefill=max_prefill)
    qstep = fake_quant_copy(step, feeds[:n_calib], names)
    art = build_step("slm", qstep, out, names, outs, feeds[:n_calib], compile=compile)
    ladder = write_golden(out / "slm_golden.npz", step, qstep, art, feeds[n_calib:], names, emulate and compile)
    return art, ladder
