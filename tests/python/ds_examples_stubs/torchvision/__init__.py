"""A stand-in for torchvision: datasets.CIFAR10 and FakeData as synthetic
tensors, transforms on tensors, models.AlexNet, utils without output."""

from . import datasets, models, transforms, utils  # noqa: F401
