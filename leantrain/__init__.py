"""leantrain: cheaper deep-network training on three axes (memory, curvature, depth)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
