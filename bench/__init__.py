"""Benchmarks: in-process model (micro) and the HTTP service; run each as python3 -m bench.<name>."""
