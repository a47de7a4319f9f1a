"""Stand-in ``torchvision.transforms.functional`` (see the package): every function raises."""


def pil_to_tensor(*args, **kwargs):
    raise ImportError("torchvision.transforms.functional.pil_to_tensor: the CPU tests' torchvision stand-in "
                      "cannot process images")


def __getattr__(name):
    raise AttributeError(f"torchvision.transforms.functional.{name}: the CPU tests' torchvision stand-in "
                      f"cannot process images")
