"""Every numeric tolerance of the suite, written down once: (op, dtype) -> (atol, rtol).

Token ids are always compared exactly. Add a row here rather than a literal in a test.
"""

import torch

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    ("attention", torch.float32): (2e-5, 2e-5),
    ("attention", torch.float16): (2e-3, 2e-3),
    ("attention", torch.bfloat16): (1.6e-2, 1.6e-2),
    ("kv_copy", torch.float32): (0.0, 0.0),
    ("kv_copy", torch.float16): (0.0, 0.0),
    ("kv_copy", torch.bfloat16): (0.0, 0.0),
    ("probs", torch.float32): (1e-6, 1e-5),
    ("logits_engine_vs_prefill", torch.float32): (1e-3, 1e-3),
}


def tol(op: str, dtype: torch.dtype) -> dict[str, float]:
    """kwargs for torch.testing.assert_close / torch.allclose."""
    atol, rtol = TOLERANCES[(op, dtype)]
    return {"atol": atol, "rtol": rtol}

# mobile_client drafters (float torch reference vs transformers on the same weights)
TOLERANCES[("mtp_step", torch.float32)] = (1e-4, 1e-4)
TOLERANCES[("slm_logits", torch.float32)] = (1e-3, 1e-4)
TOLERANCES[("mtp_step_int8_kv", torch.float32)] = (0.25, 0.05)  # 8-bit K/V rows vs float rows, logits ~ +-30
# QNN agreement ladder (toy twins): max |a - b| / max |a| of the logits; top-1 equal and top-5 overlap >= 0.8
# are asserted beside it. Measured: sim->cpu-qdq 1e-4..5e-2, cpu-qdq->x86 HTP emulator 3e-3..1e-2.
TOLERANCES[("qnn_sim_vs_cpu_qdq", torch.float32)] = (0.1, 0.0)
TOLERANCES[("qnn_cpu_qdq_vs_htp_emulator", torch.float32)] = (0.03, 0.0)
# the same ladder for the MTP layer with its own KV (MiMo one-row step, toy config, W = 1,024;
# test_client_qnn_own_mtp.py). Measured: sim->cpu-qdq 1.1e-4..1.4e-4, cpu-qdq->x86 HTP emulator 1.2e-3..1.4e-3
TOLERANCES[("qnn_own_mtp_sim_vs_cpu_qdq", torch.float32)] = (0.01, 0.0)
TOLERANCES[("qnn_own_mtp_cpu_qdq_vs_htp_emulator", torch.float32)] = (0.02, 0.0)
# its drafter run row by row through the cpu-qdq step and the emulated step (rounds crossing the ring's wrap):
# max |diff| / max |x_hat| of each round's x_hat (the layer's output o); measured 5.8e-4..1.2e-3
TOLERANCES[("qnn_own_mtp_x_hat_cpu_qdq_vs_htp_emulator", torch.float32)] = (0.03, 0.0)
# engine: K/V a session's cache holds after tree rounds + compaction vs a fresh prefill of the same text
TOLERANCES[("kv_engine_vs_prefill", torch.float32)] = (1e-4, 1e-4)
# the same on the checkpoint-shaped fixture (128 random-router experts, top-8): a row's last-bit difference
# between the tree path and a prefill flips near-tied expert picks, measured up to 8.4e-4 in 1.6% of a
# later layer's K/V elements; a row written at the wrong position differs by O(1) (normed K and V)
TOLERANCES[("kv_engine_vs_prefill_moe128", torch.float32)] = (1e-2, 1e-2)
TOLERANCES[("qnn_sim_vs_cpu_qdq_worst_row", torch.float32)] = (0.1, 0.0)  # SLM: worst of the 32 tree rows
TOLERANCES[("qnn_cpu_qdq_vs_htp_emulator_worst_row", torch.float32)] = (0.15, 0.0)
# e2e soak: growth of the server's resident memory (API server + engine core) between the end of the
# drained first half and the drained second half of the soak, in MiB. Measured +2..+4 MiB per 60-s soak on a
# steady server; a first soak on a fresh server grew 96-120 MiB from a mark taken under load (warm-up)
TOLERANCES[("soak_server_rss_growth_mib", torch.float32)] = (64.0, 0.0)
# the engine-core process alone, measured the same way (test_e2e_soak.py; the slow RSS curve measures its
# growth over the second half of its phases). Measured +1.6 MiB per 60-s soak half and +2.0 MiB over the
# second half of an 8 x 30-s curve (4,109 sessions; docs/serving.md "Memory")
TOLERANCES[("soak_engine_core_rss_growth_mib", torch.float32)] = (48.0, 0.0)
