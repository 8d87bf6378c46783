"""The Open Inference Protocol (KServe V2), with Triton's binary tensor data extension."""
