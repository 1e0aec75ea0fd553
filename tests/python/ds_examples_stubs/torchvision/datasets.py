"""CIFAR10 and FakeData as synthetic tensors (fixed seeds): CIFAR's 3 x 32
x 32 images in 10 classes, FakeData's of the size asked; `transform`
applies to each image."""

import torch


class _Synthetic(torch.utils.data.Dataset):
    def __init__(self, n, shape, classes, seed, transform):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, *shape, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.transform = transform

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        return (self.transform(x) if self.transform is not None else x), self.y[i]


class CIFAR10(_Synthetic):
    def __init__(self, root, train=True, download=False, transform=None):
        super().__init__(256 if train else 64, (3, 32, 32), 10, 1 if train else 2, transform)


class FakeData(_Synthetic):
    def __init__(self, size=1000, image_size=(3, 224, 224), num_classes=10, transform=None,
                 target_transform=None, random_offset=0):
        super().__init__(size, image_size, num_classes, 3 + random_offset, transform)
