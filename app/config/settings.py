"""Settings: every knob of the service, from CLI flags, `FFN_*` variables or a TOML file.

Precedence, highest first: command-line flags, environment variables, the config file, defaults.
The config file holds the same keys at its top level, plus one `[[models]]` table per model.
The command line is generated from the Settings class by pydantic-settings' CLI source: each
field is a `--kebab-case` flag whose help is the field's description, default and variable.
Every mistake is a SettingsError, one line per problem (app/config/settings_problems.py). Nothing here
imports torch, so a mistake is reported before the server and torch are imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import stat
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict
from pydantic_settings import SettingsError as SourceError

from app import __version__
from app.config.settings_problems import (
    Origins,
    SettingsError,
    nearest,
    source_problem,
    unknown_arguments,
    url_problem,
    validation_problems,
)
from app.config.tracing import endpoint_problem
from ffn_core.families import table_problem
from ffn_core.files import file_kind

ENV_PREFIX = "FFN_"

MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# Words that V2 paths use where a model's name goes (GET /v2/models/stats is every model's
# statistics): a model so named could never be reached. tests/test_settings.py derives them
# from the endpoint tables.
ROUTE_WORDS = frozenset({"stats"})
# A Hub repository id: a name, or org/name (letters, digits, '-', '_', '.'); a revision: a branch,
# tag or commit hash, refs/pr/N included.
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda|cuda:\d+")  # a model's device, and each of `devices`
HF_REPO_PATTERN = r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*$"
HF_REVISION_PATTERN = r"^[A-Za-z0-9_.-][A-Za-z0-9_./-]*$"
HUB_EXTRA = "pip install 'ffn-serve[hub]'"
# What to do when the gRPC port is in the way (a collision here, or the port taken at start).
GRPC_PORT_FIX = (
    "give gRPC another port with --grpc-port N (FFN_GRPC_PORT), or turn it off with --no-grpc (FFN_GRPC=false)"
)
MAX_CONFIG_BYTES = 1024 * 1024  # a config file is settings and a few [[models]] tables, never this large
# The longest any timeout may be. `inf` parses as a number of seconds and would turn its bound off
# without a word; past a day a bound bounds nothing an operator waits for (and a thread's wait or
# a sleep overflows further on). Every float setting is finite (tests/test_settings.py).
MAX_TIMEOUT_S = 24 * 3600.0
TIMEOUTS = (
    "default_timeout_ms",
    "drain_timeout_s",
    "header_timeout_s",
    "read_timeout_s",
    "send_timeout_s",
    "max_loop_lag_s",
    "heartbeat_timeout_s",
    "worker_start_timeout_s",
)


class ModelSpec(BaseModel):
    """One `[[models]]` table: where a model's weights are and how to read and place them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=MODEL_NAME_PATTERN, description="Name in URLs; letters, digits, '_', '.', '-'.")
    weights: Path | None = Field(
        default=None,
        description="Weights file, relative to the config file. None (and no hf_model): the built-in demo weights.",
    )
    hf_model: str | None = Field(
        default=None,
        max_length=96,
        pattern=HF_REPO_PATTERN,
        description="A Hugging Face Hub repository (org/name) instead of a weights file: its model.safetensors "
        "through huggingface_hub's cache (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN); needs the hub extra.",
    )
    revision: str | None = Field(
        default=None,
        max_length=255,
        pattern=HF_REVISION_PATTERN,
        description="The hf_model's revision: a branch, tag or commit. Unset: main.",
    )
    format: Literal["native", "torch", "bert", "gpt2", "llama"] | None = Field(
        default=None,
        description="native safetensors, a torch state dict, or one layer of a checkpoint family. Unset: native "
        "for a weights file, the family the hf_model's config.json names (model_type).",
    )
    layer: int | None = Field(default=None, ge=0, description="Layer index, for the bert, gpt2 and llama formats.")
    activation: Literal["relu", "gelu", "gelu_tanh", "silu", "identity"] | None = Field(
        default=None, description="Activation, where the file does not say."
    )
    gated: bool | None = Field(default=None, description="Gated (GLU) FFN, where the file does not say.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field(default="float32", description="Compute dtype.")
    device: str = Field(
        default="auto", pattern=rf"^({DEVICE_PATTERN.pattern})$", description="auto = cuda when available."
    )
    dropout: float | None = Field(
        default=None,
        ge=0.0,
        lt=1.0,
        description="Dropout rate of Monte Carlo dropout requests; unset: the file's (native files store it).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.hf_model is None:
            if self.revision is not None:
                raise ValueError("revision is the revision of an hf_model; this table names none")
            return self
        if self.weights is not None:
            raise ValueError("a table names weights or hf_model, not both")
        if self.format == "torch":
            raise ValueError("an hf_model is read from its model.safetensors; format 'torch' is for local files")
        if importlib.util.find_spec("huggingface_hub") is None:
            raise ValueError(f"hf_model needs huggingface_hub, which is not installed: {HUB_EXTRA}")
        return self

    @model_validator(mode="after")
    def _readable_as_asked(self) -> ModelSpec:
        # What the loader would refuse whatever the file holds (ffn_core/families.py), said before torch
        # is imported. The demo reads no file (it ignores format and layer); an hf_model's family is
        # the one its config.json names, unless a format is given, and every family needs a layer.
        if self.weights is None and self.hf_model is None:
            return self
        if self.hf_model is not None and self.format is None:
            problem = (
                None if self.layer is not None else "an hf_model is one layer of its checkpoint family: give layer"
            )
        else:
            problem = table_problem(self.format, self.layer, self.gated)
        if problem is not None:
            fix = ": add layer = N to its table, 0 for the first" if self.layer is None else ""
            raise ValueError(problem + fix)
        return self

    @field_validator("name")
    @classmethod
    def _not_a_route_word(cls, name: str) -> str:
        if name in ROUTE_WORDS:
            raise ValueError(
                f"{name!r} is a word of the V2 paths (/v2/models/{name}); no model so named could be reached"
            )
        return name


class Settings(BaseSettings):
    """The service's settings. Each field is also `FFN_<NAME>` in the environment."""

    # hide_input_in_errors: a refused API key must not be echoed to the log.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True, hide_input_in_errors=True)

    config: Path | None = Field(default=None, description="TOML config file with settings and [[models]].")
    host: str = Field(default="127.0.0.1", description="Address to bind; the container sets 0.0.0.0.")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port.")
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Also serve /metrics here, without the API key (like Triton's 8002); unset = main port only.",
    )
    grpc: bool = Field(
        default=True,
        description="Also serve the Open Inference Protocol over gRPC (Triton's inference.GRPCInferenceService, "
        "grpc.health.v1 and server reflection) on grpc_port; --no-grpc (FFN_GRPC=false) turns it off.",
    )
    grpc_port: int = Field(
        default=8001,
        ge=0,
        le=65535,
        description="TCP port of the gRPC service (Triton's 8001); 0 = a free port the system picks.",
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Server processes sharing the port, each with its own models; 1 = one process, no supervisor.",
    )
    shared_engine: bool = Field(
        default=False,
        description="One engine process owns the models and forms every batch, and each of the `workers` is a "
        "front (the doors and the protocol, no torch, no model copy) that hands its requests to it through "
        "shared memory; with 1 worker, one front and one engine. Off: each worker serves its own copy of the models.",
    )
    devices: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="With shared_engine: one engine process per entry, each with every model on that device "
        "(cpu, cuda, cuda:N; a device may be named twice), and the fronts send each request to the engine "
        "with the fewest rows in flight. Empty: one engine, each model on its own device.",
    )
    handoff_slots: int = Field(
        default=64,
        ge=1,
        le=1 << 20,
        description="With shared_engine: requests of up to 1 MiB each that a front may have in each engine at once "
        "(429 past them; a larger one takes a slot of its own size, within the front's share of max_held_bytes), "
        "each slot 1 MiB of memory reserved at the front's start.",
    )
    metrics_dir: Path | None = Field(
        default=None,
        description="Workers > 1: the folder where they keep their metrics, e.g. a tmpfs under a read-only root; "
        "emptied of stale metrics files at start, never removed. Unset: a fresh temporary folder, removed at exit.",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info", description="Logging level of the service and uvicorn."
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="text: one readable line per record; json: one JSON object per line."
    )
    access_log: bool = Field(default=False, description="Log one line per HTTP request (uvicorn's access log).")
    max_batch_rows: int = Field(default=1024, ge=1, description="Most rows in one forward pass.")
    max_wait_ms: float = Field(
        default=0.0,
        ge=0.0,
        le=1000.0,
        description="How long a batch may wait for more rows after its first entry; 0 = greedy.",
    )
    batch_linger_ms: float = Field(
        default=2.0,
        ge=0.0,
        le=100.0,
        description="With max_wait_ms 0: how long a batch of one request, or any batch while gRPC calls are on "
        "their way, may wait for others while waiting lately caught some (a gRPC server takes its calls one "
        "at a time); tried again now and then otherwise. 0 = never.",
    )
    max_queue_rows: int = Field(default=16384, ge=1, description="Rows that may wait per model before 429.")
    default_timeout_ms: float = Field(
        default=30000.0, gt=0.0, description="Deadline of a request that sets none (X-Timeout-Ms or V2 `timeout`)."
    )
    drain_timeout_s: float = Field(default=20.0, ge=0.0, description="On SIGTERM, how long to finish accepted work.")
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, description="Largest request body, in bytes.")
    max_held_bytes: int = Field(
        default=1024 * 1024 * 1024,
        ge=1024,
        description="Bytes the requests one process is answering may hold: bodies as they arrive (a declared "
        "length before it is read), then their tensors; gRPC messages likewise, from before they are parsed; past it, "
        "429 (RESOURCE_EXHAUSTED over gRPC; retry shortly). At least max_body_bytes. With shared_engine, the budget "
        "of the whole process tree: split evenly between the fronts (each at least max_body_bytes).",
    )
    max_header_bytes: int = Field(
        default=16 * 1024,
        ge=1024,
        le=1024 * 1024,
        description="Largest request head (request line and headers), and the budget of every other byte of a "
        "request that is not body data (chunk framing, trailers: plus 1/64 of the body); cut off with 431 as it arrives. "
        "Also the largest gRPC metadata (RESOURCE_EXHAUSTED).",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0.0,
        description="A request's head must arrive within this many seconds; else 408 and close. gRPC: a connection's "
        "preface and settings within it, and a connection with no call in flight for as long is closed.",
    )
    read_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description="Longest pause while a request's body arrives; else 408.",
    )
    min_body_rate: int = Field(
        default=65536,
        ge=0,
        description="Bytes per second a body must average after its first read_timeout_s, so that it arrives "
        "within read_timeout_s + its size / this rate; else 408. 0: no rate, the pause bound alone.",
    )
    send_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description="Longest a client may take no part of an answer; then it is dropped (gRPC: its connection ended).",
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="Open HTTP connections per process: at the cap the one idle longest is closed for a new one, "
        "else the one whose head has been arriving longest, and with neither the new one gets 503; at most half may "
        "be still sending their request (past it, the oldest incomplete head makes room, else 503). Also the most "
        "gRPC connections, and gRPC calls in flight, per process (past it, RESOURCE_EXHAUSTED; the probes, which "
        "need no key, have as many of their own). The process's file descriptor limit is "
        "raised to fit it, or it is lowered with a log line.",
    )
    max_loop_lag_s: float = Field(
        default=2.0,
        gt=0.0,
        description="Readiness answers 503 for a few seconds after the event loop was held longer than this "
        "(a huge body parsed, a blocking bug): the process answers nothing while it is held.",
    )
    heartbeat_timeout_s: float = Field(
        default=5.0,
        gt=0.0,
        description="Workers: one whose event loop sends its supervisor no heartbeat for this long (held, stopped, "
        "hung) is asked to drain (SIGTERM), and killed if silent as long again; replaced either way, with a log line "
        "saying why. Counted only over time the supervisor itself ran.",
    )
    worker_start_timeout_s: float = Field(
        default=300.0,
        gt=0.0,
        description="Workers: one not ready this long after it was started (loading, warming up, or hung doing so) "
        "is killed, with a log line: replaced once the service has been ready, else the start fails.",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="If set, every route but the probes (health, model readiness) needs Bearer auth; "
        "visible ASCII, no spaces, at most half of max_header_bytes.",
    )
    tls_cert_file: Path | None = Field(
        default=None,
        description="TLS: the server's certificate (PEM, the chain after it). With tls_key_file, the HTTP port (and "
        "the metrics port) serves HTTPS only and the gRPC port TLS only, TLS 1.2 at the least. Checked at start; "
        "read again on SIGHUP or when the file changes.",
    )
    tls_key_file: Path | None = Field(
        default=None,
        description="TLS: the private key of tls_cert_file (PEM, unencrypted); set both or neither.",
    )
    tls_client_ca_file: Path | None = Field(
        default=None,
        description="Mutual TLS: every client (HTTP, gRPC and metrics) must present a certificate signed by a CA in "
        "this PEM file; one without is refused in the handshake. Needs tls_cert_file and tls_key_file.",
    )
    cors_origins: list[str] = Field(default_factory=list, description="Origins allowed by CORS; none by default.")
    torch_threads: int = Field(
        default=0,
        ge=0,
        description="torch intra-op threads per process; 0 = torch's default, or cores / workers. "
        "Batch-invariant mode runs one.",
    )
    gil_switch_interval_us: int = Field(
        default=50,
        ge=1,
        le=100_000,
        description="How long the event loop may keep the GIL from the model thread once it asks, in microseconds "
        "(Python's switch interval; Python's default 5000 starves the model while the loop is busy).",
    )
    inline_forward_us: int = Field(
        default=500,
        ge=0,
        le=100_000,
        description="CPU: batches whose forward pass took at most this long at start (microseconds) run on the "
        "event loop's thread, saving two thread hand-offs; longer ones run on the model thread. 0: never.",
    )
    lean_path: bool = Field(
        default=True,
        description="Serve the tensor routes' plain requests inside the HTTP protocol, below ASGI, from cached "
        "request plans; a request the lean path does not take (compressed, traced, CORS, pipelined, Monte Carlo, "
        "a head it would refuse) goes to FastAPI and gets the same answer. false: every request goes to FastAPI.",
    )
    warmup: bool = Field(default=True, description="Run every batch-size bucket once before reporting ready.")
    max_mc_passes: int = Field(
        default=64,
        ge=0,
        le=4096,
        description="Most Monte Carlo dropout passes one request may ask for (mc_passes); 0 turns the mode off.",
    )
    cuda_graphs: bool = Field(
        default=True,
        description="CUDA: replay one CUDA graph per batch-size bucket, the batch padded up to it; captured and "
        "checked against eager at warm-up (a bucket that differs stays eager). Off, or no warm-up: every batch eager.",
    )
    tf32: bool = Field(
        default=False,
        description="CUDA, float32 models: TF32 tensor-core matmuls; several times faster, ~1e-3 relative "
        "error (a 10-bit mantissa) instead of ~1e-7.",
    )
    staging: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Double-buffered pinned staging: the copy of batch k+1 overlaps the compute of batch k. "
        "auto: on CUDA; on: on the CPU too (same answers, no overlap); off: one synchronous copy each way.",
    )
    fuse_gate: bool = Field(
        default=True,
        description="Gated models: one GEMM over W1‖V, concatenated at load; checked against the unfused form "
        "at warm-up.",
    )
    batch_invariant: bool = Field(
        default=False,
        description="Every forward pass at batch_invariant_rows rows, padded, with one torch thread, so a row's "
        "answer is bit-identical whatever it is batched with. Off: batched rows agree to float tolerance only.",
    )
    batch_invariant_rows: int = Field(
        default=64,
        ge=1,
        description="The row count of every forward pass in batch-invariant mode; larger batches run as several.",
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description="Trace requests with OpenTelemetry, sending spans as OTLP/HTTP to this collector "
        "(http://host:4318; spans go to its path /v1/traces), as TEI's --otlp-endpoint. Unset: "
        "OTEL_EXPORTER_OTLP_ENDPOINT if set, else no tracing.",
    )
    shared_memory: bool = Field(
        default=False,
        description="Turn on the system shared-memory extension: clients on this host register POSIX shared-memory "
        "regions (/dev/shm) and infer with tensors in them, sending no tensor bytes over the socket. A region may "
        "be any object this server's user can open: give the API key to trusted local clients only.",
    )
    triton_metrics: bool = Field(
        default=True,
        description="Also write Triton's metric names on /metrics (nv_inference_* per model and version, nv_gpu_* per "
        "GPU), computed from the ffn_* series at each scrape; --no-triton-metrics (FFN_TRITON_METRICS=false) leaves "
        "them out.",
    )
    models: list[ModelSpec] = Field(default_factory=list, description="Models to serve; empty = the built-in demo.")
    model_control: Literal["none", "explicit"] = Field(
        default="none",
        description="none: the models are fixed at start (load and unload answer 400). explicit: "
        "POST /v2/repository/models/{name}/load|unload and SIGHUP load, reload and unload models while serving; "
        "a load serves only a name a [[models]] table names.",
    )
    model_repository: Path | None = Field(
        default=None,
        description="The folder a load's config parameter may name weight files in (relative to it, never "
        "outside it); unset: the config file's folder.",
    )

    @model_validator(mode="after")
    def _ports_differ(self) -> Settings:
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port must differ from port (both are {self.port})")
        if self.grpc and self.grpc_port and self.grpc_port in (self.port, self.metrics_port):
            raise ValueError(
                f"grpc_port must differ from port and metrics_port (it is {self.grpc_port}): {GRPC_PORT_FIX}"
            )
        return self

    @model_validator(mode="after")
    def _tls_files_together(self) -> Settings:
        # One of the pair alone would serve cleartext without a word; a client CA without a certificate too.
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            given, missing = (
                ("tls_cert_file", "tls_key_file") if self.tls_key_file is None else ("tls_key_file", "tls_cert_file")
            )
            raise ValueError(f"{given} is set but {missing} is not: set both to serve TLS, or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file: mutual TLS is TLS first")
        return self

    @field_validator("model_repository")
    @classmethod
    def _repository_is_a_folder(cls, folder: Path | None) -> Path | None:
        # Resolved once, here: every path a load names is checked against this one real folder.
        if folder is None:
            return None
        if not folder.is_dir():
            raise ValueError(f"{folder} is not a folder")
        return folder.resolve()

    @model_validator(mode="after")
    def _one_body_fits_the_held_budget(self) -> Settings:
        if self.max_held_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_held_bytes ({self.max_held_bytes}) must be at least max_body_bytes ({self.max_body_bytes}): "
                "else the largest body could never be read"
            )
        if self.held_bytes_per_process < self.max_body_bytes:
            raise ValueError(
                f"max_held_bytes ({self.max_held_bytes}) split between {self.workers} fronts and their hand-off "
                f"memory (shared_engine) is {self.held_bytes_per_process} each, less than max_body_bytes "
                f"({self.max_body_bytes}): else the largest body could never be read; raise max_held_bytes "
                f"to at least {2 * self.workers * self.max_body_bytes} or lower max_body_bytes"
            )
        return self

    @property
    def held_bytes_per_process(self) -> int:
        """The bytes one serving process's requests may hold: max_held_bytes, or with shared_engine a front's
        share, so that the budget bounds the whole process tree. A front's request is held twice there: its
        bytes in the front, and its rows (then its answer) in the hand-off's shared memory, which the engine
        reads in place; so each front holds max_held_bytes / (2 x workers), and its slots as much again."""
        return self.max_held_bytes // (2 * self.workers) if self.shared_engine else self.max_held_bytes

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, key: SecretStr | None) -> SecretStr | None:
        # An empty key would turn auth off without a word; a key with spaces or control characters
        # cannot be sent in an Authorization header intact. Either is a mistake: refuse to start.
        if key is None:
            return None
        value = key.get_secret_value()
        if not value.strip():
            raise ValueError("the API key is empty or blank; unset FFN_API_KEY to serve without auth")
        if not all("!" <= char <= "~" for char in value):
            raise ValueError("the API key must be visible ASCII characters without spaces (a Bearer token)")
        return key

    @model_validator(mode="after")
    def _key_fits_in_a_head(self) -> Settings:
        # A key that fills the head budget would get every request that carries it a 431.
        if self.api_key is not None and len(self.api_key.get_secret_value()) > self.max_header_bytes // 2:
            raise ValueError(
                f"the API key is {len(self.api_key.get_secret_value())} characters: a request carrying it "
                f"would pass max_header_bytes ({self.max_header_bytes}); use one of at most "
                f"{self.max_header_bytes // 2}, or raise max_header_bytes"
            )
        return self

    @field_validator(*TIMEOUTS)
    @classmethod
    def _a_timeout_that_bounds(cls, value: float, info: ValidationInfo) -> float:
        milliseconds = str(info.field_name).endswith("_ms")
        most, unit = (MAX_TIMEOUT_S * 1000, "milliseconds") if milliseconds else (MAX_TIMEOUT_S, "seconds")
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number of {unit}: {value} would turn this bound off")
        if value > most:
            raise ValueError(f"must be at most {most:.0f} {unit} (a day): a longer bound is no bound")
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        # Starlette compares the Origin header with each one as it is written: one with a path, a
        # trailing slash or a space never matches, and "null" would admit every sandboxed page.
        for origin in origins:
            problem = None if origin == "*" else url_problem(origin, "origin")
            if problem is not None:
                raise ValueError(f"{origin[:80]!r} {problem}")
        return origins

    @field_validator("devices")
    @classmethod
    def _known_devices(cls, devices: list[str]) -> list[str]:
        for device in devices:
            if DEVICE_PATTERN.fullmatch(device) is None:
                raise ValueError(f"{device[:80]!r} is not a device: auto, cpu, cuda or cuda:N")
        return devices

    @model_validator(mode="after")
    def _devices_need_the_shared_engine(self) -> Settings:
        if self.devices and not self.shared_engine:
            raise ValueError("devices names the engine processes of shared_engine: set shared_engine = true too")
        return self

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        problem = endpoint_problem(url)
        if problem is not None:
            raise ValueError(f"the OTLP endpoint {problem}")
        return url

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelSpec]) -> list[ModelSpec]:
        return unique_names(models)

    def served_models(self) -> list[ModelSpec]:
        """The configured models, or the built-in `demo` when none are."""
        return served_models(self.models)

    def intra_op_threads(self) -> int:
        """The torch threads each process sets: 0 leaves torch's default; batch-invariant mode runs one.

        Several threads split a GEMM's rows between them, and on some CPUs the parts reduce in
        different orders: on a 16-thread Xeon (torch 2.11) rows 8 to 15 of a 16-row pass came out
        with other bits than row 0 had, so a row's answer depended on its place in the batch.
        """
        return 1 if self.batch_invariant else self.torch_threads

    def repository(self) -> Path | None:
        """The folder loads may read from: model_repository, else the config file's folder; None: neither is set."""
        if self.model_repository is not None:
            return self.model_repository
        return self.config.resolve().parent if self.config is not None else None


def unique_names(models: list[ModelSpec]) -> list[ModelSpec]:
    names = [m.name for m in models]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"model names must be unique, repeated: {duplicates}")
    return models


def served_models(models: list[ModelSpec]) -> list[ModelSpec]:
    """`models`, or the built-in `demo` when there are none (the rule at start and when SIGHUP re-reads the file)."""
    return models or [ModelSpec(name="demo")]


class ConfigFileError(SettingsError):
    """The config file cannot be read or does not hold valid settings."""

    def __init__(self, message: str) -> None:
        super().__init__([message])


def read_config_file(path: Path) -> dict[str, Any]:
    """The TOML file's values, model weight paths made relative to the file's folder.

    Read as the weight files are: a regular file only (a FIFO would hang the start, /dev/zero
    never end), of at most MAX_CONFIG_BYTES, UTF-8, nested no deeper than the parser can go.
    """
    text = _config_text(path)
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"config file {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigFileError(f"config file {path} is not valid TOML: arrays or tables nested too deeply") from None
    models = values.get("models", [])
    if not isinstance(models, list):
        raise ConfigFileError(f"config file {path}: `models` must be an array of tables ([[models]])")
    for index, model in enumerate(models):
        if isinstance(model, dict) and isinstance(model.get("weights"), str):
            weights = path.parent / model["weights"]
            try:
                model["weights"] = str(weights.resolve())
            except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop, before Python 3.13
                raise ConfigFileError(
                    f"config file {path}: models[{index}].weights {model['weights']!r}: cannot resolve {weights}: "
                    f"{getattr(exc, 'strerror', None) or exc}"
                ) from None
    return values


def configured_models(path: Path) -> list[ModelSpec]:
    """The [[models]] tables of the config file at `path`, read again (SIGHUP, a load without a config).

    Raises SettingsError naming the file and each problem (ConfigFileError: it cannot be read).
    """
    values = read_config_file(path)
    try:
        models = _ModelTables.model_validate({"models": values.get("models", [])}).models
    except ValidationError as exc:
        origins = Origins(ENV_PREFIX, config=path, file_keys={"models"})
        problems = validation_problems(exc, origins, ["models"], list(ModelSpec.model_fields))
        raise SettingsError(problems) from None
    return served_models(models)


class _ModelTables(BaseModel):
    """The models of a config file alone, checked as Settings checks them."""

    models: list[ModelSpec]

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelSpec]) -> list[ModelSpec]:
        return unique_names(models)


def _config_text(path: Path) -> str:
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigFileError(f"config file {path} is {file_kind(info.st_mode)}, not a regular file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise ConfigFileError(
            f"config file {path} is {info.st_size} bytes; a config file holds at most {MAX_CONFIG_BYTES}"
        )
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:  # grew since it was looked at
        raise ConfigFileError(f"config file {path} is over {MAX_CONFIG_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigFileError(
            f"config file {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None


def load_settings(**overrides: Any) -> Settings:
    """Settings from flags (`overrides`, None = not given), the environment and the config file.

    Raises SettingsError: one line per problem, naming the key, where its value came from (flag,
    variable or file) and what is wrong.
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    origins = Origins(ENV_PREFIX, flags=set(overrides), environ=dict(os.environ))
    from_env = _validated(origins, overrides)
    file_values: dict[str, Any] = {}
    if from_env.config is not None:
        file_values = read_config_file(from_env.config)
        file_values.pop("config", None)
        origins.config, origins.file_keys = from_env.config, set(file_values)
    explicit = {name: getattr(from_env, name) for name in from_env.model_fields_set}
    return _validated(origins, {**file_values, **explicit})


def _validated(origins: Origins, values: dict[str, Any]) -> Settings:
    """Settings(**values) (the environment filling in the rest), or SettingsError naming each problem."""
    try:
        return Settings(**values)
    except ValidationError as exc:
        secret = [name for name, f in Settings.model_fields.items() if "SecretStr" in str(f.annotation)]
        problems = validation_problems(exc, origins, list(Settings.model_fields), list(ModelSpec.model_fields), secret)
        raise SettingsError(problems) from None
    except SourceError as exc:
        raise SettingsError([source_problem(exc, origins)]) from None
    except RecursionError:
        raise SettingsError([_too_deep(origins)]) from None


def _too_deep(origins: Origins) -> str:
    """The one line for a list or table value nested past what the JSON parser can go (FFN_MODELS=[[[[...)."""
    for name, value in origins.environ.items():
        if name.upper().startswith(ENV_PREFIX):
            try:
                json.loads(value)
            except RecursionError:
                key = name[len(ENV_PREFIX) :].lower()
                return f"invalid setting {key} (environment variable {name}): a list or table nested too deeply"
            except ValueError:
                pass
    return "invalid settings: a list or table nested too deeply"


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake raised as SettingsError (one line) instead of the usage and an exit."""

    def error(self, message: str) -> NoReturn:
        raise SettingsError([message])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Readable metavars in --help, in place of pydantic-settings' type names (SecretStr, list[JSON]).
_METAVARS = {"Path": "FILE", "SecretStr": "KEY", "list[JSON]": "JSON"}
_LIST_METAVARS = {"cors_origins": "ORIGIN", "devices": "DEVICE"}  # list[str] settings, by name
# A plain number or text is named by the last word of its setting: --port PORT, --max-wait-ms MS.
_UNITS = {"s": "SECONDS"}


def _add_argument(parser: argparse.ArgumentParser, *names: str, **options: Any) -> argparse.Action:
    metavar = options.get("metavar")
    if metavar == "list[str]":
        options["metavar"] = _LIST_METAVARS[str(options["dest"])]
    elif metavar in _METAVARS:
        options["metavar"] = _METAVARS[metavar]
    elif metavar in ("int", "float", "str"):
        last = str(options["dest"]).rsplit("_", 1)[-1]
        options["metavar"] = _UNITS.get(last, last.upper())
    return parser.add_argument(*names, **options)


@dataclass(frozen=True)
class Command:
    """The command line: the settings given as flags, and what to do with them."""

    settings: dict[str, Any]
    check: bool = False  # --check: load, warm up and ask every model once, in-process, then exit (app/process/check.py)


def command_line(argv: Sequence[str] | None) -> dict[str, Any]:
    """The settings given as flags in `argv` (only those given): parse_command's settings."""
    return parse_command(argv).settings


def parse_command(argv: Sequence[str] | None) -> Command:
    """The command line `argv`, from a parser built from Settings, and --check.

    `--help` and `--version` print and exit, as argparse does; a mistake (an unknown flag, a
    value missing or not among the choices) raises SettingsError, the nearest flag named.
    """
    parser = _Parser(
        prog="ffn-serve",
        description="Serve position-wise feed-forward networks over HTTP. Every flag is also an FFN_* "
        "environment variable and a key of the TOML config file; flags beat the environment, which "
        "beats the file.",
    )
    parser.add_argument("--version", action="version", version=f"ffn-serve {__version__}")
    parser.add_argument(
        "--check",
        action="store_true",
        help="Smoke test: load every model, warm it up and answer one request per model in this process "
        "(no port is bound), then exit 0, or print one line saying what failed and exit 2.",
    )
    source: CliSettingsSource[Settings] = CliSettingsSource(
        Settings,
        root_parser=parser,
        add_argument_method=_add_argument,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_show_env_vars=True,
        cli_avoid_json=True,
    )
    parsed, extras = parser.parse_known_args(list(argv or []))
    if extras:
        flags = [_flag(name) for name in Settings.model_fields]
        flags += [_flag("no_" + name) for name, f in Settings.model_fields.items() if f.annotation is bool]
        raise SettingsError(unknown_arguments(extras, [*flags, "--help", "--version", "--check"]))
    try:
        return Command(source(parsed_args=parsed)(), check=parsed.check)
    except SourceError as exc:
        raise SettingsError([str(exc)]) from None
    except RecursionError:
        raise SettingsError(["a flag's list or table is nested too deeply"]) from None


def budgets_off(settings: Settings) -> list[str]:
    """One line per setting whose value turns a budget off, logged at start (one a timeout cannot be: refused)."""
    if settings.min_body_rate == 0:
        return [
            f"min_body_rate is 0: the bound on a body's rate is off; a body may take any time as long as it "
            f"never pauses for read_timeout_s ({settings.read_timeout_s:g} s)"
        ]
    return []


def misspelt_variables(environ: Mapping[str, str] = os.environ) -> list[str]:
    """One warning per `FFN_*` variable that names no setting, with the nearest real one."""
    known = [ENV_PREFIX + name.upper() for name in Settings.model_fields]
    return [
        f"environment variable {name} is not a setting and is ignored{nearest(name.upper(), known, 'settings')}"
        for name in sorted(environ)
        if name.startswith(ENV_PREFIX) and name.upper() not in known
    ]
