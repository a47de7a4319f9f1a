"""Shapes of the phone's two drafters, their rotary tables, and random HF-layout weights.

A spec holds only what the static graphs need; it is built from a Hugging Face ``config.json`` dict
(``MtpSpec.from_hf_config`` / ``SlmSpec.from_hf_config``) or from the named presets below. The presets
are the toy twins used in CI and the full-size shapes used by the slow compile-only check (fields the
paper does not give are inferred and marked so).

>>> spec = toy_mtp_spec()
>>> spec.head_dim("full_attention"), spec.head_dim("sliding_attention")
(64, 32)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class RopeSpec:
    """One layer type's rotary embedding: ``default`` or Gemma-4's ``proportional`` (partial) RoPE."""

    theta: float
    kind: str = "default"
    partial: float = 1.0

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """[head_dim // 2] inverse frequencies; proportional RoPE pads the unrotated half with zeros."""
        if self.kind == "default":
            return 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        assert self.kind == "proportional", self.kind
        angles = int(self.partial * head_dim // 2)
        rotated = 1.0 / (self.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float) / head_dim))
        return torch.cat([rotated, torch.zeros(head_dim // 2 - angles)])

    def cos_sin(self, positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables [*positions.shape, head_dim] (computed on the phone's CPU, fed to the graph)."""
        freqs = positions.to(torch.float)[..., None] * self.inv_freq(head_dim)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _rope_from_hf(params: dict) -> RopeSpec:
    return RopeSpec(
        float(params["rope_theta"]),
        params.get("rope_type", "default"),
        float(params.get("partial_rotary_factor", 1.0)),
    )


@dataclass(frozen=True)
class AttnShape:
    """Per layer type: head dim and KV heads (queries always use ``num_heads``)."""

    head_dim: int
    kv_heads: int


@dataclass(frozen=True)
class MtpSpec:
    """The Gemma-4 assistant (MTP) head: Q-only layers over two verifier layers' K/V."""

    hidden: int
    backbone: int  # the verifier's hidden size H; z = [e(x)*sqrt(H) ; h] has 2H values
    intermediate: int
    num_heads: int
    layer_types: tuple[str, ...]
    attn: dict[str, AttnShape]
    rope: dict[str, RopeSpec]
    vocab: int
    sliding_window: int
    eps: float = 1e-6
    softcap: float | None = 30.0

    def head_dim(self, kind: str) -> int:
        return self.attn[kind].head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict) -> MtpSpec:
        """From a ``gemma4_assistant`` config.json dict (its ``text_config`` holds the layer shapes)."""
        text = cfg.get("text_config", cfg)
        return cls(
            hidden=text["hidden_size"],
            backbone=cfg.get("backbone_hidden_size", text["hidden_size"]),
            intermediate=text["intermediate_size"],
            num_heads=text["num_attention_heads"],
            layer_types=tuple(text["layer_types"]),
            attn=_attn_from_hf(text),
            rope={k: _rope_from_hf(v) for k, v in text["rope_parameters"].items()},
            vocab=text["vocab_size"],
            sliding_window=text["sliding_window"],
            eps=text.get("rms_norm_eps", 1e-6),
            softcap=text.get("final_logit_softcapping"),
        )


def _attn_from_hf(text: dict) -> dict[str, AttnShape]:
    """Per-kind head dim and KV heads. A saved config carries ``per_layer_config`` ({layer: overrides});
    a hand-written one ``global_head_dim`` / ``num_global_key_value_heads`` (used when K = V)."""
    kv = text["num_key_value_heads"]
    shapes = {SLIDING: AttnShape(text["head_dim"], kv)}
    plc = text.get("per_layer_config")
    if plc:
        types = text["layer_types"]
        full = [o for i, o in plc.items() if types[int(i)] == FULL] or [{}]
        shapes[FULL] = AttnShape(
            full[0].get("head_dim", text["head_dim"]), full[0].get("num_key_value_heads", kv)
        )
        return shapes
    gkv = text.get("num_global_key_value_heads") if text.get("attention_k_eq_v", False) else None
    shapes[FULL] = AttnShape(text.get("global_head_dim", 512), gkv or kv)
    return shapes


@dataclass(frozen=True)
class SlmSpec:
    """A Gemma-4 E2B-shaped text model (per-layer embeddings, KV-shared trailing layers)."""

    hidden: int
    intermediate: int
    num_heads: int
    layer_types: tuple[str, ...]
    attn: dict[str, AttnShape]
    rope: dict[str, RopeSpec]
    vocab: int
    sliding_window: int
    ple_dim: int  # hidden_size_per_layer_input (0 = no PLE)
    num_kv_shared: int
    double_wide_mlp: bool = False
    k_eq_v: bool = True  # full layers take V from the K projection (Gemma-4 attention_k_eq_v)
    eps: float = 1e-6
    softcap: float | None = 30.0

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def first_shared(self) -> int:
        return self.num_layers - self.num_kv_shared

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V ``layer`` reads: itself, or the last non-shared layer of its type."""
        if layer < self.first_shared:
            return layer
        kind = self.layer_types[layer]
        return max(i for i in range(self.first_shared) if self.layer_types[i] == kind)

    def intermediate_of(self, layer: int) -> int:
        wide = self.double_wide_mlp and layer >= self.first_shared > 0
        return self.intermediate * (2 if wide else 1)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> SlmSpec:
        text = cfg.get("text_config", cfg)
        return cls(
            hidden=text["hidden_size"],
            intermediate=text["intermediate_size"],
            num_heads=text["num_attention_heads"],
            layer_types=tuple(text["layer_types"]),
            attn=_attn_from_hf(text),
            rope={k: _rope_from_hf(v) for k, v in text["rope_parameters"].items()},
            vocab=text["vocab_size"],
            sliding_window=text["sliding_window"],
            ple_dim=text.get("hidden_size_per_layer_input", 0) or 0,
            num_kv_shared=text.get("num_kv_shared_layers", 0) or 0,
            double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
            k_eq_v=bool(text.get("attention_k_eq_v", False)),
            eps=text.get("rms_norm_eps", 1e-6),
            softcap=text.get("final_logit_softcapping"),
        )


_GEMMA4_ROPE = {SLIDING: RopeSpec(10_000.0), FULL: RopeSpec(1_000_000.0, "proportional", 0.25)}


def toy_mtp_spec(**overrides) -> MtpSpec:
    """CI twin of the 26B-A4B assistant: same layer pattern and graph, tiny widths."""
    base = MtpSpec(
        hidden=64,
        backbone=96,
        intermediate=128,
        num_heads=4,
        layer_types=(SLIDING, FULL),
        attn={SLIDING: AttnShape(32, 2), FULL: AttnShape(64, 1)},
        rope=dict(_GEMMA4_ROPE),
        vocab=512,
        sliding_window=16,
    )
    return replace(base, **overrides)


def full_mtp_spec() -> MtpSpec:
    """26B-A4B-assistant-shaped head. From the paper: backbone 2,816; 6,144 K/V values per position
    (sliding 8 KV heads x 256 x 2 + global 2 KV heads x 512 x 2); window 1,024. Inferred (no config
    offline): assistant hidden 1,024, 4 layers [S, S, S, F], 8 query heads, MLP 4,096, vocab 262,144."""
    return MtpSpec(
        hidden=1024,
        backbone=2816,
        intermediate=4096,
        num_heads=8,
        layer_types=(SLIDING, SLIDING, SLIDING, FULL),
        attn={SLIDING: AttnShape(256, 8), FULL: AttnShape(512, 2)},
        rope=dict(_GEMMA4_ROPE),
        vocab=262_144,
        sliding_window=1024,
    )


def toy_slm_spec(**overrides) -> SlmSpec:
    """CI twin of Gemma-4 E2B: PLE, 2 KV-shared trailing layers with double-wide MLPs, a short 4:1 pattern."""
    base = SlmSpec(
        hidden=64,
        intermediate=96,
        num_heads=4,
        layer_types=(SLIDING, SLIDING, FULL, SLIDING, FULL),
        attn={SLIDING: AttnShape(16, 1), FULL: AttnShape(32, 1)},
        rope=dict(_GEMMA4_ROPE),
        vocab=512,
        sliding_window=16,
        ple_dim=8,
        num_kv_shared=2,
        double_wide_mlp=True,
    )
    return replace(base, **overrides)


def e2b_slm_spec(num_layers: int = 35) -> SlmSpec:
    """Gemma-4 E2B shapes (docs/phone-build.md, "Gemma-4 E2B shapes"): hidden 1,536, 8 heads, 1 KV head, head
    dim 256/512, window 512, 4:1 sliding:full, 20 KV-shared layers, PLE 256, MLP 6,144 (double wide when shared).
    ``num_layers`` < 35 keeps the same pattern and widths with fewer layers (op coverage only)."""
    types = tuple(FULL if (i + 1) % 5 == 0 else SLIDING for i in range(35))[:num_layers]
    types = types[:-1] + (FULL,)
    shared = 20 if num_layers == 35 else max(0, num_layers - 5)
    return SlmSpec(
        hidden=1536,
        intermediate=6144,
        num_heads=8,
        layer_types=types,
        attn={SLIDING: AttnShape(256, 1), FULL: AttnShape(512, 1)},
        rope=dict(_GEMMA4_ROPE),
        vocab=262_144,
        sliding_window=512,
        ple_dim=256,
        num_kv_shared=shared,
        double_wide_mlp=True,
    )


def mtp_hf_config(spec: MtpSpec) -> dict:
    """The ``gemma4_assistant`` config.json dict for ``spec`` (loads in transformers and vLLM)."""
    s, f = spec.attn[SLIDING], spec.attn[FULL]
    text = dict(
        model_type="gemma4_text",
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=len(spec.layer_types),
        num_attention_heads=spec.num_heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        global_head_dim=f.head_dim,
        num_global_key_value_heads=f.kv_heads,
        attention_k_eq_v=True,
        layer_types=list(spec.layer_types),
        sliding_window=spec.sliding_window,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        final_logit_softcapping=spec.softcap,
        num_kv_shared_layers=len(spec.layer_types),
        rms_norm_eps=spec.eps,
        max_position_embeddings=8192,
    )
    return dict(
        model_type="gemma4_assistant",
        architectures=["Gemma4AssistantForCausalLM"],
        backbone_hidden_size=spec.backbone,
        text_config=text,
        tie_word_embeddings=True,
    )


def random_mtp_state_dict(spec: MtpSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-layout assistant weights (``Gemma4AssistantForCausalLM`` keys), random but well scaled."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _rand(g, spec.vocab, spec.hidden, scale=1.0),
        "model.norm.weight": _norm_w(g, spec.hidden),
        "pre_projection.weight": _rand(g, spec.hidden, 2 * spec.backbone),
        "post_projection.weight": _rand(g, spec.backbone, spec.hidden),
    }
    for i, kind in enumerate(spec.layer_types):
        p, d = f"model.layers.{i}.", spec.head_dim(kind)
        sd.update(_decoder_layer(g, p, spec.hidden, spec.num_heads, d, spec.intermediate))
    return sd


def _decoder_layer(g, p: str, hidden: int, heads: int, d: int, inter: int) -> dict[str, torch.Tensor]:
    sd = {
        p + "self_attn.q_proj.weight": _rand(g, heads * d, hidden),
        p + "self_attn.q_norm.weight": _norm_w(g, d),
        p + "self_attn.o_proj.weight": _rand(g, hidden, heads * d),
        p + "mlp.gate_proj.weight": _rand(g, inter, hidden),
        p + "mlp.up_proj.weight": _rand(g, inter, hidden),
        p + "mlp.down_proj.weight": _rand(g, hidden, inter),
        p + "layer_scalar": torch.ones(1),
    }
    for n in (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ):
        sd[p + n + ".weight"] = _norm_w(g, hidden)
    return sd


def random_slm_state_dict(spec: SlmSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-layout ``Gemma4ForCausalLM`` weights (``model.`` prefix, tied lm_head), random."""
    g = torch.Generator().manual_seed(seed)
    L, P = spec.num_layers, spec.ple_dim
    sd = {
        "model.embed_tokens.weight": _rand(g, spec.vocab, spec.hidden, scale=1.0),
        "model.norm.weight": _norm_w(g, spec.hidden),
    }
    if P:
        sd["model.embed_tokens_per_layer.weight"] = _rand(g, spec.vocab, L * P, scale=1.0)
        sd["model.per_layer_model_projection.weight"] = _rand(g, L * P, spec.hidden)
        sd["model.per_layer_projection_norm.weight"] = _norm_w(g, P)
    for i, kind in enumerate(spec.layer_types):
        p, a = f"model.layers.{i}.", spec.attn[kind]
        sd.update(_decoder_layer(g, p, spec.hidden, spec.num_heads, a.head_dim, spec.intermediate_of(i)))
        if i < spec.first_shared:
            sd[p + "self_attn.k_proj.weight"] = _rand(g, a.kv_heads * a.head_dim, spec.hidden)
            sd[p + "self_attn.k_norm.weight"] = _norm_w(g, a.head_dim)
            if kind == SLIDING or not spec.k_eq_v:  # k_eq_v full layers have no v_proj
                sd[p + "self_attn.v_proj.weight"] = _rand(g, a.kv_heads * a.head_dim, spec.hidden)
        if P:
            sd[p + "per_layer_input_gate.weight"] = _rand(g, P, spec.hidden)
            sd[p + "per_layer_projection.weight"] = _rand(g, spec.hidden, P)
            sd[p + "post_per_layer_input_norm.weight"] = _norm_w(g, spec.hidden)
    return sd


def slm_hf_config(spec: SlmSpec) -> dict:
    """A ``gemma4_text`` config.json dict for ``spec`` (Gemma4ForCausalLM)."""
    s, f = spec.attn[SLIDING], spec.attn[FULL]
    return dict(
        model_type="gemma4_text",
        architectures=["Gemma4ForCausalLM"],
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        global_head_dim=f.head_dim,
        num_global_key_value_heads=f.kv_heads,
        attention_k_eq_v=spec.k_eq_v,
        layer_types=list(spec.layer_types),
        sliding_window=spec.sliding_window,
        hidden_size_per_layer_input=spec.ple_dim,
        vocab_size_per_layer_input=spec.vocab,
        num_kv_shared_layers=spec.num_kv_shared,
        use_double_wide_mlp=spec.double_wide_mlp,
        final_logit_softcapping=spec.softcap,
        rms_norm_eps=spec.eps,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


def _rand(g: torch.Generator, rows: int, cols: int, scale: float | None = None) -> torch.Tensor:
    std = scale if scale is not None else 1.0 / math.sqrt(cols)
    return torch.randn(rows, cols, generator=g) * std


def _norm_w(g: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(n, generator=g)
