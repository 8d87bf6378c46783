"""The GPU benchmark: `python3 -m bench.gpu` (see __main__.py), `bash bench/gpu/run.sh` on the GPU machine."""
