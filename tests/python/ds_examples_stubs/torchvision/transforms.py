"""No-op transforms (the synthetic images are tensors already)."""


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        return x


class ToTensor:
    pass


class Normalize:
    def __init__(self, *args):
        pass
