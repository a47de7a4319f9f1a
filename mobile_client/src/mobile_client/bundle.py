"""The phone's model bundle: what a phone app ships, read into drafters (docs/phone-loop.md).

A bundle folder holds ``verifier/config.json`` (+ ``model.safetensors`` for the torch MTP table),
``assistant/`` (the MTP head; a family whose MTP layer ships inside the verifier, MiMo, has none: the phone
runs ``verifier/``'s own MTP layer), ``slm/`` (the SLM Drafter), ``handoff_scales.npz`` (without it: SLM-only
trees), optionally ``keep_ids.npy``, ``tokenizer/`` and ``build/`` (the compiled steps of
``python -m mobile_client.export.build``). The layout is documented in :mod:`mobile_client.cli`.

Public functions, used by ``hyco-phone`` (:mod:`mobile_client.cli`) and by the benchmark harness
(``hyco_lab.bench.phones``):

* :func:`load_bundle` -- the whole phone: HybridDrafter (MTP + SLM) wrapped in a ``HycoPhoneDrafter``;
* :func:`read_hf_dir`, :func:`keep_ids`, :func:`handoff_spec`, :func:`chain_drafter` (:func:`mtp_drafter` or
  :func:`own_mtp_drafter`), :func:`compiled_step`
  -- its parts, for callers that assemble other drafters from the same bundle.

Example::

    from pathlib import Path
    from mobile_client.bundle import load_bundle

    bundle = load_bundle(Path("BUNDLE"))          # torch steps
    bundle.drafter, bundle.spec, bundle.notes
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mobile_client.session import HycoPhoneDrafter
from vllm_hyco.errors import ConfigError

MTP_WINDOW = 1024  # the paper's W: columns of the MTP ring and of the SLM's full-attention ring


@dataclass
class PhoneBundle:
    drafter: HycoPhoneDrafter
    spec: Any  # HandoffSpec, or None without a scales file
    notes: list[str]
    keep_set_hash: bytes | None = None  # sha256 of the drafters' keep set, sent in ``start``


def read_hf_dir(path: Path) -> tuple[dict, dict]:
    """(config dict, state dict) of a Hugging Face folder (``config.json`` + ``*.safetensors``).

    Raises ConfigError when the folder has no ``config.json``."""
    from mobile_client.export.build import load_hf_dir

    if not (path / "config.json").exists():
        raise ConfigError(f"{path} is not a Hugging Face model folder (no config.json)")
    return load_hf_dir(path)


def keep_ids(model_dir: Path, vocab: int, build_dir: Path | None) -> list[int]:
    """The drafters' keep set: ``keep_ids.npy`` of the build folder, else of the bundle, else every id."""
    for d in (build_dir, model_dir):
        if d is not None and (d / "keep_ids.npy").exists():
            return [int(i) for i in np.load(d / "keep_ids.npy")]
    return list(range(vocab))


def handoff_spec(model_dir: Path):
    """(HandoffSpec, scales) of the bundle's ``handoff_scales.npz`` + ``verifier/config.json``; (None, None)
    without a scales file (the phone then drafts SLM-only trees)."""
    from vllm_hyco.handoff.quant import load_scales
    from vllm_hyco.handoff.schema import HandoffSpec
    from vllm_hyco.handoff.sizes import layers_from_hf_config

    path = model_dir / "handoff_scales.npz"
    if not path.exists():
        return None, None
    cfg = json.loads((model_dir / "verifier" / "config.json").read_text())
    _, layers = layers_from_hf_config(cfg)
    scales = load_scales(path)
    return HandoffSpec.from_scales(cfg, layers, scales), scales


def load_bundle(model_dir: Path, backend: str = "torch", build_dir: Path | None = None,
                window: int = MTP_WINDOW, slm_passes: int = 1) -> PhoneBundle:
    """The phone's drafters from a model bundle: MTP head + SLM (HyCo), or SLM only without scales.

    ``slm_passes=2`` is HyCo-2P (Algorithm 3 line 15): a second SLM pass under the nodes the first pass
    added, through ``MultiPassSlm`` (the second pass's rows and their ancestors in one forward, up to 96
    rows). The compiled SLM step is a static 32-row graph, so HyCo-2P needs the torch SLM step."""
    from mobile_client.drafters.base import HybridDrafter
    from mobile_client.drafters.multipass import ROWS, MultiPassSlm
    from mobile_client.drafters.slm import SlmDrafter
    from mobile_client.drafters.spec import SlmSpec
    from mobile_client.keepset import KeepSet

    if slm_passes not in (1, 2):
        raise ConfigError(f"--slm-passes must be 1 (HyCo) or 2 (HyCo-2P), got {slm_passes}")
    notes: list[str] = []
    build_dir = build_dir or model_dir / "build"
    scfg, ssd = read_hf_dir(model_dir / "slm")
    sspec = SlmSpec.from_hf_config(scfg)
    keep = keep_ids(model_dir, sspec.vocab, build_dir if backend == "compiled" else None)
    slm_ctx = build_dir / "slm_ctx.onnx"
    if slm_passes == 2 and backend == "compiled" and slm_ctx.exists():
        raise ConfigError(
            f"--slm-passes 2 (HyCo-2P) runs the second pass's rows together with their first-pass "
            f"ancestors (up to {ROWS} rows per forward); the compiled SLM step {slm_ctx} is a static "
            f"32-row graph. Use --backend torch with --slm-passes 2, or --slm-passes 1 with --backend "
            f"compiled")
    slm_step = compiled_step(slm_ctx, notes, "SLM") if backend == "compiled" else None
    slm = SlmDrafter(sspec, ssd, keep, window=window, step=slm_step)
    rows = MultiPassSlm(slm) if slm_passes == 2 else slm
    if slm_passes == 2:
        notes.append("HyCo-2P: two SLM passes per tree (torch SLM step)")
    spec, scales = handoff_spec(model_dir)
    mtp = None
    if scales is None:
        notes.append(f"no {model_dir / 'handoff_scales.npz'}: SLM-only trees (no MTP chain)")
    else:
        mtp = chain_drafter(model_dir, spec, keep, backend, build_dir, window, notes)
    drafter = HycoPhoneDrafter(HybridDrafter(mtp, rows, two_pass=slm_passes == 2), slm=slm, mtp=mtp,
                               scales=scales)
    return PhoneBundle(drafter, spec, notes, KeepSet.from_ids(keep, sspec.vocab).hash_bytes)


def mtp_drafter(model_dir: Path, keep: list[int], backend: str, build_dir: Path, window: int, notes):
    """The MTP Drafter of the bundle's ``assistant/``: the compiled step and 8-bit table of ``build_dir`` for
    ``backend="compiled"`` (when built), else torch with the table made from the verifier's embeddings.
    Appends what it chose to ``notes``."""
    import torch

    from mobile_client.drafters.mtp import EmbedLut, MtpDrafter, MtpHead, torch_step
    from mobile_client.drafters.spec import MtpSpec

    acfg, asd = read_hf_dir(model_dir / "assistant")
    mspec = MtpSpec.from_hf_config(acfg)
    step = compiled_step(build_dir / "mtp_ctx.onnx", notes, "MTP") if backend == "compiled" else None
    lut_file = build_dir / "mtp_embed_lut.npz"
    if backend == "compiled" and lut_file.exists():
        z = np.load(lut_file)
        lut = EmbedLut(z["table"], z["scale"])
    else:
        _, vsd = read_hf_dir(model_dir / "verifier")
        embed = vsd.get("model.embed_tokens.weight", vsd.get("model.language_model.embed_tokens.weight"))
        if embed is None:
            raise ConfigError(f"{model_dir / 'verifier'} has no embed_tokens weight for the MTP table")
        lut = EmbedLut.from_embedding(embed.to(torch.float32), keep)
    if step is None:
        step = torch_step(MtpHead.from_hf_state_dict(mspec, asd, keep))
    return MtpDrafter(mspec, keep, lut, step, window=window)


def chain_drafter(model_dir: Path, spec: Any, keep: list[int], backend: str, build_dir: Path, window: int,
                  notes: list[str]):
    """The bundle's MTP Drafter for its hand-off schema ``spec``: the verifier's own MTP layer where the
    hand-off carries h rows (an MTP layer with its own KV, :func:`own_mtp_drafter`), else the assistant head
    reading the hand-off's K/V (:func:`mtp_drafter`)."""
    from vllm_hyco.models import family_of

    family = family_of(json.loads((model_dir / "verifier" / "config.json").read_text()))
    if not family.phone_mtp:
        notes.append(f"no phone-sized MTP drafter for the {family.name} family: SLM-only trees")
        return None
    if any(layer.kind == "hidden" for layer in spec.layers):
        return own_mtp_drafter(model_dir, keep, window, notes, backend=backend, build_dir=build_dir)
    return mtp_drafter(model_dir, keep, backend, build_dir, window, notes)


def own_mtp_drafter(model_dir: Path, keep: list[int], window: int, notes: list[str], backend: str = "torch",
                    build_dir: Path | None = None):
    """The MTP Drafter of a family whose MTP layer owns its KV (MiMo): the verifier folder's first MTP layer,
    its embedding and ``lm_head`` (``drafters.own_mtp``). ``backend="compiled"`` runs its one-row step from
    ``build_dir/own_mtp_ctx.onnx`` (``export.build.build_own_mtp``) when built, else the layer in torch (a note
    says which). Raises ConfigError when the compiled step's ring is not ``window`` columns."""
    from mobile_client.drafters.own_mtp import OwnMtpDrafter

    cfg, sd = read_hf_dir(model_dir / "verifier")
    what = "MTP step: the verifier's own MTP layer (its KV kept on the phone from the hand-off's h rows)"
    if backend != "compiled":
        notes.append(f"{what}, torch")
        return OwnMtpDrafter(cfg, sd, keep, window=window)
    notes.append(what)
    ctx = (build_dir if build_dir is not None else model_dir / "build") / "own_mtp_ctx.onnx"
    if ctx.exists() and (columns := _ring_columns(ctx)) != window:
        raise ConfigError(f"{ctx} was built for a {columns}-column ring; this phone's window is "
                          f"{window} (pass --window {columns}, or rebuild)")
    # None (and a note: torch) when not built
    return OwnMtpDrafter(cfg, sd, keep, window=window, step=compiled_step(ctx, notes, "MTP"))


def _ring_columns(ctx: Path) -> int:
    """W of a compiled own-KV MTP step: the column count of its ``k_ring`` input [kvh, W, d]. Raises ConfigError
    when ``ctx`` has no ``k_ring`` input (not an own-MTP context)."""
    import onnx

    graph = onnx.load(str(ctx), load_external_data=False).graph
    k_ring = next((i for i in graph.input if i.name == "k_ring"), None)
    if k_ring is None:
        raise ConfigError(f"{ctx} has no k_ring input: not an own-MTP context; rebuild it with "
                          "python -m mobile_client.export.build OUT --target-dir VERIFIER (a MiMo verifier)")
    return int(k_ring.type.tensor_type.shape.dim[1].dim_value)


def compiled_step(ctx: Path, notes: list[str], name: str):
    """A step function running the QNN context model ``ctx`` on the HTP backend; None (and a note) when
    ``ctx`` does not exist."""
    if not ctx.exists():
        notes.append(f"{name} step: no compiled model at {ctx}; running it in torch")
        return None
    from mobile_client.export import qnn

    session = qnn.htp_session(ctx)
    notes.append(f"{name} step: QNN HTP context {ctx.name} (on x86 the HTP emulator: numerics, not timing)")

    def run(feeds):
        out = qnn.run(session, feeds)
        return tuple(out) if name == "MTP" else out

    return run
