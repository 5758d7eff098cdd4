"""radixserve's version, in a leaf module so that any layer may report it."""

__version__ = "0.1.0"
