def make_grid(images, *args, **kwargs):
    return images


def save_image(*args, **kwargs):
    """Writes nothing."""
