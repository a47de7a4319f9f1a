"""The mode rule (mobile_client.mode_rule.ModeRule) on measured numbers, no server: it keeps phone mode while
the phone keeps the floor, leaves after the hysteresis window when it does not (at once for the power flag),
comes back only when its estimate with the catch-up beats the floor by the margin, never asks again right after
a refusal, and starts in server mode when the first probe already puts the phone under the floor; where the
server says phone mode saves it less than half the cost margin (and server mode meets the floor) it takes
server mode at once, and comes back only when phone mode saves the whole margin."""

from mobile_client.mode_rule import Alternate, ModeRule, ModeRuleConfig, PhoneOnly, ServerOnly

CFG = ModeRuleConfig(floor_tps=6.0, hold_s=1.0, margin=0.25, min_rounds=3)


def rounds(rule, n, tokens, draft_s, wait_s, t0=0.0, dt=0.5):
    for i in range(n):
        rule.observe_round(tokens, draft_s, wait_s, t0 + i * dt)


def test_stays_in_phone_mode_above_the_floor_and_leaves_after_the_window_below_it():
    rule = ModeRule(CFG)
    rule.observe_rtt(0.05, 0.0)
    assert rule.decide("phone", 0.0) is None  # the probe says the phone keeps the floor: start drafting
    rounds(rule, 5, tokens=3, draft_s=0.05, wait_s=0.1)  # 20 tok/s
    assert rule.decide("phone", 3.0) is None
    rule.observe_rtt(0.4, 3.0)
    rounds(rule, 6, tokens=2, draft_s=0.05, wait_s=0.45, t0=3.0)  # 4 tok/s: under the floor
    assert rule.decide("phone", 6.0) is None  # the reason starts now
    assert rule.decide("phone", 6.5) is None  # inside the hysteresis window
    assert rule.decide("phone", 7.1) == "server"


def test_back_to_phone_only_with_the_margin_and_the_catch_up():
    rule = ModeRule(CFG)
    rule.observe_rtt(0.3, 0.0)
    rounds(rule, 4, tokens=2, draft_s=0.05, wait_s=0.35)
    rule._switch("server")
    assert rule.decide("server", 10.0, remaining=200) is None  # still a 300 ms link
    for _ in range(20):
        rule.observe_rtt(0.02, 10.0)
    est = rule.phone_estimate(remaining=200)
    assert est >= CFG.floor_tps * (1 + CFG.margin)
    assert rule.decide("server", 10.0, remaining=200) is None
    assert rule.decide("server", 11.1, remaining=200) == "phone"
    assert rule.phone_estimate(remaining=2) < rule.phone_estimate(remaining=200)  # the catch-up is counted


def test_power_flag_refusals_and_the_first_probe():
    power = {"ok": True}
    rule = ModeRule(CFG, power_ok=lambda: power["ok"])
    rule.observe_rtt(0.05, 0.0)
    rounds(rule, 3, tokens=3, draft_s=0.05, wait_s=0.1)
    power["ok"] = False
    assert rule.decide("phone", 1.0) is None and rule.decide("phone", 2.0) == "server"
    rule.refused(2.0)
    assert rule.decide("phone", 5.0) is None  # not again within retry_s
    slow = ModeRule(CFG)
    slow.observe_rtt(0.35, 0.0)
    assert slow.decide("phone", 0.0) == "server"  # 300+ ms before the first tree: start in server mode
    off = ModeRule(CFG)
    off.observe_rtt(0.35, 0.0)
    off.observe_offer(False, 0.0)
    assert off.decide("phone", 0.0) is None  # the server does not offer it


def test_the_servers_costs_decide_where_it_says_phone_mode_does_not_save_it_anything():
    cheap = ModeRule(CFG)
    cheap.observe_offer(True, 200.0, phone_ms=4.5, server_ms=3.9)  # the session frame's offer
    assert cheap.decide("phone", 0.0) == "server"  # before the first tree, no probe: phone drafting saves nothing
    assert cheap.decide("server", 5.0, remaining=200) is None  # a fast link does not bring it back
    cheap.observe_offer(True, 200.0, phone_ms=3.7, server_ms=4.0)  # phone mode saves 7.5 %: inside the band, stays
    for _ in range(10):
        cheap.observe_rtt(0.01, 5.0)
    assert cheap.decide("server", 6.0, remaining=200) is None and cheap.decide("server", 8.0, remaining=200) is None
    cheap.observe_offer(True, 200.0, phone_ms=3.0, server_ms=4.0)  # phone mode is the cheaper again
    assert cheap.decide("server", 9.0, remaining=200) is None and cheap.decide("server", 10.1, remaining=200) == "phone"

    for offer, why in (((True, 200.0, 3.7, 4.0), "phone saves 7.5 %: inside the band"),
                       ((True, 3.0, 4.5, 3.9), "server mode under the floor"),
                       ((True, 200.0, 3.0, 4.0), "phone mode is cheaper"), ((True, 200.0, 0.0, 3.9), "unknown"),
                       ((False, 200.0, 4.5, 3.9), "not offered")):
        rule = ModeRule(CFG)
        rule.observe_offer(*offer)
        rule.observe_rtt(0.05, 0.0)
        assert rule.decide("phone", 0.0) is None, why
        rounds(rule, 5, tokens=3, draft_s=0.05, wait_s=0.1)  # 20 tok/s: the floor keeps it in phone mode
        assert rule.decide("phone", 3.0) is None and rule.decide("phone", 4.5) is None, why
    close = ModeRule(CFG)  # phone mode saves 4.5 %, under half the margin: the faster mode wins
    close.observe_offer(True, 200.0, 4.2, 4.4)
    assert close.decide("phone", 0.0) == "server"
    late = ModeRule(CFG)  # the figures arrive with a pong in the middle of a phone-mode answer
    late.observe_rtt(0.05, 0.0)
    rounds(late, 5, tokens=3, draft_s=0.05, wait_s=0.1)
    late.observe_offer(True, 0.0, 4.5, 3.9)
    assert late.decide("phone", 3.0) is None and late.decide("phone", 4.1) == "server"  # after the window


def test_forced_policies():
    assert PhoneOnly().decide("phone", 0.0) is None and ServerOnly().decide("phone", 0.0) == "server"
    alt = Alternate(stretch_tokens=2)
    assert alt.decide("phone", 0.0) is None
    alt.observe_round(3, 0.0, 0.0, 0.0)
    assert alt.decide("phone", 0.0) == "server"
    alt.observe_tokens(1, 0.0)
    assert alt.decide("server", 0.0) is None
    alt.observe_tokens(1, 0.0)
    assert alt.decide("server", 0.0) == "phone" and alt.decide("phone", 0.0) is None


def test_hyco_phone_takes_the_drafting_policy():
    from mobile_client.cli import parse_args

    args = parse_args(["--server", "http://h", "--model-dir", "m", "--prompt", "x", "--drafting", "auto",
                       "--floor-tps", "9", "--power-low"])
    assert (args.drafting, args.floor_tps, args.power_low) == ("auto", 9.0, True)
    assert parse_args(["--server", "http://h", "--model-dir", "m", "--prompt", "x"]).drafting == "phone"
