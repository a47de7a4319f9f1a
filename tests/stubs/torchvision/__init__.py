"""A stand-in for torchvision on the CPU test machine (tests only; never installed, never in the wheel).

vLLM's ``Gemma4ForConditionalGeneration`` (``vllm/model_executor/models/gemma4_mm.py``) imports
``transformers``' Gemma-4 processor, whose image module does ``from torchvision.transforms.v2 import
functional`` at import time. PyPI's torchvision 0.28 is a CUDA build that cannot load beside the CPU
torch 2.13 the tests run on, so without this stand-in the real checkpoint's class cannot even be inspected
on CPU. The checkpoint-shaped tests serve the text model only (``language_model_only``), where no image
is ever processed; any use of the stand-in raises. ``tests/checkpoint_shaped.py`` puts it on the path only
when no real torchvision is importable.
"""

__version__ = "0.0.0+hyco-test-stub"


def __getattr__(name):
    raise AttributeError(f"torchvision.{name}: the CPU tests' torchvision stand-in has no such thing")
