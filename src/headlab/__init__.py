"""headlab: which attention heads matter, what they do, and how to prune the rest."""

__version__ = "0.1.0"
