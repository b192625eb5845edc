"""The live controller's configuration: YAML validated by pydantic, like scenarios, with the scenario's own
`router:` block (`twin.scenario.RouterSpec`), so a policy that won in `twin compare` is copied here unchanged."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from twin.errors import TwinInputError
from twin.scenario import RouterSpec, _format_error, apply_overrides


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSpec(_Spec):
    """Where the proxy listens and what it accepts."""

    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    api_key: Optional[str] = Field(None, description="clients must send 'Authorization: Bearer KEY'")
    api_key_env: Optional[str] = Field(None, description="or: read the key from this environment variable")
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    request_timeout_s: float = Field(600.0, gt=0, description="whole upstream request, streaming included")
    connect_timeout_s: float = Field(5.0, gt=0)
    shutdown_timeout_s: float = Field(60.0, gt=0, description="SIGTERM: how long in-flight requests may finish")
    max_connections_per_worker: int = Field(256, gt=0, description="pooled upstream connections per worker")
    retry_before_first_byte: bool = True

    def resolved_api_key(self) -> str | None:
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise TwinInputError(f"server.api_key_env: environment variable {self.api_key_env} is not set")
            return key
        return None


class WorkerSpec(_Spec):
    """A worker that runs already (static registry)."""

    id: Optional[str] = None
    url: str
    kv_events_endpoint: Optional[str] = Field(
        None, description="where the controller binds a ZMQ SUB socket this worker's publisher connects to, "
                          "e.g. tcp://127.0.0.1:5557 (the worker's --kv-events-config endpoint)")
    max_num_batched_tokens: Optional[int] = Field(None, gt=0, description="its launch argument, when known")
    max_num_seqs: Optional[int] = Field(None, gt=0)
    max_model_len: Optional[int] = Field(None, gt=0)

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")


class LauncherSpec(_Spec):
    """Local vLLM worker processes the controller starts, drains and stops (the local actuator)."""

    python: str = Field(".venv-vllm/bin/python", description="the interpreter that has vLLM installed")
    model: str = Field(description="model folder or name, passed to the vLLM server")
    served_model_name: Optional[str] = None
    host: str = "127.0.0.1"
    base_port: int = Field(8200, gt=0, le=65535)
    kv_events: bool = Field(True, description="give each worker a ZMQ KV-event publisher the controller binds")
    kv_events_base_port: int = Field(5600, gt=0, le=65535)
    num_workers: int = Field(1, ge=0, description="workers started at boot")
    max_workers: int = Field(8, ge=1)
    engine_args: dict[str, Any] = Field(default_factory=dict, description=(
        "vLLM engine arguments by their vLLM names (max_num_batched_tokens: 2048, enforce_eager: true, ...)"))
    env: dict[str, str] = Field(default_factory=dict)
    cpu_binds: list[str] = Field(default_factory=list, description=(
        "VLLM_CPU_OMP_THREADS_BIND per worker slot (CPU workers); empty: not set"))
    ready_timeout_s: float = Field(300.0, gt=0)
    stop_timeout_s: float = Field(15.0, gt=0, description="SIGTERM to SIGKILL")
    log_dir: Optional[str] = Field(None, description="worker stdout/stderr files (default: a temporary folder)")


class HealthSpec(_Spec):
    """Health checks send one tiny completion: a broken engine can still answer 200 on /health."""

    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(30.0, gt=0)
    backoff_initial_s: float = Field(1.0, gt=0)
    backoff_max_s: float = Field(30.0, gt=0)


class TokenizerSpec(_Spec):
    """How the proxy learns a prompt's token ids (for the prefix index and the token count).

    auto: `local` when `path` is set, else `worker` (the worker's /tokenize) when the router reads a prefix
    index, else `estimate` (ASSUMPTION: 4 characters per token, no prefix)."""

    mode: Literal["auto", "worker", "local", "estimate"] = "auto"
    path: Optional[str] = None
    chars_per_token: float = Field(4.0, gt=0)
    block_size: Optional[int] = Field(None, gt=0, description="hash block size (default: the workers' own)")


class KVEventSpec(_Spec):
    startup_check_s: float = Field(60.0, ge=0, description="how long to wait for a worker's first KV event")


class ScalerSpec(_Spec):
    """The scaler hook: `decide(now, fleet, forecast) -> ScaleAction`, run every `interval_s`."""

    name: str = "none"
    params: dict[str, Any] = Field(default_factory=dict)
    interval_s: float = Field(10.0, gt=0)


class LiveConfig(_Spec):
    name: str = "live"
    seed: int = 0
    model: Optional[str] = Field(None, description="the served model name (default: what the workers serve)")
    server: ServerSpec = ServerSpec()
    router: RouterSpec = RouterSpec()
    min_scrape_interval_s: float = Field(0.02, gt=0, description=(
        "live floor for router.scrape_interval_s (0 means exact in the twin; live scrapes cannot be)"))
    workers: list[WorkerSpec] = Field(default_factory=list)
    launcher: Optional[LauncherSpec] = None
    health: HealthSpec = HealthSpec()
    tokenizer: TokenizerSpec = TokenizerSpec()
    kv_events: KVEventSpec = KVEventSpec()
    scaler: ScalerSpec = ScalerSpec()
    base_dir: str = Field(".", exclude=True)

    @model_validator(mode="after")
    def _some_workers(self) -> "LiveConfig":
        if not self.workers and self.launcher is None:
            raise ValueError("give workers (static URLs) or launcher (local vLLM processes), or both")
        ids = [w.id for w in self.workers if w.id]
        if len(ids) != len(set(ids)):
            raise ValueError("workers: ids must be unique")
        return self

    @property
    def scrape_interval_s(self) -> float:
        return max(self.router.scrape_interval_s, self.min_scrape_interval_s)

    def resolve_path(self, p: str) -> Path:
        path = Path(p)
        return path if path.is_absolute() else Path(self.base_dir) / path


def parse_config(raw: Any, source: str = "config", base_dir: str | Path = ".") -> LiveConfig:
    if not isinstance(raw, dict):
        raise TwinInputError(f"{source}: a live config must be a YAML mapping, got {type(raw).__name__}")
    try:
        return LiveConfig.model_validate({**raw, "base_dir": str(base_dir)})
    except ValidationError as e:
        raise TwinInputError(_format_error(e, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> LiveConfig:
    """Read, override (`--set a.b=v`) and validate a live config; bad input is a TwinInputError."""
    path = Path(path)
    if not path.exists():
        raise TwinInputError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise TwinInputError(f"{path}:{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise TwinInputError(f"{path}: a live config must be a YAML mapping, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    return parse_config(raw, str(path), path.parent)
