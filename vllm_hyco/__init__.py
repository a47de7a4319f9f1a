"""vllm_hyco: HyCo speculative decoding for vLLM.

The phone drafts a hybrid token tree (the verifier's own MTP head + a small on-device LM); the server
verifies it in one forward pass. This package imports nothing from vLLM at import time: the engine
adapters (``plugin``, ``cli``, ``endpoint`` and the ``engine`` modules) import it lazily.
"""

__version__ = "0.1.0"

# The vLLM release line this plugin is built and tested against (checked at plugin load).
SUPPORTED_VLLM = "0.32"
