"""Where a served copy's digest (app/engine/registry.py's model_digest) appears, by name, in both doors.

The digest ("sha256:" and 64 hex digits) names the weights and the table a copy computes with:
two replicas, or two workers, that show the same digest answer alike; after a reload, the new
digest shows where the new weights serve. Over HTTP: every infer and transform answer's header
and the V2 infer answer's parameters; the model's metadata, configuration, statistics, repository
index entry and GET /v1/models. Over gRPC, where Triton's messages have no field for it: the
infer answer's parameters and the model configuration's parameters.
"""

from __future__ import annotations

DIGEST_HEADER = "x-model-digest"  # every HTTP infer and transform answer
ANSWER_PARAMETER = "model_digest"  # an infer answer's parameters: V2 JSON and gRPC
MODEL_PARAMETER = "digest"  # the parameters of model metadata (HTTP) and model configuration (both doors)
