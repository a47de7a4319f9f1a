"""Stand-in ``torchvision.io`` (see the package): names transformers imports; decoding raises."""

import enum


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
    RGBA = 4


def decode_image(*args, **kwargs):
    raise ImportError("torchvision.io.decode_image: the CPU tests' torchvision stand-in cannot decode images")


def __getattr__(name):
    raise AttributeError(f"torchvision.io.{name}: the CPU tests' torchvision stand-in has no such thing")
