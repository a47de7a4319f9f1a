"""QNN context binaries for SM8850 (soc model 87, HTP v81) through onnxruntime-qnn, and the x86 HTP emulator.

``compile_context`` prepares the QDQ graph for the HTP backend with CPU fallback disabled (any node HTP
cannot take fails the compile: that is the "lowers entirely onto HTP v81" gate) and writes an EPContext
ONNX plus its ``_qnn.bin``. ``htp_session`` runs such a context model; on x86 the bundled ``libQnnHtp.so``
is the HTP *emulator* (functional, not a timing model), on a phone the same file runs on the NPU.
Versions are pinned (docs/phone-build.md, "Packages"): onnxruntime 1.24.x with onnxruntime-qnn 2.3.0 (QAIRT 2.47).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from vllm_hyco.errors import HardwareUnsupportedError

SOC_MODEL = "87"  # Snapdragon 8 Elite Gen 5 (SM8850)
HTP_ARCH = "81"
_REGISTERED = False


def _ort_qnn():
    """Import onnxruntime + onnxruntime_qnn and register the QNN plugin EP once."""
    global _REGISTERED
    try:
        import onnxruntime as ort
        import onnxruntime_qnn as qnn_ep
    except ImportError as e:
        raise HardwareUnsupportedError(
            "onnxruntime-qnn is not installed (pip install onnxruntime==1.24.4 onnxruntime-qnn==2.3.0)"
        ) from e
    if not _REGISTERED:
        try:
            ort.register_execution_provider_library("QNNExecutionProvider", qnn_ep.get_library_path())
        except Exception as e:  # already registered by someone else in this process
            if "already" not in str(e).lower():
                raise HardwareUnsupportedError(f"cannot load the QNN EP: {e}") from e
        _REGISTERED = True
    return ort, qnn_ep


def versions() -> dict[str, str]:
    """Toolchain versions for the manifest (QAIRT version from the EP's build info when present)."""
    ort, qnn_ep = _ort_qnn()
    import importlib.metadata as md

    out = {"onnxruntime": ort.__version__, "onnxruntime_qnn": md.version("onnxruntime-qnn")}
    info = getattr(qnn_ep, "build_and_package_info", None)
    if info is not None and hasattr(info, "qnn_version"):
        out["qairt"] = str(info.qnn_version)
    return out


def _session_options(ort, qnn_ep, ctx_path: Path | None):
    devs = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    if not devs:
        raise HardwareUnsupportedError("the QNN EP reports no device")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if ctx_path is not None:
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(ctx_path))
    so.add_provider_for_devices(
        devs, {"backend_path": qnn_ep.get_qnn_htp_path(), "soc_model": SOC_MODEL, "htp_arch": HTP_ARCH}
    )
    return so


def compile_context(qdq_path: str | Path, ctx_path: str | Path) -> dict:
    """Compile ``qdq_path`` for SM8850 / HTP v81; returns {seconds, ctx, bin, bin_bytes, sdk}."""
    ort, qnn_ep = _ort_qnn()
    ctx_path = Path(ctx_path)
    ctx_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    ort.InferenceSession(str(qdq_path), sess_options=_session_options(ort, qnn_ep, ctx_path))
    seconds = time.perf_counter() - t0
    bins = sorted(ctx_path.parent.glob(ctx_path.stem + "*.bin"))
    return {
        "seconds": round(seconds, 3),
        "ctx": ctx_path.name,
        "bin": bins[0].name if bins else None,
        "bin_bytes": bins[0].stat().st_size if bins else 0,
        "sdk": context_sdk_version(ctx_path),
    }


def context_sdk_version(ctx_path: str | Path) -> str | None:
    """The ``ep_sdk_version`` stamped on the EPContext node (e.g. 'v2.47.0...')."""
    import onnx

    m = onnx.load(str(ctx_path), load_external_data=False)
    for n in m.graph.node:
        if n.op_type == "EPContext":
            for a in n.attribute:
                if a.name == "ep_sdk_version":
                    return a.s.decode()
    return None


def htp_session(ctx_path: str | Path):
    """A session over a compiled context model: x86 -> HTP emulator, phone -> NPU."""
    ort, qnn_ep = _ort_qnn()
    return ort.InferenceSession(str(ctx_path), sess_options=_session_options(ort, qnn_ep, None))


def cpu_session(path: str | Path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])


def run(session, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in names})
