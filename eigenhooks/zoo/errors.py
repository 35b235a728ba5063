"""The error every way of loading a model raises, in one place so that each loader can import it."""


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why and what to try."""
