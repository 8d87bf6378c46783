"""The gRPC door: the Open Inference Protocol as Triton's inference.GRPCInferenceService, on the same engine as HTTP."""
