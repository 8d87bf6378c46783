"""The Open Inference Protocol (KServe V2) and Triton's extensions, as functions both doors call."""
