"""PhoneSession (Algorithm 1 on the phone) as a pure state machine: frames in, frames out, no network.

Verdicts are built with the wire module's own dataclasses (``vllm_hyco.handoff``) and dummy-pattern
hand-offs, so every check here is about the session's bookkeeping: roots and positions, commits, catch-up
rows, budgets, replays, seeds, and rejecting verdicts that contradict the tree (nothing committed then).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from mobile_client.session import HycoPhoneDrafter, PhoneSession, SessionOptions, fmt_round, node_values
from mobile_client.tree import DraftTree
from vllm_hyco.errors import FrameError, HandoffSchemaError, SessionError
from vllm_hyco.handoff import (
    HandoffPayload,
    HandoffScales,
    HandoffSpec,
    LayerSpec,
    SessionFrame,
    TreeFrame,
    VerdictFrame,
    encode_frame,
    openai_chunk,
)

LAYERS = (LayerSpec(2, "sliding", kv_heads=2, head_dim=4, window=8),
          LayerSpec(3, "full", kv_heads=1, head_dim=8, window=0, k_eq_v=True, has_v=False))
SCALES = HandoffScales(np.full(6, 0.5, np.float32), np.full(6, 0.25, np.float32),
                       ((2, np.full((2, 4), 0.1, np.float32), np.full((2, 4), 0.2, np.float32)),
                        (3, np.full((1, 8), 0.3, np.float32), None)))
SPEC = HandoffSpec.from_scales({"model_type": "toy"}, LAYERS, SCALES)
SID = "r1." + bytes(range(16)).hex()
PROMPT = [5, 6, 7, 8]


class Recorder:
    """A drafter with every hook: a fixed-shape tree (a chain of 3 and one sibling), calls recorded."""

    def __init__(self, keep=0):
        self.keep, self.calls = keep, []

    def prefill(self, tokens):
        self.calls.append(("prefill", list(tokens)))

    def propose(self, context, node_budget):
        self.calls.append(("propose", context.root, context.catch_up, context.x_hat is not None, node_budget))
        r = context.root
        n = node_budget + 1
        tokens, parents = [r, r + 1, r + 2, r + 3, r + 9][:n], [-1, 0, 1, 2, 0][:n]
        a = -0.5  # the sibling scores last, so the value order the phone sends is this insertion order
        scores, sources = [0.0, a, 2 * a, 3 * a, 4 * a][:n], [0, 1, 1, 1, 2][:n]
        return DraftTree(tuple(tokens), tuple(parents), tuple(scores), tuple(sources), node_budget)

    def accept(self, rows):
        self.calls.append(("accept", list(rows)))
        return min(self.keep, len(rows))

    def apply_handoff(self, h):
        self.calls.append(("handoff", h.header.span_start, h.header.root_position))
        return np.zeros(12, np.float32)


def session(drafter=None, **opts):
    return PhoneSession(drafter or Recorder(), prompt_tokens=PROMPT, request={"prompt": PROMPT},
                        endpoint="completions", spec=SPEC, options=SessionOptions(**opts))


def started(drafter=None, **opts):
    """A session granted 32 nodes, as the server's ``session`` frame grants them, without the frame (no schema
    hash to confirm: the trees go out exactly as drafted)."""
    s = session(drafter, **opts)
    s.node_budget = 32
    return s


def verdict(rnd, path, tokens, a, root, *, node_budget=32, finish=None, handoff=True):
    bonus = None if finish else tokens[-1]
    h = HandoffPayload.make_dummy(SPEC, a, root, bonus, salt=rnd) if handoff and not finish else None
    chunk = openai_chunk("text_completion", "c", "m", "".join(f"<{t}>" for t in tokens), finish, created=0)
    return VerdictFrame(rnd, tuple(path), tuple(tokens), bonus, h, None, 0 if finish else node_budget, chunk)


def ack(last_round=-1, node_budget=32, sid=SID, spec=SPEC):
    return SessionFrame(sid, last_round, node_budget, spec)


def test_round0_is_rooted_at_last_prompt_token_with_prefill():
    d = Recorder()
    s = started(d)
    frame = s.next_tree()
    assert frame.round == 0 and frame.tokens[0] == 8 and s.position == 3
    assert d.calls[:2] == [("prefill", [5, 6, 7]), ("propose", 8, (), False, 32)]
    assert s.next_tree() is frame and len(d.calls) == 2  # the tree in flight is resent, not redrafted


def test_start_frames_new_and_resume():
    s = session(node_budget=16, mode="epsilon", epsilon=0.001)
    start = s.start_frame()
    assert start.request == {"prompt": PROMPT} and start.hyco.resume is None
    assert start.hyco.capabilities.node_budget == 16 and start.hyco.fingerprint == SPEC.fingerprint
    assert start.hyco.capabilities.handoff_schemas == (2, 3)  # K/V rows, and h rows (schema 3)
    assert (start.hyco.mode, start.hyco.epsilon) == ("epsilon", 0.001)
    s.apply_session(ack(node_budget=12))
    assert s.sid == SID and s.node_budget == 12 and not s.resumable
    assert s.start_frame().hyco.resume is None and s.sid is None  # no verdict yet: start over
    s.apply_session(ack())
    s.next_tree()
    s.apply_verdict(verdict(0, [1, 2], [9, 10, 77], 0, 6))
    s.need_seed = True
    resume = s.start_frame()
    assert resume.request is None and resume.hyco.resume.session_id == SID
    assert (resume.hyco.resume.last_round, resume.hyco.resume.need_seed) == (0, True)


def test_apply_verdict_commits_path_and_bonus_and_tracks_positions():
    d = Recorder(keep=2)
    s = started(d)
    streamed = []
    s.on_text = streamed.append
    s.next_tree()  # root 8 at position 3: rows 8, 9, 10, 11, 17
    st = s.apply_verdict(verdict(0, [1, 2], [9, 10, 77], 0, 6, node_budget=3), wait_ms=1.5, bytes_down=99)
    assert s.tokens == [9, 10, 77] and streamed == ["<9><10><77>"] and s.root == 77 and s.position == 6
    assert (st.accepted, st.committed, st.nodes, st.wait_ms, st.bytes_down) == (2, 3, 4, 1.5, 99)
    assert ("accept", [0, 1, 2]) in d.calls and ("handoff", 0, 6) in d.calls
    assert s.catch_up == (10,)  # root and row 1 were kept by the drafter; row 2 (token 10) was not
    frame = s.next_tree()
    # the learned order: the drafter builds at the phone's own budget, the head of the granted 3 is sent
    assert d.calls[-1] == ("propose", 77, (10,), True, 32) and s.catch_up == ()
    assert len(frame.tokens) <= 4
    assert "round   0" in fmt_round(st)
    s = started(Recorder(keep=2), order="score")  # the score order: the drafter gets the granted budget
    s.next_tree()
    s.apply_verdict(verdict(0, [1, 2], [9, 10, 77], 0, 6, node_budget=3))
    s.next_tree()
    assert s.drafter.calls[-1] == ("propose", 77, (10,), True, 3)


@pytest.mark.parametrize("bad,code", [
    (dict(rnd=1), "bad_verdict"),  # not the round in flight
    (dict(path=[1, 4]), "bad_verdict"),  # row 4 is the root's child, not row 1's
    (dict(tokens=[9, 99, 77]), "bad_verdict"),  # ids differ from the path's tokens
    (dict(root=7), "bad_handoff"),  # hand-off root position != 3 + 2 + 1
])
def test_contradicting_verdicts_commit_nothing(bad, code):
    s = started()
    frame = s.next_tree()
    kw = dict(rnd=0, path=[1, 2], tokens=[9, 10, 77], a=0, root=6) | bad
    v = verdict(kw.pop("rnd"), kw.pop("path"), kw.pop("tokens"), kw.pop("a"), kw.pop("root"), **kw)
    with pytest.raises((FrameError, HandoffSchemaError)) as e:
        s.apply_verdict(v)
    assert e.value.code == code
    assert s.tokens == [] and s.held_round == -1 and s.next_tree() is frame


def test_the_first_trees_after_a_session_frame_confirm_its_schema():
    s = session()
    s.apply_session(ack())
    first = s.next_tree()
    assert first.schema == SPEC.schema_hash and s.next_tree().schema == SPEC.schema_hash  # resent: still
    s.apply_verdict(verdict(0, [1], [9, 40], 0, 5))
    sent = s.next_tree()
    assert sent.schema is None and s.resumable
    # a resume: the new session frame asks for a confirmation again, and the replay of a verdict whose tree
    # went out before it does not count as one
    s.apply_session(ack(last_round=0))
    assert s.next_tree().schema == SPEC.schema_hash
    s2 = session()
    s2.apply_session(ack())
    s2.next_tree()
    s2.apply_session(ack())  # reconnected before verdict 0 arrived... (same ack, a new epoch)
    s2._pending.schema_epoch = 0  # ...and the tree in flight went out on the old connection
    s2.apply_verdict(verdict(0, [1], [9, 40], 0, 5))
    assert s2.next_tree().schema == SPEC.schema_hash


@pytest.mark.parametrize("bad, code", [
    (dict(sid="r2." + "0" * 32), "bad_field_value"),  # the server names another session
    (dict(spec=dataclasses.replace(SPEC, fingerprint=bytes(16))), "fingerprint_mismatch"),
    (dict(spec=dataclasses.replace(SPEC, layers=LAYERS[:1])), "layout_mismatch"),
])
def test_a_resumed_session_frame_must_be_the_same_session_and_schema(bad, code):
    s = session()
    s.apply_session(ack())
    s.next_tree()
    s.apply_verdict(verdict(0, [1], [9, 40], 0, 5))
    with pytest.raises((FrameError, HandoffSchemaError)) as e:
        s.apply_session(ack(last_round=0, **bad))
    assert e.value.code == code


def test_a_resume_checks_the_schema_hash_even_without_a_model_spec():
    """A phone without a model bundle (SLM-only) takes the server's schema, and a resume must restate it."""
    s = PhoneSession(Recorder(), prompt_tokens=PROMPT, request={"prompt": PROMPT}, endpoint="completions")
    s.apply_session(ack())
    s.next_tree()
    s.apply_verdict(verdict(0, [1], [9, 40], 0, 5))
    other = dataclasses.replace(SPEC, scales_id=bytes(16))
    with pytest.raises(HandoffSchemaError) as e:
        s.apply_session(ack(last_round=0, spec=other))
    assert e.value.code == "schema_mismatch"
    restored = PhoneSession.restore(Recorder(), s.snapshot())
    assert restored.sid == SID and restored.resumable and restored.schema_hash == SPEC.schema_hash
    assert restored.start_frame().hyco.resume.session_id == SID
    with pytest.raises(HandoffSchemaError):
        restored.apply_session(ack(last_round=0, spec=other))
    restored.apply_session(ack(last_round=0))
    assert restored.schema == SPEC


def test_node_values_are_sent_when_asked():
    s = started(values=True)
    frame = s.next_tree()
    tree = s._pending.tree
    assert frame.values == tuple(node_values(tree)) and frame.values[0] == 255
    assert all(0 <= x <= 255 for x in frame.values)
    back = TreeFrame.from_lists(0, frame.tokens, frame.parents, frame.labels, frame.values)
    assert len(encode_frame(back)) == len(encode_frame(frame)) and started().next_tree().values is None


def test_replays_are_ignored_and_a_seed_is_taken():
    d = Recorder()
    s = started(d)
    s.next_tree()
    s.apply_verdict(verdict(0, [1], [9, 40], 0, 5))
    n = len(d.calls)
    assert s.apply_verdict(verdict(0, [1], [9, 40], 0, 5)) is None and len(d.calls) == n  # replay
    s.need_seed = True
    assert s.apply_verdict(verdict(0, [1], [9, 40], 0, 5)) is None
    assert d.calls[-1] == ("handoff", 0, 5) and not s.need_seed and s.tokens == [9, 40]


def test_finished_verdict_ends_the_session():
    s = started()
    s.next_tree()
    st = s.apply_verdict(verdict(0, [1, 2, 3], [9, 10], 0, 0, finish="length"))
    assert s.finished and s.finish_reason == "length" and st.committed == 2 and s.tokens == [9, 10]
    with pytest.raises(SessionError):
        s.next_tree()
    assert s.result().text == "<9><10>" and s.result().mat == 2.0


def test_missing_handoff_on_unfinished_verdict():
    s = started()
    s.next_tree()
    v = verdict(0, [], [40], 0, 4)
    with pytest.raises(FrameError):
        s.apply_verdict(VerdictFrame(0, (), (40,), 40, None, None, 32, v.chunk))


def test_drafter_over_budget_is_refused():
    class Greedy(Recorder):
        def propose(self, context, node_budget):
            return DraftTree.make_dummy([context.root, 1, 2, 3], [-1, 0, 1, 2])
    s = started(Greedy(), order="score")  # the drafter is asked for the granted 2 and builds 3
    s.next_tree()
    s.apply_verdict(verdict(0, [], [40], 0, 4, node_budget=2))
    with pytest.raises(SessionError) as e:
        s.next_tree()
    assert e.value.code == "bad_draft"
    s = session(Greedy(), node_budget=2)  # learned order: asked for the phone's own 2
    s.apply_session(SessionFrame(SID, -1, 2, SPEC))
    with pytest.raises(SessionError, match="over the budget") as e:
        s.next_tree()
    s = started(Greedy())  # asked for 32, built 3: the head of the granted 2 goes out
    s.next_tree()
    s.apply_verdict(verdict(0, [], [40], 0, 4, node_budget=2))
    assert len(s.next_tree().tokens) == 3


def test_phone_drafter_dequantizes_the_handoff_into_the_mtp_ring():
    class Mtp:
        def apply_handoff(self, t, a, rows):
            self.got = (t, a, rows)

    mtp = Mtp()
    phone = HycoPhoneDrafter(Recorder(), mtp=mtp, scales=SCALES)
    h = HandoffPayload.make_dummy(SPEC, 3, 7, 11)
    x_hat = phone.apply_handoff(h)
    t, a, rows = mtp.got
    assert (t, a) == (7, 3) and set(rows) == {"sliding_attention", "full_attention"}
    np.testing.assert_array_equal(rows["sliding_attention"][0], h.k[0].astype(np.float32) * np.float32(0.1))
    np.testing.assert_array_equal(rows["sliding_attention"][1], h.v[0].astype(np.float32) * np.float32(0.2))
    assert rows["full_attention"][1] is rows["full_attention"][0]  # has_v=False: V rows are the K rows
    want = np.concatenate([h.e_bonus * np.float32(0.5), h.h * np.float32(0.25)])
    np.testing.assert_array_equal(x_hat, want)
    with pytest.raises(SessionError):
        HycoPhoneDrafter(Recorder(), mtp=mtp)  # an MTP drafter without scales


def test_proactive_tree_is_reused_only_when_the_bet_holds():
    class Bet:
        def __init__(self, tree, path, bonus):
            self.tree, self.key = tree, (tuple(path), bonus)

        def matches(self, accepted, bonus):
            return (tuple(accepted), bonus) == self.key

    prepared = DraftTree.make_dummy([40, 41, 42], [-1, 0, 1])
    s = started(proactive=lambda tree: Bet(prepared, [9], 40))
    s.next_tree()
    s.prepare_proactive()
    s.apply_verdict(verdict(0, [1], [9, 40], 0, 5))
    frame = s.next_tree()
    assert frame.tokens == (40, 41, 42) and s._pending.proactive_hit is True
    s.prepare_proactive()
    s.apply_verdict(verdict(1, [], [66], 5, 6))  # the bet said [41], 42... it missed
    frame = s.next_tree()
    assert frame.tokens[0] == 66 and s._pending.proactive_hit is False


@pytest.mark.parametrize("bad", [dict(mode="lossy"), dict(epsilon=0.01), dict(mode="epsilon", epsilon=1.0),
                                 dict(node_budget=0), dict(node_budget=255), dict(max_message_bytes=1024)])
def test_session_options_are_validated(bad):
    from vllm_hyco.errors import ConfigError

    with pytest.raises(ConfigError):
        SessionOptions(**bad)


def test_accept_gets_the_accepted_tokens_when_the_drafter_takes_them():
    """The tree sent was trimmed after the SLM's forward (rows re-indexed), so the session also hands the
    drafter the accepted rows' tokens (root first); a reused proactive tree hands it nothing."""
    class ByTokens(Recorder):
        def accept(self, rows, tokens=None):
            self.calls.append(("accept", list(rows), list(tokens)))
            return 1

    d = ByTokens()
    s = started(d)
    s.next_tree()  # 8 -> 9 -> 10 -> 11, 8 -> 17
    s.apply_verdict(verdict(0, [1, 2], [9, 10, 77], 0, 6))
    assert ("accept", [0, 1, 2], [8, 9, 10]) in d.calls and s.catch_up == (9, 10)


def test_no_tree_is_drafted_before_the_session_frame_grants_a_node_budget():
    d = Recorder()
    s = session(d)
    assert s.node_budget is None and s.start_frame().hyco.capabilities.node_budget == 32
    with pytest.raises(SessionError, match="session") as e:
        s.next_tree()
    assert e.value.code == "no_session_frame" and d.calls == [] and not s.tree_in_flight
    s.apply_session(ack(node_budget=12))
    assert s.node_budget == 12 and s.next_tree().round == 0


def test_every_grant_is_clamped_to_the_phones_own_node_budget():
    d = Recorder()
    s = session(d, node_budget=3, order="score")  # the score order: the drafter is asked for the grant
    s.apply_session(ack(node_budget=32))  # the server grants more than the phone builds
    assert s.node_budget == 3
    s.next_tree()
    assert d.calls[-1][-1] == 3
    s.apply_verdict(verdict(0, [1], [9, 40], 0, 5, node_budget=32))
    assert s.node_budget == 3
    s.next_tree()
    s.apply_verdict(verdict(1, [], [41], 5, 6, node_budget=2))
    assert s.node_budget == 2
    s.next_tree()
    assert d.calls[-1][-1] == 2
    s.apply_session(ack(last_round=1, node_budget=0))  # a finished session's frame grants nothing: kept
    assert s.node_budget == 2
    s.apply_verdict(verdict(2, [], [], 6, 7, finish="stop"))  # the finishing verdict (budget 0): kept
    assert s.finished and s.node_budget == 2 and s.stats[-1].budget == 0


def test_snapshots_keep_the_node_budget_and_old_snapshots_still_restore():
    s = started()
    s.next_tree()
    s.apply_verdict(verdict(0, [1], [9, 40], 0, 5, node_budget=7))
    s.next_tree()
    snap = json.loads(json.dumps(s.snapshot()))
    assert snap["node_budget"] == 7 and "budget" not in snap
    assert PhoneSession.restore(Recorder(), snap, spec=SPEC).node_budget == 7
    old = {("budget" if k == "node_budget" else k): v for k, v in snap.items()}  # written before the rename
    restored = PhoneSession.restore(Recorder(), old, spec=SPEC)
    assert restored.node_budget == 7 and restored._pending.tree.node_budget == 7
    assert restored.next_tree().tokens == tuple(snap["pending"]["tokens"])  # the tree in flight, resent


def test_session_options_name_the_node_budget_when_it_is_out_of_range():
    from vllm_hyco.errors import ConfigError

    with pytest.raises(ConfigError, match="node_budget must be 1..254"):
        SessionOptions(node_budget=0)
