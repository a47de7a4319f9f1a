"""The API-server side of HyCo (the process of vLLM's OpenAI server, ``AsyncLLM``, or of an offline ``LLM``).

* ``endpoint``: the ``vllm.endpoint_plugins`` entry point: ``GET /v1/hyco/info``, ``GET /v1/hyco/stats``,
  ``WS /v1/hyco/session`` (the phone route, ``vllm_hyco.serving``), the 400 for fields a speculative server
  ignores; extends vLLM's OpenAI app.
* ``engine_client``: the engine client of sessions (``EngineBridge``, the phone route's engine port) and the
  request checks shared with ``inprocess``; it reaches the engine core through vLLM's ``call_utility``.
* ``inprocess``: the in-process harness of tests and benchmarks (``HycoEngine`` over ``LLM.llm_engine``).
* ``expansion``: ``--speculative-config hyco`` -> engine arguments (called by ``patches/engine_config.py``).
* ``cli``: the ``vllm-hyco`` console script (vLLM's CLI with the plugin named).

Never imports ``engine_core`` or ``worker``: what crosses is ``vllm_hyco.engine_contract``.
"""
