"""The Open Inference Protocol (KServe V2) over HTTP: its routes, on the semantics of app/protocol/v2."""
