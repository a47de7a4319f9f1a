"""The MTP Drafter: the verifier's Gemma-4 assistant head as a static one-query step (paper Algorithm 2).

``MtpHead`` is the graph: one query over a W-column K/V ring per hand-off layer (the verifier's last
sliding-window and last full-attention layer), RMSNorm decomposed, the query's rotary tables fed by the
CPU, logits only over the keep set. ``MtpDrafter`` is the CPU side around it: the rings filled from the
hand-off's 8-bit rows, the per-layer window masks, K = 4 greedy steps with the runner-up at steps <= D = 2
(or K sampled steps, ``mobile_client.drafters.sampling``), and the 8-bit embedding table for its own drafted
tokens.

Inputs follow docs/decisions.md D1 (what vLLM's Gemma-4 MTP proposer feeds the assistant):
``z = [e(x) * sqrt(H) ; h]`` with h the verifier's hidden state *after* its final norm, keys already
rotated, and the query at the last committed position t - 1 for every step (vLLM's
``constant_draft_positions``). Transformers' ``Gemma4AssistantForCausalLM`` gives the same outputs when
called with ``position_ids = t - 1`` (it defaults to t) and K/V cut to each layer's window.

>>> from mobile_client.drafters.spec import toy_mtp_spec, random_mtp_state_dict
>>> spec = toy_mtp_spec()
>>> head = MtpHead.from_hf_state_dict(spec, random_mtp_state_dict(spec), keep_ids=list(range(100)))
>>> head.lm_head.weight.shape
torch.Size([100, 64])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from mobile_client.drafters.layers import (
    GatedMLP,
    RMSNorm,
    grouped_attention,
    keep_lm_head,
    load_into,
    rotate,
    softcap,
)
from mobile_client.drafters.sampling import DraftSampling, chain_token
from mobile_client.drafters.spec import FULL, SLIDING, MtpSpec
from mobile_client.quant.fakequant import ActQuant

#: graph input and output names of the MTP step (ONNX, QNN context and the torch backend agree on them)
MTP_INPUTS = (
    "z",
    "k_sliding",
    "v_sliding",
    "k_full",
    "v_full",
    "mask_sliding",
    "mask_full",
    "cos_sliding",
    "sin_sliding",
    "cos_full",
    "sin_full",
)
MTP_OUTPUTS = ("logits", "h")


class QOnlyAttention(nn.Module):
    """Query projection + q_norm + RoPE, attention over external K/V, output projection."""

    def __init__(self, spec: MtpSpec, kind: str):
        super().__init__()
        self.heads, self.d, self.kvh = spec.num_heads, spec.head_dim(kind), spec.attn[kind].kv_heads
        self.q_proj = nn.Linear(spec.hidden, self.heads * self.d, bias=False)
        self.q_norm = RMSNorm(self.d, spec.eps)
        self.o_proj = nn.Linear(self.heads * self.d, spec.hidden, bias=False)
        self.q_scores, self.q_probs, self.q_out = ActQuant(), ActQuant(), ActQuant()

    def forward(self, x, k, v, mask, cos, sin):
        # x [1, hidden]; k, v [kvh, W, d]; mask [1, W]; cos, sin [1, d]
        q = rotate(self.q_norm(self.q_proj(x).reshape(self.heads, self.d)), cos, sin)  # [heads, d]
        q = q.reshape(self.kvh, self.heads // self.kvh, self.d)
        o = grouped_attention(q, k, v, mask, (self.q_scores, self.q_probs))  # [kvh, g, d]
        return self.o_proj(self.q_out(o.reshape(1, self.heads * self.d)))


class MtpLayer(nn.Module):
    def __init__(self, spec: MtpSpec, kind: str):
        super().__init__()
        self.kind = kind
        self.self_attn = QOnlyAttention(spec, kind)
        self.mlp = GatedMLP(spec.hidden, spec.intermediate)
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, n, RMSNorm(spec.hidden, spec.eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.q_res = ActQuant()

    def forward(self, x, k, v, mask, cos, sin):
        a = self.self_attn(self.input_layernorm(x), k, v, mask, cos, sin)
        x = self.post_attention_layernorm(a) + x
        x = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))) + x
        return self.q_res(x * self.layer_scalar)


class MtpHead(nn.Module):
    """One static MTP step. Shapes (W = ring columns, Vk = keep-set size):

    z [1, 2H] · k_/v_sliding [kvh_s, W, d_s] · k_/v_full [kvh_f, W, d_f] · mask_* [1, W] (1 = live column)
    · cos_/sin_* [1, d] (the query's position) -> logits [1, Vk] (soft-capped), h [1, H] (next step's h).
    """

    def __init__(self, spec: MtpSpec, keep_size: int):
        super().__init__()
        self.spec = spec
        self.pre_projection = nn.Linear(2 * spec.backbone, spec.hidden, bias=False)
        self.layers = nn.ModuleList(MtpLayer(spec, kind) for kind in spec.layer_types)
        self.norm = RMSNorm(spec.hidden, spec.eps)
        self.post_projection = nn.Linear(spec.hidden, spec.backbone, bias=False)
        self.lm_head = nn.Linear(spec.hidden, keep_size, bias=False)  # untied, rows = keep set
        self.q_in, self.q_logits, self.q_h = ActQuant(), ActQuant(), ActQuant()

    @classmethod
    def from_hf_state_dict(cls, spec: MtpSpec, sd: dict[str, torch.Tensor], keep_ids: Sequence[int]):
        """Load ``Gemma4AssistantForCausalLM`` weights; the (tied) lm_head is sliced to ``keep_ids``."""
        head = cls(spec, len(keep_ids))
        mapped = {("model." + k if k.startswith(("layers.", "norm.")) else k): k for k in head.state_dict()}
        sub = {k: sd[hf] for hf, k in mapped.items() if hf in sd}
        sub["lm_head.weight"] = keep_lm_head(sd, keep_ids)
        load_into(head, sub)
        return head.eval()

    def forward(
        self,
        z,
        k_sliding,
        v_sliding,
        k_full,
        v_full,
        mask_sliding,
        mask_full,
        cos_sliding,
        sin_sliding,
        cos_full,
        sin_full,
    ):
        rings = {
            SLIDING: (k_sliding, v_sliding, mask_sliding, cos_sliding, sin_sliding),
            FULL: (k_full, v_full, mask_full, cos_full, sin_full),
        }
        x = self.pre_projection(self.q_in(z))  # [1, hidden]
        for layer in self.layers:
            x = layer(x, *rings[layer.kind])
        x = self.norm(x)
        logits = self.q_logits(softcap(self.lm_head(x), self.spec.softcap))  # [1, Vk]
        return logits, self.q_h(self.post_projection(x))  # [1, H]


class EmbedLut:
    """8-bit table of the verifier's ``e(x) * sqrt(H)`` over the keep set (int8 rows, one fp32 scale per row).

    Shape: table [Vk, H] int8, scale [Vk] float32.
    """

    def __init__(self, table: np.ndarray, scale: np.ndarray):
        self.table, self.scale = table, scale

    @classmethod
    def from_embedding(cls, embed: torch.Tensor, keep_ids: Sequence[int], bits: int | None = 8) -> EmbedLut:
        """``embed`` [vocab, H] is the verifier's ``embed_tokens`` weight; ``bits=None`` keeps floats
        (the float reference)."""
        rows = embed[torch.as_tensor(list(keep_ids), dtype=torch.long)].float() * math.sqrt(embed.shape[1])
        if bits is None:
            return cls(rows.numpy(), np.ones(len(rows), np.float32))
        assert bits == 8, "the phone's table is 8-bit"
        scale = rows.abs().amax(1).clamp_min(1e-12) / 127.0
        q = torch.clamp(torch.round(rows / scale[:, None]), -127, 127).to(torch.int8)
        return cls(q.numpy(), scale.numpy().astype(np.float32))

    def __getitem__(self, keep_index: int) -> np.ndarray:
        return self.table[keep_index].astype(np.float32) * self.scale[keep_index]  # [H]

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + self.scale.nbytes


@dataclass
class MtpDraft:
    chain: list[int]  # K token ids (full-vocabulary ids)
    runner_ups: list[int]  # D token ids, the second-ranked token of steps 1..D
    chain_keep_idx: list[int]  # the chain's indices into the keep set
    # sampled drafts: per step, the (full-vocabulary ids, uint16 weights) it was drawn from; None: greedy
    chain_q: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None


StepFn = Callable[[dict[str, np.ndarray]], tuple[np.ndarray, np.ndarray]]


def torch_step(head: nn.Module) -> StepFn:
    """A backend that runs ``head`` (float or fake-quant) on numpy feeds named as MTP_INPUTS."""

    @torch.no_grad()
    def run(feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        logits, h = head(*(torch.from_numpy(feeds[n]) for n in MTP_INPUTS))
        return logits.numpy(), h.numpy()

    return run


def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Symmetric int8 -> float: ``x = q * scale``; scale [kvh, d] (fixed per channel) broadcasts over rows.
    The convention is the wire format's (``vllm_hyco.handoff.quant``, vLLM-free)."""
    from vllm_hyco.handoff.quant import dequantize

    return dequantize(q, scale)


class MtpDrafter:
    """Algorithm 2 on the phone. State: one W-column ring per hand-off layer; live positions [ell, t0).

    Typical round::

        drafter.apply_handoff(t, a, {"sliding_attention": (k, v), "full_attention": (k, v)})
        draft = drafter.draft(x_hat)  # x_hat = [e(root) * sqrt(H) ; h], 2H floats

    where k, v are [t - a, kvh, d] float rows of positions [a, t) (use ``dequantize_rows`` on the wire's
    int8 rows first).
    """

    def __init__(
        self,
        spec: MtpSpec,
        keep_ids: Sequence[int],
        lut: EmbedLut,
        step: StepFn,
        window: int = 1024,
        k: int = 4,
        d: int = 2,
    ):
        self.spec, self.keep_ids, self.lut, self.step = spec, np.asarray(keep_ids), lut, step
        self.window, self.k, self.d = window, k, d
        self.rings = {
            kind: (
                np.zeros((a.kv_heads, window, a.head_dim), np.float32),
                np.zeros((a.kv_heads, window, a.head_dim), np.float32),
            )
            for kind, a in spec.attn.items()
        }
        self.pos = np.full(window, -1, np.int64)  # absolute position held by each column
        self.ell, self.t0 = 0, -1

    def apply_handoff(self, t: int, a: int, rows: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Write the rows of positions [a, t) into column p mod W (lines 3-5 of Algorithm 2)."""
        if a != self.t0:  # a new request (or a resync): start over
            for k_ring, v_ring in self.rings.values():
                k_ring.fill(0.0)
                v_ring.fill(0.0)
            self.pos.fill(-1)
            self.ell = a
        for kind, (k_rows, v_rows) in rows.items():
            assert k_rows.shape[0] == t - a, (kind, k_rows.shape, t, a)
            keep = slice(max(0, t - a - self.window), t - a)  # only the last W rows can survive
            cols = np.arange(a, t)[keep] % self.window
            k_ring, v_ring = self.rings[kind]
            k_ring[:, cols] = np.transpose(k_rows[keep], (1, 0, 2))
            v_ring[:, cols] = np.transpose(v_rows[keep], (1, 0, 2))
        self.pos[np.arange(max(a, t - self.window), t) % self.window] = np.arange(max(a, t - self.window), t)
        self.t0 = t
        self.ell = max(self.ell, t - self.window)

    def feeds(self, z: np.ndarray) -> dict[str, np.ndarray]:
        """The step's inputs for the current ring and ``z`` [2H]; the query sits at t - 1 (D1)."""
        t = self.t0
        out = {"z": z.reshape(1, -1).astype(np.float32)}
        for kind, name in ((SLIDING, "sliding"), (FULL, "full")):
            lo = self.ell if kind == FULL else max(self.ell, t - self.spec.sliding_window)
            out[f"mask_{name}"] = ((self.pos >= lo) & (self.pos < t)).astype(np.float32)[None]
            out[f"k_{name}"], out[f"v_{name}"] = self.rings[kind]
            cos, sin = self.spec.rope[kind].cos_sin(torch.tensor([t - 1]), self.spec.head_dim(kind))
            out[f"cos_{name}"], out[f"sin_{name}"] = cos.numpy(), sin.numpy()
        return out

    def draft(self, x_hat: np.ndarray, sampling: DraftSampling | None = None) -> MtpDraft:
        """K steps over the ring (lines 7-13): chain, runner-ups at steps <= D, first among equals.

        Greedy (``sampling`` None or its temperature ~ 0): each chain token is the argmax. Sampled: each is
        drawn from the step's quantized distribution (``sampling.draft_distribution``), returned in
        ``chain_q``; the runner-up is then the best token other than the drawn one. The next step's input is
        the chain token's embedding either way (the sampling is host-side, after ``self.step``)."""
        assert self.t0 > 0, "apply a hand-off first"
        sampled = sampling is not None and not sampling.greedy
        feeds = self.feeds(np.asarray(x_hat, np.float32))
        chain, runners, idx, qs = [], [], [], []
        for step in range(1, self.k + 1):
            logits, h = self.step(feeds)
            i, q, second = chain_token(logits, self.keep_ids, sampling if sampled else None, step <= self.d)
            chain.append(int(self.keep_ids[i]))
            idx.append(i)
            qs += [q] if q is not None else []
            runners += [second] if second is not None else []
            feeds["z"] = np.concatenate([self.lut[i], h.reshape(-1)])[None].astype(np.float32)
        return MtpDraft(chain, runners, idx, qs if sampled else None)
