"""KServe's V1 protocol over HTTP: POST /v1/models/{name}:predict and GET /v1/models/{name}."""
