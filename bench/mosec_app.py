"""The FFN served by mosec, as a mosec user would write it: the baseline of bench/mosec_baseline.py.

    python -m bench.mosec_app --port 8000      # FFN_WEIGHTS=ffn.safetensors, FFN_MOSEC_JSON=stdlib|orjson

One worker process with mosec's dynamic batching (MAX_BATCH requests, MAX_WAIT_MS); each request
is `{"inputs": [[...], ...]}` and each answer `{"outputs": [[...], ...]}`, JSON both ways. With
FFN_MOSEC_JSON=stdlib the worker keeps mosec's own (de)serializers (the standard library's json,
its answers indented); with orjson (the default) they are replaced by orjson, the fastest a mosec
user could plug in, so that the baseline is not flattered by a slow default.
"""

from __future__ import annotations

import os
from typing import Any

import orjson
import torch
from mosec import Server, Worker

from ffn_core import load_ffn

MAX_BATCH = 64  # requests: 64 x 16 rows is ffn-serve's max_batch_rows (1024) at r = 16
MAX_WAIT_MS = 10  # mosec's documented default wait for a batch


class FFNWorker(Worker):
    """Rows of every request in a batch through the FFN at once, each request answered its own rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)  # one core for the whole server, as ffn-serve's bench gives it
        self.model = load_ffn(os.environ["FFN_WEIGHTS"]).eval().requires_grad_(False)
        self.orjson = os.environ.get("FFN_MOSEC_JSON", "orjson") == "orjson"

    def deserialize(self, data: bytes) -> Any:
        return orjson.loads(data) if self.orjson else super().deserialize(data)

    def serialize(self, data: Any) -> bytes:
        return orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY) if self.orjson else super().serialize(data)

    def forward(self, data: list[dict[str, Any]]) -> list[dict[str, Any]]:
        parts = [torch.tensor(request["inputs"], dtype=torch.float32) for request in data]
        with torch.inference_mode():
            outputs = self.model(torch.cat(parts))
        answers, offset = [], 0
        for part in parts:
            rows = outputs[offset : offset + len(part)]
            answers.append({"outputs": rows.numpy() if self.orjson else rows.tolist()})
            offset += len(part)
        return answers


if __name__ == "__main__":
    server = Server()
    server.append_worker(FFNWorker, num=1, max_batch_size=MAX_BATCH, max_wait_time=MAX_WAIT_MS)
    server.run()
