"""The endpoint's session table (vllm_hyco/serving/table.py): which sessions expire when, without a server."""

from types import SimpleNamespace

from vllm_hyco.serving.table import UNCONFIRMED_GRACE_S, HeldSession, SessionTable


def _session(sid: bytes, **kw) -> HeldSession:
    s = HeldSession(sid=sid, engine=SimpleNamespace(), endpoint="completions", caps=None, completion_id="c",
                    created=0, ring=None, root=1, root_position=3, node_budget=32)
    s.last_active = 0.0
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_an_unacknowledged_session_whose_socket_went_waits_only_the_grace():
    table = SessionTable(max_sessions=8, idle_timeout_s=60.0)
    assert table.unconfirmed_grace_s == UNCONFIRMED_GRACE_S < 60.0
    gone = _session("a" * 16, delivered=True, left_at=0.0)  # verdict 0 sent, never acknowledged, socket gone
    confirmed = _session("b" * 16, delivered=True, acknowledged=True, left_at=0.0)  # resumable: idle timeout
    driven = _session("c" * 16, delivered=True, owner=object())  # its connection is still there
    for s in (gone, confirmed, driven):
        table.add(s)
    assert table.expired(now=UNCONFIRMED_GRACE_S - 0.1) == []
    assert table.expired(now=UNCONFIRMED_GRACE_S + 0.1) == [gone]
    assert table.expired(now=60.1) == [gone, confirmed, driven]
    assert SessionTable(8, idle_timeout_s=4.0).unconfirmed_grace_s == 4.0  # never longer than the idle timeout
