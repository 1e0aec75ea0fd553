"""Transforms for the synthetic images, which are tensors already: Resize
and CenterCrop change their size (the pipeline example's AlexNet needs
224 x 224), the others pass them through."""

import torch.nn.functional as F


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class _PassThrough:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, x):
        return x


class ToTensor(_PassThrough):
    pass


class Normalize(_PassThrough):
    pass


class Resize:
    """The shorter side to `size` (an int), or to (h, w)."""

    def __init__(self, size):
        self.size = size

    def __call__(self, x):
        h, w = x.shape[-2:]
        if isinstance(self.size, int):
            s = self.size
            size = (s, max(1, round(w * s / h))) if h <= w else (max(1, round(h * s / w)), s)
        else:
            size = tuple(self.size)
        return F.interpolate(x.unsqueeze(0), size=size, mode="bilinear",
                             align_corners=False).squeeze(0)


class CenterCrop:
    def __init__(self, size):
        self.size = (size, size) if isinstance(size, int) else tuple(size)

    def __call__(self, x):
        h, w = x.shape[-2:]
        top, left = (h - self.size[0]) // 2, (w - self.size[1]) // 2
        return x[..., top:top + self.size[0], left:left + self.size[1]]
