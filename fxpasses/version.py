"""The version of fxpasses (``fxpasses.__version__``), importable without the package's facade."""

__version__ = "0.1.0"
