"""The MTP Drafter of a family whose MTP layer owns its KV cache (MiMo: ``vllm_hyco.models.mimo``).

The phone runs the verifier's first MTP layer itself and keeps that layer's KV cache: a ring of W columns,
column p mod W. Each round's hand-off carries h_p, the verifier's hidden state (before its final norm) of
every position committed since the last one, as int8 rows (hand-off schema 3, a ``hidden`` row layer). The
phone holds the committed tokens, so it can pair each h_p with x_{p+1} exactly as vLLM's ``mimo_mtp`` drafter
reads its inputs:

    o_p = final_norm(block(input_proj([hidden_norm(h_p) ; token_norm(e(x_{p+1}))]), position p))

(``e`` is zeroed at position 0), writing the block's K/V at p. ``apply_handoff(t, a, h_rows, tokens)`` runs
the rows of positions [a, t) in one forward; a is the previous round's root position, so the chain rows the
last ``draft`` wrote at positions >= a are overwritten by committed ones. The last row's output o_{t-1}
predicts x_{t+1} (x_t is the bonus, the next root) and is the round's ``x_hat``. ``draft`` then chains K
steps as vLLM's ``EagleProposer`` does: step k's token is drawn from ``lm_head(o)``, and step k + 1 runs the
layer on (h = o, that token) at position t - 1 + k, attending every cached position up to it.

Weights: the verifier folder's ``model.mtp_layers.0.*``, its ``model.embed_tokens`` and ``lm_head``
(restricted to the keep set, as the Gemma-4 head's). Two backends: the torch layer over a round's rows at once,
or ``step``, a one-row static graph (:class:`OwnMtpStep`: the ring in, the row's K/V out, as ``mtp.MtpHead``
takes its K/V rings) run row by row. That step is the export path: ``export.build.build_own_mtp`` makes its
float ONNX, the W4/A16 QDQ graph and the QNN context for SM8850 / HTP v81 (``own_mtp_ctx.onnx``, CPU fallback
disabled), which ``bundle.own_mtp_drafter`` runs as ``step`` with ``backend="compiled"`` (docs/phone-build.md,
"The MiMo MTP layer"; on x86 the HTP emulator).

>>> cfg = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
...        "intermediate_size": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_hidden_layers": 2}
>>> sd = random_mimo_mtp_state_dict(cfg, vocab=11)
>>> d = OwnMtpDrafter(cfg, sd, keep_ids=list(range(11)), window=16)
>>> x_hat = d.apply_handoff(4, 0, np.ones((4, 8), np.float32), [1, 2, 3, 4, 5])
>>> x_hat.shape, len(d.draft(x_hat).chain)
((8,), 4)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn

from mobile_client.drafters.layers import RMSNorm, grouped_attention, keep_lm_head, load_into, rotate
from mobile_client.drafters.mtp import MtpDraft
from mobile_client.drafters.sampling import DraftSampling, chain_token
from mobile_client.drafters.spec import RopeSpec
from mobile_client.quant.fakequant import ActQuant
from vllm_hyco.errors import ConfigError, SessionError

#: the checkpoint's name for the MTP layer the phone runs (vLLM 0.32 drafts with layer 0 only)
PREFIX = "model.mtp_layers.0."
#: graph inputs and outputs of the one-row static step (ONNX and the torch step backend agree on them)
STEP_INPUTS = ("h", "e", "k_ring", "v_ring", "mask", "cos", "sin")
STEP_OUTPUTS = ("o", "logits", "k_row", "v_row")


class OwnMtpLayer(nn.Module):
    """MiMo's MTP layer (HF names): the two input norms, ``input_proj``, a Qwen2 decoder block, the final norm."""

    def __init__(self, cfg: dict):
        super().__init__()
        hid, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        self.heads, self.kvh = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
        self.d = int(cfg.get("head_dim") or hid // self.heads)
        inter = int(cfg["intermediate_size"])
        self.rope = RopeSpec(_rope_theta(cfg))
        self.token_layernorm, self.hidden_layernorm = RMSNorm(hid, eps), RMSNorm(hid, eps)
        self.input_proj = nn.Linear(2 * hid, hid, bias=False)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(hid, eps), RMSNorm(hid, eps)
        self.final_layernorm = RMSNorm(hid, eps)
        attn = nn.Module()
        attn.q_proj = nn.Linear(hid, self.heads * self.d)
        attn.k_proj = nn.Linear(hid, self.kvh * self.d)
        attn.v_proj = nn.Linear(hid, self.kvh * self.d)
        attn.o_proj = nn.Linear(self.heads * self.d, hid, bias=False)
        mlp = nn.Module()
        mlp.gate_proj, mlp.up_proj = nn.Linear(hid, inter, bias=False), nn.Linear(hid, inter, bias=False)
        mlp.down_proj = nn.Linear(inter, hid, bias=False)
        self.self_attn, self.mlp = attn, mlp

    def forward(self, h: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, k_ring: torch.Tensor,
                v_ring: torch.Tensor, ring_pos: torch.Tensor) -> torch.Tensor:
        """Rows [n, hidden] at ``positions`` [n]: write their K/V into the rings ([kvh, W, d], ``ring_pos`` [W]
        the position each column holds, updated here), attend causally over the ring, return o [n, hidden]."""
        window = k_ring.shape[1]
        e = torch.where(positions[:, None] == 0, torch.zeros_like(e), e)
        x = self.input_proj(torch.cat([self.hidden_layernorm(h), self.token_layernorm(e)], dim=-1))
        a = self.self_attn
        y = self.input_layernorm(x)
        n = y.shape[0]
        cos, sin = self.rope.cos_sin(positions, self.d)  # [n, d]
        q = rotate(a.q_proj(y).view(n, self.heads, self.d), cos[:, None], sin[:, None])
        k = rotate(a.k_proj(y).view(n, self.kvh, self.d), cos[:, None], sin[:, None])
        cols = positions % window
        k_ring[:, cols] = k.transpose(0, 1)
        v_ring[:, cols] = a.v_proj(y).view(n, self.kvh, self.d).transpose(0, 1)
        ring_pos[cols] = positions
        live = (ring_pos[None, :] >= 0) & (ring_pos[None, :] <= positions[:, None]) \
            & (ring_pos[None, :] > positions[:, None] - window)  # [n, W]
        g = self.heads // self.kvh
        qg = q.view(n, self.kvh, g, self.d).permute(1, 2, 0, 3).reshape(self.kvh, g * n, self.d)
        scores = torch.matmul(qg, k_ring.transpose(-1, -2)) / math.sqrt(self.d)  # [kvh, g*n, W]
        scores = scores.masked_fill(~live.repeat(g, 1)[None], float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v_ring)  # [kvh, g*n, d]
        o = o.view(self.kvh, g, n, self.d).permute(2, 0, 1, 3).reshape(n, self.heads * self.d)
        resid = x + a.o_proj(o)
        m = self.mlp
        y = self.post_attention_layernorm(resid)
        y = m.down_proj(nn.functional.silu(m.gate_proj(y)) * m.up_proj(y))
        return self.final_layernorm(resid + y)


class OwnMtpStep(nn.Module):
    """One row of the MTP layer with static shapes, the export path (ONNX, then QNN): the ring is an input and
    the row's K/V are outputs the CPU writes into it. ``h``, ``e`` [1, hidden] (``e`` zeroed by the CPU at
    position 0); ``k_ring``, ``v_ring`` [kvh, W, d]; ``mask`` [1, W] 1 where a column holds a live earlier
    position; ``cos``, ``sin`` [1, d] of the row's position. Returns ``o`` [1, hidden], ``logits`` [1, V_keep],
    ``k_row``, ``v_row`` [kvh, d]. Softmax with the bounded mask fill of ``layers.masked_softmax``.

    Graph surgery for HTP: the biased q/k/v projections run on a [1, 1, hidden] row, so they export as MatMul +
    Add; on a 2-D row they export as Gemm, whose int4 per-channel weight QNN's HTP backend rejects (the weight's
    DequantizeLinear is left to the CPU, and the build disables CPU fallback). The ``ActQuant`` points are the
    16-bit activations of the fake-quant rung (identity until calibrated, off in the export)."""

    def __init__(self, layer: OwnMtpLayer, lm_head: torch.Tensor):
        super().__init__()
        self.layer = layer
        self.lm_head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head)
        self.q_h, self.q_e, self.q_scores, self.q_probs = ActQuant(), ActQuant(), ActQuant(), ActQuant()
        self.q_attn, self.q_act, self.q_out, self.q_logits = ActQuant(), ActQuant(), ActQuant(), ActQuant()
        self.q_k, self.q_v = ActQuant(), ActQuant()

    def forward(self, h, e, k_ring, v_ring, mask, cos, sin):
        lay, a = self.layer, self.layer.self_attn
        heads, kvh, d = lay.heads, lay.kvh, lay.d
        x = lay.input_proj(torch.cat([lay.hidden_layernorm(self.q_h(h)), lay.token_layernorm(self.q_e(e))], dim=-1))
        y = lay.input_layernorm(x).unsqueeze(0)  # [1, 1, hidden]: MatMul + Add, not Gemm (see above)
        q = rotate(a.q_proj(y).reshape(heads, d), cos, sin)
        k = self.q_k(rotate(a.k_proj(y).reshape(kvh, d), cos, sin))
        v = self.q_v(a.v_proj(y).reshape(kvh, d))
        keys = torch.cat([k_ring, k.unsqueeze(1)], dim=1)  # [kvh, W + 1, d]: the ring, then the row itself
        vals = torch.cat([v_ring, v.unsqueeze(1)], dim=1)
        live = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)  # [1, W + 1]
        qg = q.reshape(kvh, heads // kvh, d) * (1.0 / math.sqrt(d))
        o = grouped_attention(qg, keys, vals, live, (self.q_scores, self.q_probs))  # [kvh, g, d]
        resid = x + a.o_proj(self.q_attn(o.reshape(1, heads * d)))
        m = lay.mlp
        z = lay.post_attention_layernorm(resid)
        out = self.q_out(lay.final_layernorm(resid + m.down_proj(self.q_act(nn.functional.silu(m.gate_proj(z))
                                                                            * m.up_proj(z)))))
        return out, self.q_logits(self.lm_head(out)), k, v


def torch_own_step(module: OwnMtpStep):
    """A step backend running ``module`` on numpy feeds named as STEP_INPUTS (what a compiled step replaces)."""

    @torch.no_grad()
    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [t.numpy() for t in module(*(torch.from_numpy(feeds[n]) for n in STEP_INPUTS))]

    return run


def _rope_theta(cfg: dict) -> float:
    """The config's plain-rope theta (``rope_theta``, or transformers 5's ``rope_parameters``); scaled rope is
    refused rather than drafted with wrong positions."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type", "default")
    if kind != "default":
        raise ConfigError(f"the MTP layer's rope is {kind!r}; the phone's MTP layer implements plain rope only")
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


class OwnMtpDrafter:
    """Algorithm 2 for an MTP layer with its own KV (see the module docstring): a ``ChainDrafter``."""

    def __init__(self, cfg: dict, sd: dict[str, torch.Tensor], keep_ids: Sequence[int], *, window: int = 1024,
                 k: int = 4, d: int = 2, step=None):
        self.layer = OwnMtpLayer(cfg).eval()
        load_into(self.layer, sd, PREFIX)
        self.embed = sd["model.embed_tokens.weight"].to(torch.float32)  # [V, hidden]
        self.lm_head = keep_lm_head(sd, keep_ids).to(torch.float32)  # [V_keep, hidden]
        self.keep_ids = np.asarray(keep_ids)
        self.window, self.k, self.d = window, k, d
        kvh, hd = self.layer.kvh, self.layer.d
        self.k_ring, self.v_ring = torch.zeros(kvh, window, hd), torch.zeros(kvh, window, hd)
        self.ring_pos = torch.full((window,), -1, dtype=torch.int64)
        self.t0 = -1  # the next root's position after the last hand-off
        self.last_logits: np.ndarray | None = None  # the static step's logits of the last row it ran
        self.root: tuple[np.ndarray | None, np.ndarray | None] = (None, None)  # the last hand-off's x_hat, logits
        self.step = step  # None: the torch layer over many rows at once; else a one-row static step (STEP_INPUTS)

    def static_step(self) -> OwnMtpStep:
        """The one-row static module of this layer and head (export it, or run it with :func:`torch_own_step`)."""
        return OwnMtpStep(self.layer, self.lm_head).eval()

    def _rows(self, h: torch.Tensor, nxt: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer over rows (h [n, hidden], next tokens [n], positions [n]), their K/V written into the ring:
        in one torch forward, or row by row through the static step (its last row's logits over the keep set
        kept in ``last_logits``: the head ran in the step, so :meth:`draft` does not run it again)."""
        self.last_logits = None
        if self.step is None:
            return self.layer(h, self.embed[nxt], positions, self.k_ring, self.v_ring, self.ring_pos)
        out, logits = [], None
        for i, p in enumerate(int(x) for x in positions):
            e = self.embed[nxt[i: i + 1]] * float(p != 0)
            live = (self.ring_pos >= 0) & (self.ring_pos < p) & (self.ring_pos > p - self.window)
            cos, sin = self.layer.rope.cos_sin(torch.tensor([p]), self.layer.d)
            feeds = {"h": h[i: i + 1].numpy(), "e": e.numpy(), "k_ring": self.k_ring.numpy(),
                     "v_ring": self.v_ring.numpy(), "mask": live.float()[None].numpy(), "cos": cos.numpy(),
                     "sin": sin.numpy()}
            o, logits, k_row, v_row = self.step(feeds)
            col = p % self.window
            self.k_ring[:, col], self.v_ring[:, col] = torch.from_numpy(k_row), torch.from_numpy(v_row)
            self.ring_pos[col] = p
            out.append(torch.from_numpy(np.asarray(o)).reshape(1, -1))
        self.last_logits = np.asarray(logits, np.float32).reshape(-1)
        return torch.cat(out)

    @torch.no_grad()
    def apply_handoff(self, t: int, a: int, h_rows: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
        """Extend the cache with positions [a, t): ``h_rows`` [t - a, hidden] float, ``tokens`` the committed
        ids by position (at least t + 1 of them: x_{p+1} for every row). Returns x_hat = o_{t-1} [hidden]."""
        if a != self.t0:  # a new session, a seed or a resync: only the hand-off's rows are live
            self.ring_pos.fill_(-1)
        h = torch.as_tensor(np.asarray(h_rows, np.float32)).reshape(t - a, -1)
        if len(tokens) < t + 1:
            raise SessionError(f"hand-off rows up to position {t - 1} need the committed tokens up to {t}; the "
                               f"phone holds {len(tokens)}", code="bad_handoff")
        lo = max(a, t - self.window)  # only the last W rows can stay in the ring
        nxt = torch.as_tensor([int(x) for x in tokens[lo + 1: t + 1]], dtype=torch.long)
        o = self._rows(h[lo - a:], nxt, torch.arange(lo, t))
        self.t0 = t
        self.root = (o[-1].numpy(), self.last_logits)  # x_hat, and the step's logits of it (None in torch)
        return self.root[0]

    @torch.no_grad()
    def draft(self, x_hat: np.ndarray, sampling: DraftSampling | None = None) -> MtpDraft:
        """K steps: chain, runner-ups at steps <= D (greedy: argmax, first among equals; sampled: drawn from
        the step's quantized distribution, ``chain_q``), the chain's rows written past the root."""
        assert self.t0 > 0, "apply a hand-off first"
        sampled = sampling is not None and not sampling.greedy
        o = torch.as_tensor(np.asarray(x_hat, np.float32)).reshape(1, -1)
        # the compiled step's logits of the row, when it computed this x_hat; else the head on the CPU
        step_logits = self.root[1] if np.array_equal(np.asarray(x_hat), self.root[0]) else None
        chain, runners, idx, qs = [], [], [], []
        for step in range(1, self.k + 1):
            logits = step_logits if step_logits is not None else (o @ self.lm_head.T).reshape(-1).numpy()
            i, q, second = chain_token(logits, self.keep_ids, sampling if sampled else None, step <= self.d)
            chain.append(int(self.keep_ids[i]))
            idx.append(i)
            qs += [q] if q is not None else []
            runners += [second] if second is not None else []
            if step < self.k:  # the drafted token at position t - 1 + step, h = the last output
                pos = torch.tensor([self.t0 - 1 + step])
                o = self._rows(o, torch.tensor([chain[-1]]), pos)
                step_logits = self.last_logits
        return MtpDraft(chain, runners, idx, qs if sampled else None)


def random_mimo_mtp_state_dict(cfg: dict, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint's names (tests and doctests)."""
    g = torch.Generator().manual_seed(seed)
    layer = OwnMtpLayer(cfg)
    sd = {PREFIX + n: torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.1) + (p.dim() == 1) * 1.0
          for n, p in layer.named_parameters() if not n.endswith("bias")}
    sd.update({PREFIX + n: torch.zeros(p.shape) for n, p in layer.named_parameters() if n.endswith("bias")})
    hid = int(cfg["hidden_size"])
    sd["model.embed_tokens.weight"] = torch.randn(vocab, hid, generator=g)
    sd["lm_head.weight"] = torch.randn(vocab, hid, generator=g)
    return sd
