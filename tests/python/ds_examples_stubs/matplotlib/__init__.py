"""A stand-in for matplotlib: plotting does nothing."""
