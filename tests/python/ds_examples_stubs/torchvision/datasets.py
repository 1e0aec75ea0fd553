"""CIFAR10 as synthetic tensors: 3 x 32 x 32 images, 10 classes."""

import torch


class CIFAR10(torch.utils.data.Dataset):
    def __init__(self, root, train=True, download=False, transform=None):
        n = 256 if train else 64
        g = torch.Generator().manual_seed(1 if train else 2)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]
