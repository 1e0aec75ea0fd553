"""A stand-in for torchvision: datasets.CIFAR10 as synthetic tensors of
CIFAR's shapes, transforms and utils.make_grid as no-ops."""

from . import datasets, transforms, utils  # noqa: F401
