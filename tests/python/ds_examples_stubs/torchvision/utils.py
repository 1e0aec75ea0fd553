def make_grid(images):
    return images
