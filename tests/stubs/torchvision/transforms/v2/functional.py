"""Stand-in ``torchvision.transforms.v2.functional`` (see the package): the enum used in annotations; every
function raises."""

from torchvision.transforms import InterpolationMode  # noqa: F401  (annotations of transformers' processors)


def __getattr__(name):
    raise AttributeError(f"torchvision.transforms.v2.functional.{name}: the CPU tests' torchvision stand-in "
                         f"cannot process images")
