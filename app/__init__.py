"""ffn-serve: the HTTP service around ffn_core."""
__version__ = "0.1.0"
