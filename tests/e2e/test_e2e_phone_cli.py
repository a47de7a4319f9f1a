"""Issue 7's criterion on the real server (127.0.0.1, the trained fp32 fixtures of ``fixtures_dir``, greedy
exact mode): the ``hyco-phone`` console script, run as a subprocess with the phone's real drafters (the
fixture assistant as the MTP head, the fixture SLM, the hand-off scales; torch backend), completes whole
sessions whose streamed text equals plain vLLM greedy decoding of the same server (OpenAI completions and
chat, temperature 0), prints its round statistics, and accepts drafts (MAT > 1). HyCo-2P (``--slm-passes
2``) gives the same text and never a lower MAT than HyCo on these prompts. The compiled backend (QNN HTP
emulator) runs only with ``HYCO_PHONE_BUILD`` pointing at ``python -m mobile_client.export.build OUT
--fixtures FIXDIR`` output (slow: minutes of emulator time). The server is the shared one of
``test_e2e_phone_support`` (no extra start).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_e2e_phone_support import API_KEY, MODEL, phone_server

MAX_TOKENS = 40
PROMPTS = ["In the beginning God created", "Thou shalt not"]
CHAT = [{"role": "user", "content": "Recite Genesis 1:1."}]
ROUND_LINE = re.compile(r"^round +(\d+): phone \| nodes +(\d+) accepted +(\d+) \+(\d+) tok \|", re.MULTILINE)


@pytest.fixture(scope="module")
def server(fixtures_dir):
    if not (fixtures_dir / "handoff_scales.npz").exists():
        pytest.skip("the fixtures have no hand-off scales (random weights): the phone would draft SLM-only")
    return phone_server(fixtures_dir)


@pytest.fixture(scope="module")
def plain(server):
    """Plain greedy decoding through the official openai client, the same body hyco-phone sends."""
    import openai

    oai = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=300, max_retries=0)
    out = {p: oai.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
           .choices[0].text for p in PROMPTS}
    out["chat"] = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS,
                                              temperature=0).choices[0].message.content
    return out


def _cmd(server: str, bundle: Path, source: list[str], tmp: Path, *extra: str) -> list[str]:
    script = Path(sys.executable).parent / "hyco-phone"
    exe = [str(script)] if script.exists() else [sys.executable, "-m", "mobile_client.cli"]
    return [*exe, "--server", server, "--api-key", API_KEY, "--model-dir", str(bundle), "--model-name", MODEL,
            *source, "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--json-out", str(tmp), *extra]


def hyco_phones(runs: dict[str, list[str]], tmp: Path) -> dict[str, tuple[str, dict, str]]:
    """Run the console scripts side by side (the server batches their sessions; a 2-core box overlaps
    their start-up); {name: (streamed stdout, --json-out contents, stderr)}."""
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, cmd in runs.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, stderr[-3000:])
        out[name] = stdout, json.loads((tmp / f"{name}.json").read_text()), stderr
    return out


def check_stats(out: dict, err: str) -> float:
    summary, rounds = out["summary"], out["rounds"]
    lines = ROUND_LINE.findall(err)
    assert [int(x[0]) for x in lines] == [r["round"] for r in rounds] == list(range(len(rounds)))
    assert [int(x[3]) for x in lines] == [r["committed"] for r in rounds]
    assert err.rstrip().splitlines()[-1].startswith("hyco-phone: {")  # the printed summary
    assert summary["rounds"] == summary["server"]["rounds"] == len(rounds)
    assert summary["tokens"] == sum(r["committed"] for r in rounds)
    assert summary["mat"] == pytest.approx(summary["server"]["mat"], abs=1e-3)
    assert summary["mat"] > 1.0  # the drafts were accepted: more than one token per round
    return summary["mat"]


SOURCES = {**{f"prompt{i}": ["--prompt", p] for i, p in enumerate(PROMPTS)},
           "chat": ["--messages-json", json.dumps(CHAT)]}


def test_hyco_phone_one_and_two_pass_equal_plain_greedy(server, plain, fixtures_dir, tmp_path):
    reference = {**{f"prompt{i}": plain[p] for i, p in enumerate(PROMPTS)}, "chat": plain["chat"]}
    runs = {f"{key}-{passes}p": _cmd(server, fixtures_dir, source, tmp_path / f"{key}-{passes}p.json",
                                     "--slm-passes", str(passes))
            for key, source in SOURCES.items() for passes in (1, 2)}
    done = hyco_phones(runs, tmp_path)
    mats: dict[str, dict[str, float]] = {"1p": {}, "2p": {}}
    for name, (text, out, err) in done.items():
        key, passes = name.rsplit("-", 1)
        assert text == reference[key], name  # exact mode: the plain greedy answer, token for token
        assert ("HyCo-2P" in err) == (passes == "2p")
        mats[passes][key] = check_stats(out, err)
    print(f"\nhyco-phone MAT: {json.dumps(mats)}")
    for key in SOURCES:
        assert mats["2p"][key] >= mats["1p"][key], (key, mats)  # HyCo-2P never below HyCo here


def test_hyco_phone_sampled_drafts_at_temperature_one(server, fixtures_dir, tmp_path):
    """``--draft-sampling probabilistic`` at T = 1: the phone draws its chain and sends q, the real server
    couples its samples to it (docs/acceptance.md); the session completes with accepted drafts, and the same
    seed gives the same text twice (the phone's draws and the server's uniforms are both seeded)."""
    extra = ("--temperature", "1", "--seed", "7", "--draft-sampling", "probabilistic")
    runs = {name: _cmd(server, fixtures_dir, SOURCES["prompt0"], tmp_path / f"{name}.json", *extra)
            for name in ("s1", "s2")}
    done = hyco_phones(runs, tmp_path)
    (t1, out1, err1), (t2, _, _) = done["s1"], done["s2"]
    assert t1 == t2 and t1
    check_stats(out1, err1)


@pytest.mark.slow
def test_hyco_phone_compiled_backend_equals_plain_greedy(server, plain, fixtures_dir, tmp_path):
    build = os.environ.get("HYCO_PHONE_BUILD")
    if not build or not (Path(build) / "mtp_ctx.onnx").exists():
        pytest.skip("set HYCO_PHONE_BUILD to the output of "
                    "`python -m mobile_client.export.build OUT --fixtures FIXDIR`")
    cmd = _cmd(server, fixtures_dir, ["--prompt", PROMPTS[0]], tmp_path / "compiled.json", "--backend",
               "compiled", "--build-dir", build)
    text, out, err = hyco_phones({"compiled": cmd}, tmp_path)["compiled"]
    assert text == plain[PROMPTS[0]]
    assert "QNN HTP context" in err
    check_stats(out, err)
    proc = subprocess.run([str(Path(sys.executable).parent / "hyco-phone"), "--server", server, "--model-dir",
                           str(fixtures_dir), "--prompt", "x", "--backend", "compiled", "--build-dir", build,
                           "--slm-passes", "2"], capture_output=True, text=True, timeout=300, check=False)
    if (Path(build) / "slm_ctx.onnx").exists():
        assert proc.returncode == 2 and "--slm-passes 2" in proc.stderr
