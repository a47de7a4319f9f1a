"""A whole HyCo session on the fixture shaped like the real Gemma 4 26B-A4B checkpoint, over the real server,
against plain vLLM serving the same checkpoint.

Per variant (every layer owning its KV cache; KV-shared trailing layers), two servers of ``DIR/verifier``
(``tests/checkpoint_shaped.py``: ``Gemma4ForConditionalGeneration``, text model under ``language_model.``,
262,144-token vocabulary, 128 experts top-8, ``--language-model-only``) start together, and the next
variant's two start while this one's tests run (server start-ups are most of this file's time):

* **plain**: ``vllm-hyco serve DIR/verifier`` without ``--speculative-config`` (plain vLLM, the plugin
  loaded but inactive; docs/deploy.md's fast start, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), asked through
  the official ``openai`` client, greedy, with ``logprobs=2``: the reference tokens and plain's top-2
  log-probabilities at every step, one server per variant for every reference;
* **HyCo**: the same with ``--speculative-config hyco`` (the server's defaults: exact verification, the
  adaptive budget policy).

Two phones run against the HyCo server, with drafters from the same bundle (``load_bundle``: the MTP head
on the hand-off rows + the SLM, flat hand-off scales), both with the phone's default options (no forced
node budget):

* **bundle**: the real ``hyco-phone`` console script, as a subprocess (``--prompt-ids``, greedy). It prints
  the committed text (stdout) and writes the committed token ids and its rounds (``--json-out``: each
  round's committed count and text); the ids are compared, and the text must be their decoding, round by
  round (each round's text is the decoding of exactly its committed count of tokens).
* **planted**: ``hyco-phone`` cannot plant tokens, so this phone is an in-process ``PhoneSession`` +
  ``HycoClient`` (the code ``hyco-phone`` runs) whose drafter grafts plain decoding's next tokens ahead of
  the bundle drafter's tree (random weights accept almost nothing otherwise): deep acceptance (a path of
  depth >= 3 is accepted). Its token ids are compared directly.

Comparison (``walk``): HyCo's committed tokens must be plain greedy decoding's, token for token, with one
stated exception, float32 near-ties (``NEAR_TIE``): a step where plain's top-2 margin is below it and
HyCo committed plain's second token is excused, plain greedy is asked again from the prompt plus HyCo's
tokens up to that step, and the rest is compared token for token with that. Every excused step is printed
(step, plain's token, HyCo's token, margin), recorded as a ``near_ties`` property of the test and raised as a
``NearTieWarning`` (pytest's warnings summary shows it in CI's log). Any other divergence fails.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from checkpoint_shaped import HYCO, bundle, launch_server, stop_servers, wait_servers
from tolerances import TOLERANCES

from mobile_client.cli import load_bundle
from mobile_client.client import HycoClient, Timeouts
from mobile_client.session import PhoneSession, SessionOptions
from mobile_client.tree import DraftTree

API_KEY = "hyco-shaped-key"
NAME = "shaped"
PROMPT = [2, 1427, 281, 2099, 430, 3304, 281, 814]  # "In the beginning God created the heaven"
MAX_TOKENS = 12
# A near-tie: plain's top-2 log-probability margin (= the difference of the two logits) below the float32
# logit tolerance the suite already allows between the engine's tree path and a plain forward of the same
# text (tests/tolerances.py ``logits_engine_vs_prefill``: atol 1e-3, rtol 1e-3). A tree forward batches other
# rows, so its sums run in another order, and a last-bit change can route a token to other experts (128
# random routers, top-8: ``kv_engine_vs_prefill_moe128``); each logit may then move by atol + rtol * |logit|.
# This random fixture's logits spread over about 1 (its top log-probabilities are about -11.7 against
# -ln 262,144 = -12.48), so the worst case for a margin (two logits moving apart) is 2 * (1e-3 + 1e-3) =
# 4e-3. We take atol alone, 1e-3: about 170x the margin at which a tree forward was seen to pick plain's
# second token (about 6e-6), and below every margin of plain's reference steps measured on both variants
# (smallest 3.9e-3 over 24 steps, most 1e-2..9e-2), so none of those steps would be excusable.
NEAR_TIE = TOLERANCES[("logits_engine_vs_prefill", torch.float32)][0]
PLANT_DEPTH = 4


class NearTieWarning(UserWarning):
    """A divergence from plain greedy decoding excused as a float32 near-tie (see ``NEAR_TIE``)."""


@dataclass
class Plain:
    """Plain greedy decoding of ``context``: its tokens, text, finish reason, and at each step the best
    other token and the top-2 margin (log-probability of the chosen token minus that of the other)."""

    context: list[int]
    ids: list[int]
    text: str
    finish_reason: str
    second: list[int]
    margin: list[float]


def plain_greedy(oai: openai.OpenAI, context: list[int], max_tokens: int) -> Plain:
    choice = oai.completions.create(
        model=NAME, prompt=context, max_tokens=max_tokens, temperature=0, logprobs=2,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True}).choices[0]
    ids = [int(t) for t in choice.model_extra["token_ids"]]
    seconds, margins = [], []
    for step, (tok, top) in enumerate(zip(ids, choice.logprobs.top_logprobs, strict=True)):
        lp = {int(key.removeprefix("token_id:")): value for key, value in top.items()}
        other = max((t for t in lp if t != tok), key=lambda t: lp[t])
        assert lp[tok] >= lp[other], (step, tok, lp)  # greedy took a top-1 token
        seconds.append(other)
        margins.append(lp[tok] - lp[other])
    return Plain(list(context), ids, choice.text, choice.finish_reason, seconds, margins)


@dataclass
class Excused:
    step: int
    plain: int
    hyco: int
    margin: float

    def __str__(self) -> str:
        return (f"step {self.step}: plain {self.plain}, HyCo {self.hyco} (plain's second), "
                f"top-2 margin {self.margin:.3g} < {NEAR_TIE:g}")


def walk(oai: openai.OpenAI, matches, n: int, reference: Plain, detok) -> tuple[list[int], list[Excused]]:
    """HyCo's ``n`` committed tokens against plain greedy decoding from ``PROMPT`` (``reference``).

    ``matches(done, token)``: whether HyCo's token after ``done`` (its tokens so far) is ``token``. At each
    step plain's token must match; else the step must be a near-tie (margin < NEAR_TIE) where HyCo took
    plain's second token: then plain greedy is asked again from the prompt plus HyCo's tokens so far, and
    the walk goes on against that. Returns (HyCo's tokens, the excused steps)."""
    ref, offset, done, excused, margins = reference, 0, [], [], []
    for step in range(n):
        j = step - offset
        assert j < len(ref.ids), (f"HyCo committed {n} tokens; plain greedy stopped after {step} "
                                  f"({ref.finish_reason})")
        margins.append(ref.margin[j])
        if matches(done, ref.ids[j]):
            done.append(ref.ids[j])
            continue
        near = ref.margin[j] < NEAR_TIE
        assert near and matches(done, ref.second[j]), (
            f"step {step}: HyCo's token is not plain greedy's {ref.ids[j]}"
            + (f" nor its second {ref.second[j]}" if near else "")
            + f" (plain's top-2 margin {ref.margin[j]:.3g}, near-tie threshold {NEAR_TIE:g}); HyCo's tokens "
            f"so far {done}, plain's {ref.ids[:j + 1]}: a divergence that is not a near-tie")
        excused.append(Excused(step, ref.ids[j], ref.second[j], ref.margin[j]))
        done.append(ref.second[j])
        offset = len(done)
        if offset == n:  # the last step: nothing left to compare
            ref = Plain(PROMPT + done, [], "", ref.finish_reason, [], [])
            break
        ref = plain_greedy(oai, PROMPT + done, n - offset)
        assert ref.text == detok(ref.ids), ref  # the text the server wrote is the tokens' decoding
    assert n - offset == len(ref.ids), (f"plain greedy continues past HyCo's {n} tokens", ref)
    print(f"\nsmallest top-2 margin of plain's {len(margins)} steps: {min(margins, default=float('nan')):.3g}")
    return done, excused


def report(excused: list[Excused], record_property) -> None:
    """Say what was excused: stdout (shown with -s / -rA, and for a failing test), the junit property
    ``near_ties``, and a NearTieWarning per step (pytest's warnings summary, in every CI log)."""
    record_property("near_ties", "; ".join(map(str, excused)) or "none")
    print(f"near-ties excused: {len(excused)}")
    for e in excused:
        print(f"  excused near-tie at {e}")
        warnings.warn(NearTieWarning(f"checkpoint-shaped HyCo session: excused a float32 near-tie at {e}"),
                      stacklevel=2)


def rounds_line(rounds: list[dict]) -> str:
    """The rounds' accepted depths, nodes sent and nodes granted next, for the test's output."""
    granted = [r.get("node_budget", r.get("budget")) for r in rounds]
    return (f"{len(rounds)} rounds, accepted {[r['accepted'] for r in rounds]}, nodes sent "
            f"{[r['nodes'] for r in rounds]}, granted {granted}")


@dataclass
class Served:
    hyco: str  # the HyCo server's base URL
    root: Path  # the bundle
    oai: openai.OpenAI  # the plain server
    reference: Plain  # plain greedy decoding of PROMPT, MAX_TOKENS tokens
    detok: Callable[[list[int]], str]  # ids -> text, as the server decodes completions


VARIANTS = {False: "own-kv", True: "kv-shared"}


@pytest.fixture(scope="module")
def launched(request):
    """kv_shared -> its (plain, HyCo) servers. A variant's two servers start together; once they answer,
    the next variant the run selected starts too, while this one's tests run (each start loads the
    262,144-token vocabulary and 128 experts: on a 2-core box the start-ups are most of this file's time,
    and two at a time overlap best). Whatever is still running at the end of the module is stopped."""
    mine = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    wanted = [kv for kv in VARIANTS if any(getattr(item, "callspec", None) is not None
                                            and item.callspec.params.get("served", None) is kv for item in mine)]
    servers: dict[bool, list[tuple]] = {}  # launched and not stopped yet
    launched_once: set[bool] = set()
    healthy: set[bool] = set()

    def launch(kv_shared: bool) -> None:
        if kv_shared not in launched_once:
            launched_once.add(kv_shared)
            verifier = bundle(kv_shared) / "verifier"
            # the plain server only answers the references: the fast start (one process fewer to import
            # vLLM into); the HyCo server runs as deployed
            servers[kv_shared] = started = []
            started.append(launch_server(verifier, NAME, API_KEY, speculative=None, fast_start=True))
            started.append(launch_server(verifier, NAME, API_KEY, speculative=HYCO))

    def get(kv_shared: bool) -> list[tuple]:
        launch(kv_shared)
        ready = wait_servers(servers[kv_shared])
        healthy.add(kv_shared)
        for kv in wanted:
            if kv not in launched_once:  # the next variant starts while this one's tests run
                launch(kv)
                break
        return ready

    def stop(kv_shared: bool) -> None:
        # a server still starting (launched ahead, then not needed: -x, an error) has nothing to drain
        stop_servers(servers.pop(kv_shared, []), drain_s=60.0 if kv_shared in healthy else 5.0)

    get.stop = stop
    try:
        yield get
    finally:
        for kv in list(servers):
            stop(kv)


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS.values()))
def served(request, launched):
    """A plain and a HyCo server of one variant (every layer owns its KV cache / trailing layers share
    another layer's), the plain reference of PROMPT, and the tokenizer's decoding."""
    from tokenizers import Tokenizer

    root = bundle(request.param)
    try:
        (plain, _, _), (hyco, _, _) = launched(request.param)
        oai = openai.OpenAI(base_url=f"{plain}/v1", api_key=API_KEY, timeout=300, max_retries=0)
        tok = Tokenizer.from_file(str(root / "verifier" / "tokenizer.json"))
        detok = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731
        reference = plain_greedy(oai, PROMPT, MAX_TOKENS)
        # the length this test is about, and the decoding the text checks rely on
        assert reference.finish_reason == "length" and len(reference.ids) == MAX_TOKENS, reference
        assert reference.text == detok(reference.ids), reference
        yield Served(hyco, root, oai, reference, detok)
    finally:
        launched.stop(request.param)


def hyco_phone(served: Served, out: Path) -> tuple[str, dict, str]:
    """The ``hyco-phone`` console script against the HyCo server, greedy, default options:
    (stdout: the committed text, the ``--json-out`` contents, stderr)."""
    script = Path(sys.executable).parent / "hyco-phone"
    exe = [str(script)] if script.exists() else [sys.executable, "-m", "mobile_client.cli"]
    cmd = [*exe, "--server", served.hyco, "--api-key", API_KEY, "--model-dir", str(served.root),
           "--model-name", NAME, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", str(MAX_TOKENS),
           "--temperature", "0", "--timeout", "300", "--json-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    # exit 0: every verdict was applied; a verdict without a hand-off (on any round but the finishing one)
    # fails the session (``PhoneSession.apply_verdict``: bad_verdict) and hyco-phone exits 2
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text()), proc.stderr


def test_hyco_phone_with_bundle_drafters_equals_plain(served, tmp_path, record_property):
    text, out, err = hyco_phone(served, tmp_path / "phone.json")
    assert "SLM-only trees" not in err  # the MTP chain runs (hand-off scales found): a hand-off every round
    summary, rounds = out["summary"], out["rounds"]
    # the round lines and the summary it printed agree with its JSON and with the server's final frame:
    # every round's verdict (and, but for the finishing one, its hand-off) was applied
    assert [r["round"] for r in rounds] == list(range(len(rounds)))
    assert summary["rounds"] == summary["server"]["rounds"] == len(rounds)
    assert sum(f"round {r['round']:3d}:" in err for r in rounds) == len(rounds)
    assert summary["finish_reason"] == "length" and summary["tokens"] == MAX_TOKENS
    assert sum(r["committed"] for r in rounds) == MAX_TOKENS and "".join(r["text"] for r in rounds) == text

    ids = out["token_ids"]
    assert len(ids) == MAX_TOKENS
    tokens, excused = walk(served.oai, lambda done, token: ids[len(done)] == token, MAX_TOKENS, served.reference,
                           served.detok)
    report(excused, record_property)
    assert tokens == ids and served.detok(tokens) == text
    # each round's text is the decoding of its committed count of those tokens
    end = 0
    for r in rounds:
        end += r["committed"]
        assert served.detok(tokens[:end]) == "".join(x["text"] for x in rounds[:r["round"] + 1]), r
    print(f"hyco-phone: {rounds_line(rounds)}")


class Planted:
    """The bundle drafter's tree plus plain decoding's next ``depth`` tokens, planted as a chain from the
    root in the first rows: nodes the SLM never computed, so the phone catches them up. The bundle
    drafter's nodes follow, merged where they repeat a planted token, up to the node budget. Every row gets
    the same label and a score by its depth (``make_dummy``), so the order the phone sends (by value, then
    score, then row) puts each planted row first among the rows of its depth, and any prefix the server's
    adaptive budget verifies holds the planted chain down to the deepest depth it reaches. Plain's
    continuation is asked again when the committed tokens leave it (an excused near-tie)."""

    def __init__(self, inner, oai: openai.OpenAI, target: list[int], depth: int = PLANT_DEPTH):
        self.inner, self.oai, self.target, self.depth, self.session = inner, oai, list(target), depth, None
        for hook in ("prefill", "accept", "apply_handoff"):
            setattr(self, hook, getattr(inner, hook))

    def propose(self, context, node_budget):
        done = list(self.session.tokens)
        if self.target[:len(done)] != done:
            self.target = done + plain_greedy(self.oai, PROMPT + done, MAX_TOKENS - len(done)).ids
        tree = self.inner.propose(context, max(node_budget - self.depth, 1))
        tokens, parents = [tree.tokens[0]], [-1]
        for y in self.target[len(done):len(done) + min(self.depth, node_budget)]:
            tokens.append(y)
            parents.append(len(tokens) - 2)
        row = {0: 0}  # the bundle tree's row -> the planted tree's
        for r in range(1, len(tree.tokens)):
            parent = row.get(tree.parents[r])
            if parent is None:
                continue
            same = [i for i in range(1, len(tokens)) if parents[i] == parent and tokens[i] == tree.tokens[r]]
            if same:
                row[r] = same[0]
            elif len(tokens) - 1 < node_budget:
                tokens.append(tree.tokens[r])
                parents.append(parent)
                row[r] = len(tokens) - 1
        return DraftTree.make_dummy(tokens, parents, node_budget)


def test_planted_phone_session_equals_plain(served, record_property):
    phone = load_bundle(served.root)
    assert phone.drafter.mtp is not None, phone.notes  # the MTP chain runs: a hand-off every round
    drafter = Planted(phone.drafter, served.oai, served.reference.ids)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    session = PhoneSession(drafter, prompt_tokens=PROMPT, request=body, endpoint="completions",
                           spec=phone.spec, options=SessionOptions(keep_set_hash=phone.keep_set_hash))
    drafter.session = session
    rounds = []
    client = HycoClient(served.hyco, API_KEY, timeouts=Timeouts(connect_s=60, frame_s=300, final_s=60),
                        offload=False)
    asyncio.run(client.run(session, on_round=rounds.append))
    assert len(session.tokens) == MAX_TOKENS
    tokens, excused = walk(served.oai, lambda done, token: session.tokens[len(done)] == token, MAX_TOKENS,
                           served.reference, served.detok)
    report(excused, record_property)
    assert tokens == session.tokens and "".join(session.text_parts) == served.detok(session.tokens)
    if not excused:
        assert "".join(session.text_parts) == served.reference.text
    assert session.finish_reason == "length" and session.final.rounds == len(rounds)
    # every round but the finishing one carried a hand-off that the phone applied (apply_verdict refuses a
    # verdict without one); the MTP head's ring now ends at the last root
    assert phone.drafter.mtp is not None and session.held_round == len(rounds) - 1
    print(f"planted: {rounds_line([vars(r) for r in rounds])}")
    assert max(r.accepted for r in rounds) >= 3
