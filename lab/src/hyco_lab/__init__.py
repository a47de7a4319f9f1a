"""Research tools around HyCo, kept out of the serving plugin's wheel.

* ``hyco_lab.fixtures``: the tiny Gemma-4-shaped checkpoints (build, train, report) and their shipped
  weights (``fixtures/data``); ``python -m hyco_lab.fixtures DIR`` builds them,
  ``python -m hyco_lab.fixtures.report`` measures acceptance with vLLM itself.
* ``hyco_lab.bench``: the benchmark harness, ``python -m hyco_lab.bench`` (docs/benchmarks.md).

Nothing in ``vllm_hyco`` or ``mobile_client`` imports this package.
"""
