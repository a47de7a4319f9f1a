"""The benchmark checks which ``expand_kernel`` each engine's rejection sampler runs (vLLM 0.32's CPU
fallback runs sampled spec decode at temperature 0; vllm_hyco/vllm_adapter/patches/cpu_expand_kernel.py fixes it): the
engine's timing snapshots carry it, the harness refuses sampled Cloud+MTP on the stock fallback, and the
``cloud-mtp-prob`` configuration asks vLLM for probabilistic drafts."""

from __future__ import annotations

import argparse
import json

import pytest

from hyco_lab.bench import configs
from vllm_hyco.errors import ConfigError
from vllm_hyco.vllm_adapter.patches import step_timing as timing


def _snapshot(path, pid: int, kernel: str) -> None:
    (path / f"timing-{pid}.json").write_text(json.dumps({"cpu_s": 1.0, "steps": 2, "expand_kernel": kernel}))


def test_read_dir_reports_the_engines_expand_kernel(tmp_path):
    _snapshot(tmp_path, 1, "not-loaded")  # e.g. the API server process: no rejection sampler
    _snapshot(tmp_path, 2, "patched")
    total = timing.read_dir(tmp_path)
    assert total["expand_kernel"] == "patched" and total["steps"] == 4
    assert timing.delta(timing.read_dir(tmp_path), total)["expand_kernel"] == "patched"
    assert "expand_kernel" not in timing.read_dir(tmp_path / "none")


class _Srv:
    def __init__(self, kernel: str):
        self.kernel = kernel

    def timing(self) -> dict:
        return {"expand_kernel": self.kernel}


@pytest.mark.parametrize(("kernel", "temperature", "name", "raises"), [
    ("stock-cpu-fallback", 1.0, "cloud-mtp", True),
    ("stock-cpu-fallback", 0.0, "cloud-mtp", False),  # greedy never expands
    ("stock-cpu-fallback", 1.0, "hyco", False),
    ("patched", 1.0, "cloud-mtp-prob", False),
])
def test_sampled_cloud_mtp_is_refused_on_the_stock_fallback(kernel, temperature, name, raises):
    from hyco_lab.bench.__main__ import Bench

    bench = Bench.__new__(Bench)
    bench.args, bench.expand_kernels = argparse.Namespace(temperature=temperature), {}
    cfgs = [configs.CONFIGS[name]]
    if raises:
        with pytest.raises(ConfigError, match="expand_kernel"):
            bench.check_expand_kernel(_Srv(kernel), cfgs)
    else:
        bench.check_expand_kernel(_Srv(kernel), cfgs)
    assert bench.expand_kernels == {name: kernel}


def test_cloud_mtp_prob_asks_for_probabilistic_drafts_on_its_own_server():
    prob, plain = configs.CONFIGS["cloud-mtp-prob"], configs.CONFIGS["cloud-mtp"]
    assert json.loads(prob.server_spec("/a"))["draft_sample_method"] == "probabilistic"
    assert "draft_sample_method" not in json.loads(plain.server_spec("/a"))
    assert prob.server_key() != plain.server_key()
    assert "cloud-mtp-prob" in [c.name for c in configs.select("all")]
