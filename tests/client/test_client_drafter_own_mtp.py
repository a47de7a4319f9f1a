"""The phone's MTP layer with its own KV (``mobile_client.drafters.own_mtp``, MiMo): its cache is the hand-off's
rows, whatever way they arrive, and its chain is vLLM's ``mimo_mtp`` chaining."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mobile_client.drafters.own_mtp import OwnMtpDrafter, random_mimo_mtp_state_dict
from vllm_hyco.errors import ConfigError, SessionError

CFG = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
       "intermediate_size": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_hidden_layers": 2}
VOCAB = 50


def _drafter(window: int = 64) -> OwnMtpDrafter:
    return OwnMtpDrafter(CFG, random_mimo_mtp_state_dict(CFG, VOCAB, seed=3), list(range(VOCAB)), window=window)


def _stream(n: int, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 16)).astype(np.float32), [int(t) for t in rng.integers(0, VOCAB, n + 1)]


def test_rounds_with_chains_in_between_equal_one_seed():
    """Positions [0, 13) handed off in rounds, each followed by a chain (which writes rows past the root that
    the next round overwrites), leave the cache one seed of [0, 13) leaves: the same x_hat and the same chain."""
    h, tokens = _stream(13)
    rounds = _drafter()
    for a, t in ((0, 4), (4, 5), (5, 9), (9, 13)):
        x_hat = rounds.apply_handoff(t, a, h[a:t], tokens)
        rounds.draft(x_hat)
    seeded = _drafter()
    x_seed = seeded.apply_handoff(13, 0, h, tokens)
    np.testing.assert_allclose(x_hat, x_seed, rtol=1e-5, atol=1e-5)
    assert rounds.draft(x_hat).chain == seeded.draft(x_seed).chain


def test_a_window_of_w_positions_is_a_seed_of_the_last_w():
    """Past W positions the ring holds the last W: 20 positions in rounds through an 8-column ring give what a
    seed of positions [12, 20) gives a fresh phone."""
    h, tokens = _stream(20, seed=1)
    ring = _drafter(window=8)
    for a in range(0, 20, 3):
        x_hat = ring.apply_handoff(min(a + 3, 20), a, h[a:a + 3], tokens)
    fresh = _drafter(window=8)
    x_seed = fresh.apply_handoff(20, 12, h[12:], tokens)
    np.testing.assert_allclose(x_hat, x_seed, rtol=1e-5, atol=1e-5)


def test_the_chain_reads_the_head_and_feeds_its_output_back():
    h, tokens = _stream(6, seed=2)
    d = _drafter()
    x_hat = d.apply_handoff(6, 0, h, tokens)
    draft = d.draft(x_hat)
    logits = torch.as_tensor(x_hat) @ d.lm_head.T
    assert draft.chain[0] == int(torch.argmax(logits)) and len(draft.chain) == 4 and len(draft.runner_ups) == 2
    assert draft.runner_ups[0] == int(torch.topk(logits, 2).indices[1]) and draft.chain_q is None
    # position 0's token embedding is zeroed (vLLM's mimo_mtp): its token does not matter
    other = list(tokens)
    other[1] = (tokens[1] + 1) % VOCAB
    np.testing.assert_allclose(_drafter().apply_handoff(2, 0, h[:2], tokens),
                               _drafter().apply_handoff(2, 0, h[:2], other), atol=0)
    other[2] = (tokens[2] + 1) % VOCAB  # position 1's next token does
    assert not np.allclose(_drafter().apply_handoff(2, 0, h[:2], tokens), _drafter().apply_handoff(2, 0, h[:2], other))


def test_a_hand_off_longer_than_the_ring_keeps_its_last_w_rows():
    h, tokens = _stream(20, seed=4)
    np.testing.assert_allclose(_drafter(window=8).apply_handoff(20, 0, h, tokens),
                               _drafter(window=8).apply_handoff(20, 12, h[12:], tokens), rtol=1e-5, atol=1e-5)
    with pytest.raises(SessionError, match="committed tokens"):
        _drafter().apply_handoff(20, 0, h, tokens[:15])
    with pytest.raises(ConfigError, match="plain rope only"):
        OwnMtpDrafter({**CFG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                      random_mimo_mtp_state_dict(CFG, VOCAB), list(range(VOCAB)))


def _rounds(drafter, h, tokens, bounds):
    chains, x_hat = [], None
    for a, t in bounds:
        x_hat = drafter.apply_handoff(t, a, h[a:t], tokens)
        chains.append(drafter.draft(x_hat).chain)
    return chains, x_hat


def test_the_static_one_row_step_drafts_what_the_layer_drafts(tmp_path):
    """The export path: the one-row static step (the ring in, the row's K/V out), in torch and exported to ONNX
    (ONNX Runtime, CPU), drafts the same chains as the layer run over each round's rows at once, from the
    step's own logits."""
    from mobile_client.drafters.own_mtp import STEP_INPUTS, STEP_OUTPUTS, torch_own_step
    from mobile_client.export import qnn
    from mobile_client.export.onnx_export import export_step

    h, tokens = _stream(14, seed=5)
    bounds = ((0, 5), (5, 6), (6, 10), (10, 14))
    ref_chains, ref_x = _rounds(_drafter(window=16), h, tokens, bounds)
    step_drafter = _drafter(window=16)
    module = step_drafter.static_step()
    step_drafter.step = torch_own_step(module)
    step_drafter.lm_head = torch.full_like(step_drafter.lm_head, float("nan"))  # the step's head is the one read
    chains, x_hat = _rounds(step_drafter, h, tokens, bounds)
    assert chains == ref_chains
    np.testing.assert_allclose(x_hat, ref_x, rtol=1e-4, atol=1e-4)
    feeds = {"h": np.zeros((1, 16), np.float32), "e": np.zeros((1, 16), np.float32),
             "k_ring": np.zeros((2, 16, 4), np.float32), "v_ring": np.zeros((2, 16, 4), np.float32),
             "mask": np.zeros((1, 16), np.float32), "cos": np.ones((1, 4), np.float32),
             "sin": np.zeros((1, 4), np.float32)}
    export_step(module, feeds, STEP_INPUTS, STEP_OUTPUTS, tmp_path / "own_mtp_step.onnx")
    session = qnn.cpu_session(tmp_path / "own_mtp_step.onnx")
    onnx_drafter = _drafter(window=16)
    onnx_drafter.step = lambda f: qnn.run(session, f)
    chains, x_hat = _rounds(onnx_drafter, h, tokens, bounds)
    assert chains == ref_chains
    np.testing.assert_allclose(x_hat, ref_x, rtol=1e-4, atol=1e-4)


def test_a_mimo_bundle_without_a_compiled_step_runs_the_layer_in_torch(tmp_path):
    """``bundle.chain_drafter`` of a MiMo bundle (a ``hidden`` hand-off layer): ``backend="compiled"`` with no
    ``own_mtp_ctx.onnx`` in the build folder runs the layer in torch and says so; ``torch`` says torch."""
    from client_shared import write_mimo_verifier

    from mobile_client.bundle import chain_drafter
    from vllm_hyco.handoff.sizes import spec_from_hf_config

    sd = random_mimo_mtp_state_dict(CFG, VOCAB, seed=3)
    spec = spec_from_hf_config(write_mimo_verifier(tmp_path, CFG, VOCAB, sd))
    for backend, said in (("compiled", "no compiled model at"), ("torch", "h rows), torch")):
        notes: list[str] = []
        drafter = chain_drafter(tmp_path, spec, list(range(VOCAB)), backend, tmp_path / "build", 64, notes)
        assert isinstance(drafter, OwnMtpDrafter) and drafter.step is None
        assert any(said in n for n in notes), notes


def test_a_context_without_a_ring_is_refused_by_name(tmp_path):
    """``bundle._ring_columns`` of an ONNX model with no ``k_ring`` input (not an own-MTP context) names the file."""
    import onnx
    from onnx import TensorProto, helper

    from mobile_client.bundle import _ring_columns

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    path = tmp_path / "mtp_ctx.onnx"
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])),
              str(path))
    with pytest.raises(ConfigError, match=r"mtp_ctx\.onnx has no k_ring input: not an own-MTP context"):
        _ring_columns(path)
