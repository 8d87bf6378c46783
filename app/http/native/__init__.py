"""The native API over HTTP: POST /v1/models/{name}/transform in JSON, raw binary or .npy; GET /v1/models."""
