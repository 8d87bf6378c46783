"""What a request means, whichever door it came through (HTTP or gRPC): the protocol core.

Admission and every budget (bytes held, deadlines), the one error table, tensors and fields, Monte
Carlo parameters, shared memory, the native codec and the Open Inference Protocol's semantics
(v2/), as functions on plain values. No starlette, fastapi, uvicorn or grpc here: each door turns
its wire into these values and renders what comes back.
"""
