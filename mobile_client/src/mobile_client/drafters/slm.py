"""The SLM Drafter: a Gemma-4 E2B-shaped model run as ONE static forward over up to R = 32 tree rows.

``SlmStep`` is the graph (loads ``Gemma4ForCausalLM`` weights): token and per-layer embeddings come from
CPU lookup tables, each KV-producing layer reads a ring of the last committed tokens (W columns in full
layers, W/2 in sliding layers; the paper's 1,024 / 512) plus the rows' own K/V under the tree mask, and
the KV-shared trailing layers read their source layer's ring and rows. It returns soft-capped logits over
the keep set and the rows' new K/V.

``SlmDrafter`` is the CPU side and fits ``drafters.base.RowDrafter``: ``forward_rows(plan)`` runs a
``FrontierPlan`` (catch-up rows are committed at once), ``accept(tree_rows)`` moves the KV of the root and
the accepted path's computed rows into the ring (Algorithm 1 line 10; the path's uncomputed nodes and the
bonus are the next plan's catch-up rows and root), ``prefill(tokens)`` fills the ring for the first round
(docs/decisions.md D2: the prompt's last W tokens before its last one).

Keys enter the ring rotated, so a column keeps its absolute position wherever it sits.

>>> from mobile_client.drafters.spec import toy_slm_spec, random_slm_state_dict
>>> spec = toy_slm_spec()
>>> d = SlmDrafter(spec, random_slm_state_dict(spec), keep_ids=list(range(64)), window=32)
>>> d.prefill([5, 6, 7]); d.committed
3
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
from mobile_client.drafters.spec import FULL, SLIDING, SlmSpec
from mobile_client.quant.fakequant import ActQuant

ROWS = 32


def slm_input_names(spec: SlmSpec) -> list[str]:
    kv = [f"{kv}_{j}" for j in range(spec.first_shared) for kv in ("k", "v")]
    return [
        "x",
        "ple",
        "cos_sliding",
        "sin_sliding",
        "cos_full",
        "sin_full",
        "ring_mask_sliding",
        "ring_mask_full",
        "self_mask_sliding",
        "self_mask_full",
        *kv,
    ]


def slm_output_names(spec: SlmSpec) -> list[str]:
    return ["logits", *[f"{kv}_new_{j}" for j in range(spec.first_shared) for kv in ("k", "v")]]


class SlmAttention(nn.Module):
    def __init__(self, spec: SlmSpec, layer: int):
        super().__init__()
        kind = spec.layer_types[layer]
        a = spec.attn[kind]
        self.heads, self.d, self.kvh = spec.num_heads, a.head_dim, a.kv_heads
        self.produces_kv = layer < spec.first_shared
        self.q_proj = nn.Linear(spec.hidden, self.heads * self.d, bias=False)
        self.q_norm = RMSNorm(self.d, spec.eps)
        self.o_proj = nn.Linear(self.heads * self.d, spec.hidden, bias=False)
        if self.produces_kv:
            self.k_proj = nn.Linear(spec.hidden, self.kvh * self.d, bias=False)
            self.k_norm = RMSNorm(self.d, spec.eps)
            self.v_norm = RMSNorm(self.d, spec.eps, with_scale=False)
            if kind == SLIDING or not spec.k_eq_v:  # k_eq_v full layers: V from the K projection
                self.v_proj = nn.Linear(spec.hidden, self.kvh * self.d, bias=False)
        self.q_scores, self.q_probs, self.q_out = ActQuant(), ActQuant(), ActQuant()

    def new_kv(self, h, cos, sin):
        # h [R, hidden]; cos, sin [R, 1, d] -> k, v [kvh, R, d]
        rows = h.shape[0]
        raw_k = self.k_proj(h).reshape(rows, self.kvh, self.d)
        k = rotate(self.k_norm(raw_k), cos, sin)
        raw_v = self.v_proj(h).reshape(rows, self.kvh, self.d) if hasattr(self, "v_proj") else raw_k
        return k.transpose(0, 1), self.v_norm(raw_v).transpose(0, 1)

    def forward(self, h, cos, sin, k_all, v_all, mask):
        # h [R, hidden]; k_all, v_all [kvh, C, d]; mask [R, C] (0/1)
        rows = h.shape[0]
        q = rotate(self.q_norm(self.q_proj(h).reshape(rows, self.heads, self.d)), cos, sin)  # [R, heads, d]
        g = self.heads // self.kvh
        q = q.transpose(0, 1).reshape(self.kvh, g * rows, self.d)  # head h = kv head h // g
        o = grouped_attention(q, k_all, v_all, mask.repeat(g, 1), (self.q_scores, self.q_probs))
        o = o.reshape(self.heads, rows, self.d).transpose(0, 1).reshape(rows, self.heads * self.d)
        return self.o_proj(self.q_out(o))


class SlmLayer(nn.Module):
    def __init__(self, spec: SlmSpec, layer: int):
        super().__init__()
        self.index, self.kind, self.source = layer, spec.layer_types[layer], spec.kv_source(layer)
        self.self_attn = SlmAttention(spec, layer)
        self.mlp = GatedMLP(spec.hidden, spec.intermediate_of(layer))
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, n, RMSNorm(spec.hidden, spec.eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.ple_dim = spec.ple_dim
        if spec.ple_dim:
            self.per_layer_input_gate = nn.Linear(spec.hidden, spec.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(spec.ple_dim, spec.hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(spec.hidden, spec.eps)
        self.q_res = ActQuant()

    def forward(self, x, ple_i, cos, sin, kv: dict, masks: dict):
        h = self.input_layernorm(x)
        if self.self_attn.produces_kv:
            kv[self.index] = (kv[self.index][0], kv[self.index][1], *self.self_attn.new_kv(h, cos, sin))
        ring_k, ring_v, new_k, new_v = kv[self.source]
        k_all, v_all = torch.cat([ring_k, new_k], dim=1), torch.cat([ring_v, new_v], dim=1)
        x = self.post_attention_layernorm(self.self_attn(h, cos, sin, k_all, v_all, masks[self.kind])) + x
        x = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))) + x
        if self.ple_dim:
            gate = nn.functional.gelu(self.per_layer_input_gate(x), approximate="tanh") * ple_i
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return self.q_res(x * self.layer_scalar)


class SlmStep(nn.Module):
    """One static SLM forward. Shapes (R rows, Wk ring columns of layer kind k, Vk keep-set size, L layers):

    x [R, hidden] (= e(token) * sqrt(hidden), CPU table) · ple [R, L, P] (token part of the per-layer
    embeddings, CPU table) · cos_/sin_* [R, d] · ring_mask_* [R, Wk] · self_mask_* [R, R] (1 = attend) ·
    k_j / v_j [kvh, Wk, d] per KV-producing layer j -> logits [R, Vk], k_new_j / v_new_j [kvh, R, d].
    """

    def __init__(self, spec: SlmSpec, keep_size: int):
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(SlmLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden, spec.eps)
        self.lm_head = nn.Linear(spec.hidden, keep_size, bias=False)
        if spec.ple_dim:
            self.per_layer_model_projection = nn.Linear(
                spec.hidden, spec.num_layers * spec.ple_dim, bias=False
            )
            self.per_layer_projection_norm = RMSNorm(spec.ple_dim, spec.eps)
        self.q_in, self.q_logits = ActQuant(), ActQuant()

    @classmethod
    def from_hf_state_dict(
        cls, spec: SlmSpec, sd: dict[str, torch.Tensor], keep_ids: Sequence[int]
    ) -> SlmStep:
        step = cls(spec, len(keep_ids))
        sub = {k: sd["model." + k] for k in step.state_dict() if "model." + k in sd}
        sub["lm_head.weight"] = keep_lm_head(sd, keep_ids)
        load_into(step, sub)
        return step.eval()

    def forward(
        self,
        x,
        ple,
        cos_sliding,
        sin_sliding,
        cos_full,
        sin_full,
        ring_mask_sliding,
        ring_mask_full,
        self_mask_sliding,
        self_mask_full,
        *rings,
    ):
        spec, rows = self.spec, x.shape[0]
        x = self.q_in(x)
        trig = {
            SLIDING: (cos_sliding[:, None], sin_sliding[:, None]),
            FULL: (cos_full[:, None], sin_full[:, None]),
        }
        masks = {
            SLIDING: torch.cat([ring_mask_sliding, self_mask_sliding], 1),
            FULL: torch.cat([ring_mask_full, self_mask_full], 1),
        }
        kv = {j: (rings[2 * j], rings[2 * j + 1]) for j in range(spec.first_shared)}
        if spec.ple_dim:
            proj = self.per_layer_model_projection(x) * (spec.hidden**-0.5)
            proj = self.per_layer_projection_norm(proj.reshape(rows, spec.num_layers, spec.ple_dim))
            ple = (proj + ple) * (2.0**-0.5)  # [R, L, P]
        for i, layer in enumerate(self.layers):
            x = layer(x, ple[:, i] if spec.ple_dim else None, *trig[layer.kind], kv, masks)
        logits = self.q_logits(softcap(self.lm_head(self.norm(x)), spec.softcap))  # [R, Vk]
        return (logits, *[t for j in range(spec.first_shared) for t in kv[j][2:]])


def torch_slm_step(step: nn.Module):
    @torch.no_grad()
    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [o.numpy() for o in step(*(torch.from_numpy(feeds[n]) for n in slm_input_names(step.spec)))]

    return run


class SlmDrafter:
    """The SLM Drafter's CPU side (token/PLE tables, rings, masks) around a step backend.

    ``step`` takes numpy feeds named by ``slm_input_names`` and returns outputs ordered as
    ``slm_output_names``; default: the float torch ``SlmStep``.
    """

    def __init__(
        self,
        spec: SlmSpec,
        sd: dict[str, torch.Tensor],
        keep_ids: Sequence[int],
        window: int = 1024,
        rows: int = ROWS,
        step=None,
    ):
        self.spec, self.keep_ids, self.window, self.rows = spec, np.asarray(keep_ids, np.int64), window, rows
        self.embed = (sd["model.embed_tokens.weight"].float() * math.sqrt(spec.hidden)).numpy()  # [V, hidden]
        self.ple_table = (
            (sd["model.embed_tokens_per_layer.weight"].float() * math.sqrt(spec.ple_dim)).numpy()
            if spec.ple_dim
            else None
        )  # [V, L * P]
        self.step = step or torch_slm_step(SlmStep.from_hf_state_dict(spec, sd, keep_ids))
        self.ring_cols = {FULL: window, SLIDING: window // 2}
        self.rings: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # KV-producing layer -> (K, V) [kvh, Wk, d]
        for j in range(spec.first_shared):
            a = spec.attn[spec.layer_types[j]]
            shape = (a.kv_heads, self.ring_cols[spec.layer_types[j]], a.head_dim)
            self.rings[j] = (np.zeros(shape, np.float32), np.zeros(shape, np.float32))
        self.pos = {kind: np.full(n, -1, np.int64) for kind, n in self.ring_cols.items()}
        self.committed = 0  # tokens with KV in the rings (their positions are 0 .. committed - 1)
        self.pending: dict[int, tuple[int, list[np.ndarray]]] = {}  # tree row -> (position, new K/V)

    # -- the static step -------------------------------------------------------------------------------
    def _feeds(
        self, tokens: Sequence[int], positions: np.ndarray, attend: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Feeds for ``len(tokens) <= rows`` rows (padded), ``attend`` [n, n] over these rows."""
        spec, n, R = self.spec, len(tokens), self.rows
        assert n <= R, f"{n} rows > the static graph's {R}"
        ids = np.zeros(R, np.int64)
        ids[:n] = tokens
        pos = np.zeros(R, np.int64)
        pos[:n] = positions
        feeds = {"x": self.embed[ids].astype(np.float32)}
        feeds["ple"] = (
            self.ple_table[ids].reshape(R, spec.num_layers, spec.ple_dim).astype(np.float32)
            if spec.ple_dim
            else np.zeros((R, spec.num_layers, 0), np.float32)
        )
        self_attend = np.eye(R, dtype=bool)  # padded rows attend to themselves only
        self_attend[:n, :n] = attend
        for kind, name in ((SLIDING, "sliding"), (FULL, "full")):
            cos, sin = spec.rope[kind].cos_sin(torch.from_numpy(pos), spec.attn[kind].head_dim)
            feeds[f"cos_{name}"], feeds[f"sin_{name}"] = cos.numpy(), sin.numpy()
            ring_pos = self.pos[kind][None, :]  # [1, Wk]
            ring_ok = (ring_pos >= 0) & (ring_pos < pos[:, None])
            self_ok = self_attend.copy()
            if kind == SLIDING:  # each row's own window, over the ring and over the other rows
                ring_ok &= pos[:, None] - ring_pos < spec.sliding_window
                self_ok &= (pos[:, None] - pos[None, :] < spec.sliding_window) | np.eye(R, dtype=bool)
            ring_ok[n:] = False
            feeds[f"ring_mask_{name}"] = ring_ok.astype(np.float32)
            feeds[f"self_mask_{name}"] = self_ok.astype(np.float32)
        for j, (k, v) in self.rings.items():
            feeds[f"k_{j}"], feeds[f"v_{j}"] = k, v
        return feeds

    def _run(self, tokens, positions, attend) -> tuple[np.ndarray, list[np.ndarray]]:
        out = self.step(self._feeds(tokens, np.asarray(positions), attend))
        return out[0][: len(tokens)], out[1:]  # logits [n, Vk], new K/V [kvh, R, d] per layer

    def _commit_row(self, new_kv: list[np.ndarray], row: int, position: int) -> None:
        for j, (k_ring, v_ring) in self.rings.items():
            kind = self.spec.layer_types[j]
            col = position % self.ring_cols[kind]
            k_ring[:, col] = new_kv[2 * j][:, row]
            v_ring[:, col] = new_kv[2 * j + 1][:, row]
        for kind, n in self.ring_cols.items():
            self.pos[kind][position % n] = position
        self.committed = max(self.committed, position + 1)

    # -- the drafter contract ----------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int]) -> None:
        """Commit ``tokens`` (the prompt's last W before its last token, D2) in causal chunks of ``rows``."""
        self._commit_causal(list(tokens)[-self.window :])

    def _commit_causal(self, tokens: Sequence[int]) -> np.ndarray:
        """Commit ``tokens`` after the committed ones, in causal chunks of ``rows``; their logits [n, Vk]."""
        logits = []
        for lo in range(0, len(tokens), self.rows):
            chunk = list(tokens[lo : lo + self.rows])
            start = self.committed
            out, new = self._run(
                chunk, start + np.arange(len(chunk)), np.tril(np.ones((len(chunk),) * 2, bool))
            )
            logits.append(out)
            for i in range(len(chunk)):
                self._commit_row(new, i, start + i)
        return np.concatenate(logits) if logits else np.zeros((0, len(self.keep_ids)), np.float32)

    def forward_rows(self, plan):
        """One forward over ``plan`` (a ``mobile_client.tree.FrontierPlan``): log q over the keep set.

        Catch-up rows that do not fit the static graph next to the tree rows (many committed tokens the
        SLM has not seen, e.g. after reused proactive trees) are committed first, oldest first, in causal
        chunks; the output still has one row per forward row of ``plan``."""
        from mobile_client.drafters.base import RowLogprobs
        from mobile_client.tree import DraftTree, FrontierPlan

        over = len(plan.catch_up) + len(plan.rows) - self.rows
        early = None
        if over > 0 and len(plan.rows) <= self.rows:
            early = self._commit_causal(plan.catch_up[:over])
            plan = FrontierPlan(plan.catch_up[over:], plan.rows, plan.tokens, plan.parents)
        c = len(plan.catch_up)
        root_pos = self.committed + c
        positions = root_pos + np.asarray(plan.positions(), np.int64)
        full_mask = plan.attend_mask()  # [n, c + len(tokens)]
        cols = list(range(c)) + [c + r for r in plan.rows]
        outside = np.delete(full_mask, cols, axis=1)
        if outside.any():
            raise NotImplementedError(
                "rows attending to an earlier pass's rows (HyCo-2P, SpecEdge-style passes) need "
                "those rows' KV; wrap the drafter in mobile_client.drafters.multipass.MultiPassSlm "
                "(hyco-phone --slm-passes 2), which recomputes them in the same forward"
            )
        logits, new = self._run(plan.forward_tokens(), positions, full_mask[:, cols])
        for i in range(c):
            self._commit_row(new, i, positions[i])
        paths = DraftTree.make_dummy(plan.tokens, plan.parents)
        self.pending = {  # row -> (position, new K/V, the row's tokens from the root)
            r: (int(positions[c + i]), [a[:, c + i : c + i + 1] for a in new],
                tuple(plan.tokens[j] for j in paths.path(r)))
            for i, r in enumerate(plan.rows)
        }
        if early is not None:
            logits = np.concatenate([early, logits])
        lp = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1).numpy()
        return RowLogprobs(lp, self.keep_ids)

    def accept(self, tree_rows: Sequence[int], tokens: Sequence[int] | None = None) -> int:
        """Algorithm 1 line 10: commit the KV of ``tree_rows`` (the root, then the accepted path in order)
        computed by the last forward; stops at the first row without KV. Returns how many were committed.

        ``tokens`` (the rows' tokens, root first): look the rows up by their token path instead of their
        index. Needed whenever the tree that was sent is not the plan's row list: a trimmed tree
        (Algorithm 3 line 17 re-indexes rows when an earlier row is cut; HyCo-2P and SpecEdge-style trees
        cut first-pass rows often), so a row index alone may name a different node than the one computed."""
        by_path = {v[2]: r for r, v in self.pending.items()} if tokens is not None else None
        done = 0
        for i, r in enumerate(tree_rows):
            if by_path is not None:
                r = by_path.get(tuple(int(t) for t in tokens[: i + 1]), -1)
            if r not in self.pending or self.pending[r][0] != self.committed:
                break
            pos, new, _ = self.pending[r]
            self._commit_row(new, 0, pos)
            done += 1
        self.pending = {}
        return done
