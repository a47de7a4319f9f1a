"""No vocabulary-sized tensor reaches the host or Python during tree steps (real in-process engine, CPU).

Every ``Tensor.cpu()``, ``.tolist()``, ``.numpy()`` and ``.item()`` call made while sessions verify trees
is recorded (``torch.Tensor`` methods wrapped for the duration of the rounds); on a GPU each of them is a
device-to-host copy. Greedy, sampled (top-k/top-p, seeded) and ε sessions (the server's ε 0.005, and a
stricter one) share the steps. A call on a
tensor with a vocabulary-sized dimension fails the test and names the caller. The tiny model's vocabulary
is 512, so the engine runs with ``max_model_len`` 384 to keep other 512-long buffers out of the check.
"""

from __future__ import annotations

import random
import traceback

import pytest
import torch
from test_engine_sessions import VOCAB, tiny_hyco_llm

METHODS = ("cpu", "tolist", "numpy", "item")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    yield from tiny_hyco_llm(tmp_path_factory, "tiny_xfer", max_model_len=384,
                             speculative_config={"method": "hyco", "epsilon": 0.005})


class TransferRecorder:
    """Wraps ``torch.Tensor.{cpu,tolist,numpy,item}``; keeps (method, shape, bytes, caller) of every call."""

    def __init__(self):
        self.calls: list[tuple[str, tuple[int, ...], int, str]] = []
        self._orig = {}

    def __enter__(self):
        for name in METHODS:
            orig = getattr(torch.Tensor, name)
            self._orig[name] = orig

            def wrapped(t, *args, _name=name, _orig=orig, **kwargs):
                caller = "".join(traceback.format_stack(limit=4)[:-1])
                self.calls.append((_name, tuple(t.shape), t.numel() * t.element_size(), caller))
                return _orig(t, *args, **kwargs)

            setattr(torch.Tensor, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, orig)

    def vocab_sized(self, vocab: int):
        return [c for c in self.calls if vocab in c[1]]


def _tree(root: int, rng: random.Random, n: int = 33) -> tuple[list[int], list[int]]:
    tokens, parents = [root], [-1]
    for i in range(1, n):
        p = i - 1 if i < 6 else rng.randrange(i)
        tok = rng.randrange(3, VOCAB)
        while any(pp == p and tt == tok for tt, pp in zip(tokens, parents)):
            tok = rng.randrange(3, VOCAB)
        tokens.append(tok)
        parents.append(p)
    return tokens, parents


def test_tree_steps_move_no_vocabulary_sized_tensor_to_the_host(llm):
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    hy = HycoEngine(llm)
    rng = random.Random(5)
    kinds = [{"temperature": 0.0}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 3},
             {"temperature": 1.0, "seed": 4}, {"temperature": 0.7, "top_p": 0.5, "eps": 0.2}]
    sessions = []
    for kw in kinds:
        prompt = [2] + [rng.randrange(5, VOCAB) for _ in range(rng.randrange(10, 40))]
        sessions.append(hy.open(prompt_token_ids=prompt, max_tokens=200, ignore_eos=True, **kw))
    roots = {s.sid: s.root for s in sessions}
    with TransferRecorder() as rec:
        for rnd in range(3):
            trees = [(s.sid, rnd, *_tree(roots[s.sid], rng)) for s in sessions]
            for v in hy.submit_many(trees):
                roots[v.sid] = v.bonus
                assert v.handoff.kv["full"].k.dtype == torch.int8
    # control: the tests-only debug copy of the rows' logits is a vocabulary-sized transfer, and is seen
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    runner.hyco.debug_logits = True
    with TransferRecorder() as control:
        s = sessions[0]
        hy.submit(s.sid, 3, *_tree(roots[s.sid], rng))
    runner.hyco.debug_logits = False
    assert control.vocab_sized(VOCAB)
    for s in sessions:
        hy.close(s.sid)
    assert rec.calls, "the recorder saw no transfer at all: is it wired?"
    bad = rec.vocab_sized(VOCAB)
    assert not bad, "vocabulary-sized transfers during tree steps:\n" + "\n".join(
        f"{m}{shape} {nbytes} B from\n{caller}" for m, shape, nbytes, caller in bad[:3])
    # what does come back per round is small: indices, samples, int8 hand-off rows
    assert max(c[2] for c in rec.calls) < 64 * 1024
