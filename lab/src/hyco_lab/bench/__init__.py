"""The HyCo benchmark harness: ``python -m hyco_lab.bench`` (docs/benchmarks.md).

Modules (none imports vLLM at import time; the harness starts servers as subprocesses):

| module | what |
| --- | --- |
| ``configs.py`` | the configurations by name (cloud-mtp, specedge, ..., hyco, slm-only) and the device model (D8) |
| ``linkproxy.py`` | an asyncio TCP proxy on 127.0.0.1 applying RTT and up/down bandwidth to the real frames |
| (engine-side timing lives in the plugin: ``vllm_hyco.vllm_adapter.patches.step_timing``) | |
| ``server.py`` | start / stop one ``vllm-hyco serve`` per configuration, scrape ``/metrics`` |
| ``phones.py`` | simulated phones: drafters per configuration, recording sessions |
| ``drive.py`` | drive a configuration's requests (openai client or phone sessions) into records |
| ``metrics.py`` | records -> the paper's Table 11 metrics, 3-run spreads, g ratios |
| ``report.py`` | markdown table, JSON, PNG plots |
| ``mixed.py`` | ordinary requests beside phones: Cloud+MTP and HyCo servers under the same closed-loop load |
| ``linksweep.py`` | phone mode, server mode and the mode rule per link (a changing one included), ``--link-sweep`` |
| ``__main__.py`` | the command line |
"""
