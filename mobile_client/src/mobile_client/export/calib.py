"""Calibration and golden feeds for the drafter steps.

Random-weight fixtures get synthetic feeds shaped like the phone's real inputs (rings partly filled,
masks per layer window, z = [8-bit LUT row ; h]); trained fixtures should pass captures of the verifier
instead (``feeds_from_captures``), which is what the paper's fixed ranges come from. The MTP layer with its
own KV (MiMo) records its one-row step's inputs from a drafter run over hand-offs and chains
(``own_mtp_feeds``): its ring, mask and rotary tables are the drafter's own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mobile_client.drafters.mtp import EmbedLut, MtpDrafter, MtpHead, torch_step
from mobile_client.drafters.own_mtp import OwnMtpDrafter, torch_own_step
from mobile_client.drafters.spec import MtpSpec


def mtp_feeds(
    spec: MtpSpec, head: MtpHead, lut: EmbedLut, keep_ids, window: int, n: int, seed: int = 0
) -> list[dict[str, np.ndarray]]:
    """``n`` step inputs from a drafter fed random hand-offs of random lengths (1 .. 1.5 W positions)."""
    rng = np.random.default_rng(seed)
    drafter = MtpDrafter(spec, keep_ids, lut, torch_step(head), window=window)
    out = []
    for _ in range(n):
        t = int(rng.integers(1, int(1.5 * window) + 1))
        rows = {
            kind: (
                rng.standard_normal((t, a.kv_heads, a.head_dim)).astype(np.float32),
                rng.standard_normal((t, a.kv_heads, a.head_dim)).astype(np.float32),
            )
            for kind, a in spec.attn.items()
        }
        drafter.apply_handoff(t, 0, rows)
        z = np.concatenate([lut[int(rng.integers(len(keep_ids)))], rng.standard_normal(spec.backbone)])
        out.append(drafter.feeds(z.astype(np.float32)))
        drafter.t0 = -1  # next feed is a new request
    return out


def own_mtp_feeds(
    drafter: OwnMtpDrafter, n: int, seed: int = 0, streams: list[tuple[np.ndarray, list[int]]] | None = None
) -> list[dict[str, np.ndarray]]:
    """``n`` one-row step inputs recorded from ``drafter`` (float torch step) on requests of random length.

    Each request hands off t positions (1 .. 1.5 W) in one forward of the torch layer, drafts a chain (step
    inputs h = the layer's own output), hands off the next round's rows (h = hand-off rows) and drafts again;
    the recorded steps are one-row feeds with the drafter's ring, mask and rotary tables. Feeds alternate
    between chain steps and hand-off rows. ``streams`` ((h [T, hidden], tokens [T + 1]) per request, e.g. a
    verifier's captured rows, :func:`load_streams`; each at least k + 2 rows) replace the random h rows (standard
    normal) and random tokens."""
    rng = np.random.default_rng(seed)
    recorded: list[tuple[str, dict[str, np.ndarray]]] = []
    inner, phase = torch_own_step(drafter.static_step()), ["chain"]

    def recording(feeds):
        recorded.append((phase[0], {k: v.copy() for k, v in feeds.items()}))
        return inner(feeds)

    hidden, vocab, window = drafter.layer.input_proj.out_features, len(drafter.embed), drafter.window
    out: list[dict[str, np.ndarray]] = []
    for i in range(n):
        if streams is not None:
            h, tokens = streams[i % len(streams)]
            t = int(rng.integers(1, len(h) - drafter.k))
        else:
            t = int(rng.integers(1, int(1.5 * window) + 1))
            h = rng.standard_normal((t + drafter.k + 1, hidden)).astype(np.float32)
            tokens = rng.integers(0, vocab, t + drafter.k + 2).tolist()
        step, drafter.step, drafter.t0 = drafter.step, None, -1  # a new request: the hand-off in one forward
        x_hat = drafter.apply_handoff(t, 0, h[:t], tokens)
        drafter.step, recorded[:] = recording, []
        phase[0] = "chain"
        drafter.draft(x_hat)
        t2 = t + 1 + int(rng.integers(0, drafter.k))  # the next round: the root and some accepted tokens
        phase[0] = "handoff"
        x_hat = drafter.apply_handoff(t2, t, h[t:t2], tokens)
        phase[0] = "chain"
        drafter.draft(x_hat)
        drafter.step = step
        kind = ("chain", "handoff")[i % 2]
        pick = [f for p, f in recorded if p == kind]
        out.append(pick[int(rng.integers(len(pick)))])
    return out


def load_streams(path: Path, hidden: int, k: int) -> list[tuple[np.ndarray, list[int]]]:
    """Captured hand-offs for :func:`own_mtp_feeds` from an .npz of ``h_<i>`` [T_i, hidden] h rows and
    ``tokens_<i>`` [T_i + 1] ids, i = 0 .. n - 1. Raises ConfigError naming the file and the stream when a key is
    missing or foreign, an ``h`` is not ``hidden`` wide, a stream has fewer than k + 2 rows (a hand-off of one
    position or more, then the next round's up to k rows past the root) or fewer than T + 1 ids."""
    from vllm_hyco.errors import ConfigError

    z = np.load(path)
    n = len(z.files) // 2
    want = {f"{kind}_{i}" for i in range(n) for kind in ("h", "tokens")}
    if not z.files or set(z.files) != want:
        raise ConfigError(f"{path}: a streams file holds h_<i> and tokens_<i> for i = 0 .. n - 1 and nothing else; "
                          f"got {sorted(z.files)}")
    out = []
    for i in range(n):
        h, tokens = z[f"h_{i}"], z[f"tokens_{i}"]
        if h.ndim != 2 or h.shape[1] != hidden:
            raise ConfigError(f"{path}: stream {i}: h_{i} is {list(h.shape)}; expected [T, {hidden}] (the MTP "
                              "layer's hidden size)")
        if len(h) < k + 2:
            raise ConfigError(f"{path}: stream {i}: h_{i} has {len(h)} rows; a stream needs at least k + 2 = "
                              f"{k + 2} (a hand-off, then a round of up to k = {k} rows past the root)")
        if tokens.ndim != 1 or len(tokens) < len(h) + 1:
            raise ConfigError(f"{path}: stream {i}: tokens_{i} is {list(tokens.shape)}; expected [T + 1] = "
                              f"[{len(h) + 1}] ids")
        out.append((h.astype(np.float32), tokens.tolist()))
    return out


def feeds_from_captures(captures: list[dict[str, np.ndarray]], names) -> list[dict[str, np.ndarray]]:
    """Captured step inputs (e.g. from the trained fixtures' verifier) -> feeds, checked for names."""
    for c in captures:
        missing = set(names) - set(c)
        assert not missing, f"capture lacks {sorted(missing)}"
    return [{n: np.asarray(c[n], np.float32) for n in names} for c in captures]
