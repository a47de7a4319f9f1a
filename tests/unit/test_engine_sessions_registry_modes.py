"""The session registry's mode switches (vLLM-free): at a round boundary only, and the round after a
server-mode stretch owes the phone the window's K/V."""

from __future__ import annotations

import pytest

from vllm_hyco.errors import SessionError
from vllm_hyco.vllm_adapter.engine_core.sessions import RoundTree, SessionRegistry, SessionState


def test_a_stretch_of_server_mode_is_one_round_and_owes_a_seed():
    reg = SessionRegistry(clock=lambda: 0.0)
    s = reg.add("s", req_id="r", eps=None)
    with pytest.raises(SessionError, match="round boundary") as err:
        reg.check_switch("s", "server", 0)  # still prefilling
    assert err.value.code == "mid_round"
    reg.mark_parked(s)
    reg.mark_server(reg.check_switch("s", "server", 0))
    assert s.mode == "server" and s.state is SessionState.SERVER
    with pytest.raises(SessionError) as err:
        reg.check_submit("s", 0)
    assert err.value.code == "wrong_mode"
    reg.end_server_stretch(reg.check_switch("s", "phone", 0))
    assert (s.mode, s.expected_round, s.seed_due) == ("phone", 1, True)
    assert reg.check_submit("s", 1) is s


@pytest.mark.parametrize("mode, round_, code", [("cloud", 0, "bad_mode"), ("server", 1, "future_round")])
def test_bad_switches_are_typed(mode, round_, code):
    reg = SessionRegistry(clock=lambda: 0.0)
    reg.mark_parked(reg.add("s", req_id="r", eps=None))
    with pytest.raises(SessionError) as err:
        reg.check_switch("s", mode, round_)
    assert err.value.code == code


def test_no_switch_while_verifying():
    reg = SessionRegistry(clock=lambda: 0.0)
    s = reg.add("s", req_id="r", eps=None)
    reg.mark_parked(s)
    reg.start_round(s, RoundTree(round=0, tokens=[1, 2], parents=[-1, 0], eps=None))
    with pytest.raises(SessionError) as err:
        reg.check_switch("s", "server", 0)
    assert err.value.code == "mid_round"
