"""The live controller's configuration: YAML validated by pydantic, like scenarios, with the scenario's own
`router:` block (`twin.scenario.RouterSpec`), so a policy that won in `twin compare` is copied here unchanged."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import PositiveInt, ConfigDict, Field, ValidationError, field_validator, model_validator

from twin.errors import TwinInputError
from twin.scenario import (ChunkPlanSpec, PerfSpec, PredictorSpec, RouterSpec, ScalerSpec, SLOSpec, _format_error,
                           apply_overrides, kv_cache_dtype_name, read_yaml_mapping)
from twin.spec_base import NumbersChecked


class _Spec(NumbersChecked):
    """The scenario's checks (no inf or NaN, no true for a number), without its assignment validation."""

    model_config = ConfigDict(extra="forbid")


class ServerSpec(_Spec):
    """Where the proxy listens and what it accepts."""

    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    api_key: Optional[Union[str, list[str]]] = Field(
        None, description="clients of /v1 must send 'Authorization: Bearer KEY' (one of them, as vLLM's --api-key)")
    api_key_env: Optional[str] = Field(None, description="or: read the key from this environment variable")
    # vLLM's server takes a body of any size (a long prompt's token ids, base64 images); this bound is the proxy's
    max_body_bytes: int = Field(128 * 1024 * 1024, gt=0)
    request_timeout_s: float = Field(600.0, gt=0, description="a whole unary upstream request; for a stream, the "
                                     "longest wait for its next chunk (the first included), so that a long stream "
                                     "that goes on producing is not cut")
    connect_timeout_s: float = Field(5.0, gt=0)
    shutdown_timeout_s: float = Field(60.0, gt=0, description="SIGTERM: how long in-flight requests may finish")
    max_connections_per_worker: int = Field(256, gt=0, description="pooled upstream connections per worker")
    retry_before_first_byte: bool = True

    def resolved_api_keys(self) -> tuple[str, ...] | None:
        """The keys a client may send, or None (no key asked)."""
        if self.api_key is not None:
            keys = (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)
            if not keys or any(not k for k in keys):  # else an empty list or key had turned the check off
                raise TwinInputError("server.api_key: an empty key or list (leave it out to ask no key)")
            return keys
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise TwinInputError(f"server.api_key_env: environment variable {self.api_key_env} is not set")
            return (key,)
        return None


class WorkerSpec(_Spec):
    """A worker that runs already (static registry)."""

    id: Optional[str] = None
    url: str
    kv_events_endpoint: Optional[str] = Field(
        None, description="where the controller binds a ZMQ SUB socket this worker's publisher connects to, "
                          "e.g. tcp://127.0.0.1:5557 (the worker's --kv-events-config endpoint)")
    max_num_batched_tokens: Optional[int] = Field(None, gt=0, description=(
        "its launch argument, when known (unset: vLLM's default on shadow.hardware, e.g. 8192 on an H100)"))
    max_num_seqs: Optional[int] = Field(None, gt=0, description="the same (unset: e.g. 1024 on an H100)")
    max_model_len: Optional[int] = Field(None, gt=0)
    performance_mode: Optional[Literal["balanced", "interactivity", "throughput"]] = Field(None, description=(
        "its --performance-mode, when set (throughput doubles the two defaults above)"))
    api_key: Optional[str] = Field(None, min_length=1, description=(
        "its --api-key (or VLLM_API_KEY), when it asks one: the controller's own calls to its /v1 send it, and so "
        "does the proxy on clients' requests when server.api_key is set"))
    api_key_env: Optional[str] = Field(None, description="or: read that key from this environment variable")

    def resolved_api_key(self, index: int) -> str | None:
        """Its key, or None (it asks none)."""
        if self.api_key is not None:
            return self.api_key
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise TwinInputError(f"workers[{index}].api_key_env: environment variable {self.api_key_env} is "
                                     "not set")
            return key
        return None

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        from urllib.parse import urlsplit

        try:  # a URL no request can reach would only show as a worker down at start, then never up
            parts = urlsplit(v)
            port = parts.port
        except ValueError as e:
            raise ValueError(f"not a URL ({e})") from None
        if not parts.hostname or any(c.isspace() for c in v):
            raise ValueError("not a URL with a host (http://HOST:PORT)")
        if port == 0:
            raise ValueError("port 0 is no worker's port")
        return v.rstrip("/")

    @field_validator("kv_events_endpoint")
    @classmethod
    def _zmq(cls, v: Optional[str]) -> Optional[str]:
        import re

        if v is None:
            return v
        m = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):([0-9]{1,5})|ipc://\S+", v)
        if m is None or (m.group(2) is not None and not 0 < int(m.group(2)) <= 65535):
            raise ValueError("a ZMQ endpoint the controller binds: tcp://HOST:PORT (or ipc://PATH)")
        return v


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
    launch_backoff_initial_s: float = Field(10.0, gt=0, description=(
        "after a scaler round whose launch failed, no launch for this long; doubled by each such round in a row"))
    launch_backoff_max_s: float = Field(300.0, gt=0, description="the longest wait between failed launch rounds")

    @model_validator(mode="after")
    def _reachable(self) -> "LauncherSpec":
        """A fleet the launcher could never start is refused at load, not once its first workers are up."""
        if self.launch_backoff_initial_s > self.launch_backoff_max_s:  # as health's back-off: a cap set alone wins
            if "launch_backoff_initial_s" in self.model_fields_set:
                raise ValueError(f"launch_backoff_initial_s {self.launch_backoff_initial_s:g} is above "
                                 f"launch_backoff_max_s {self.launch_backoff_max_s:g}")
            self.launch_backoff_initial_s = self.launch_backoff_max_s
        if self.num_workers > self.max_workers:
            raise ValueError(f"num_workers {self.num_workers} is above max_workers {self.max_workers}")
        ranges = {"base_port": self.base_port}
        if self.kv_events:
            ranges["kv_events_base_port"] = self.kv_events_base_port
        for key, first in ranges.items():
            if first + self.max_workers - 1 > 65535:
                raise ValueError(f"{key} {first} leaves no port for worker {65536 - first + 1} of max_workers "
                                 f"{self.max_workers} (ports end at 65535)")
        if self.kv_events and abs(self.base_port - self.kv_events_base_port) < self.max_workers:
            raise ValueError(f"base_port {self.base_port} and kv_events_base_port {self.kv_events_base_port} are "
                             f"closer than max_workers {self.max_workers}: a worker's HTTP and KV-event ports clash")
        return self


class HealthSpec(_Spec):
    """Health checks send one tiny completion: a broken engine can still answer 200 on /health."""

    # floors: a health check every nanosecond hammered the workers (a fuzzing pass, 2026-12-07)
    interval_s: float = Field(5.0, ge=0.05)
    timeout_s: float = Field(30.0, gt=0)
    backoff_initial_s: float = Field(1.0, ge=0.01)
    backoff_max_s: float = Field(30.0, ge=0.01)

    @model_validator(mode="after")
    def _backoff_grows(self) -> "HealthSpec":
        """A first backoff set above the cap was silently cut to the cap (a fuzzing pass, 2026-12-07); a cap set
        below the default first backoff takes it down with it."""
        if self.backoff_initial_s > self.backoff_max_s:
            if "backoff_initial_s" in self.model_fields_set:
                raise ValueError(f"backoff_initial_s {self.backoff_initial_s:g} is above backoff_max_s "
                                 f"{self.backoff_max_s:g}")
            self.backoff_initial_s = self.backoff_max_s
        return self


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


class ShadowLoadSpec(_Spec):
    """How the shadow twin guesses the next window's arrivals from the last one (`live.shadow.LOAD_MODELS`).

    ASSUMPTION (user-settable): `replay` assumes the next window looks like the last one (the same arrivals,
    shifted forward one window); `poisson` keeps only its rate and its (prompt, output) pairs."""

    name: str = "replay"
    params: dict[str, Any] = Field(default_factory=dict)


class ShadowSpec(_Spec):
    """Shadow mode (`live.shadow`): mirror observed arrivals into the twin, forecast the next window's latency
    under the current configuration and alternatives, export forecasts and their realised error."""

    enabled: bool = False
    interval_s: float = Field(10.0, ge=0.1, description="how often the shadow twin runs (each run simulates)")
    window_s: Optional[float] = Field(None, gt=0, description="the observed window replayed (default: interval_s)")
    max_requests: int = Field(2000, gt=0, description=(
        "cost bound: at most this many of the window's most recent requests are simulated (the window shrinks "
        "to their span, so the rate is kept)"))
    hardware: Optional[str] = Field(None, description="the workers' GPU (twin/specs/hardware.yaml), e.g. CPU-2core-AVX512")
    model: Optional[str] = Field(None, description="the served model's shapes (twin/specs/models.yaml), e.g. tiny-llama")
    dtype: Literal["bf16", "fp16", "fp8"] = "bf16"
    kv_cache_dtype: Literal["auto", "bf16", "fp16", "fp8"] = "auto"  # or vLLM's names: bfloat16, fp8_e4m3...
    tensor_parallel: int = Field(1, gt=0)
    perf: PerfSpec = Field(default_factory=PerfSpec, description=(
        "the step model, as in a scenario: {kind: roofline} or {kind: fitted, fit_path: FILE} (`twin calibrate`)"))
    engine: dict[str, Any] = Field(default_factory=dict, description=(
        "engine settings over what the workers report (scenario `engine:` names), e.g. async_scheduling: false"))
    chunk_sizes: list[PositiveInt] = Field(default_factory=list, description=(
        "max_num_batched_tokens alternatives (empty: half and double the current one)"))
    carry_in_flight: bool = Field(True, description=(
        "start each forecast from the requests in flight now (else from idle engines); see live.shadow"))
    alternatives: bool = Field(True, description="also forecast +1 / -1 instance and the chunk sizes")
    startup_delay_s: Optional[float] = Field(None, ge=0, description=(
        "how long a new worker takes to serve, in the forecasts of a larger fleet (instances+1, the twin "
        "scaler) and for workers still starting (default: the median of the launcher's measured start-ups; "
        "0 before any, an ASSUMPTION the /shadow page names)"))
    slo: SLOSpec = Field(default_factory=SLOSpec, description="goodput and the twin scaler's attainment use it")
    load: ShadowLoadSpec = Field(default_factory=ShadowLoadSpec)
    executor: Literal["thread", "process"] = Field("thread", description=(
        "where simulations run: a thread (shares the GIL with the proxy) or a child process"))
    history: int = Field(20, gt=0, description="scored windows kept for /shadow")
    min_scored_requests: int = Field(1, gt=0, description="a window is scored when it has this many finished requests")

    @property
    def window(self) -> float:
        return self.window_s if self.window_s is not None else self.interval_s

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _kv_dtype(cls, v: Any) -> Any:
        return kv_cache_dtype_name(v)

    @field_validator("hardware", "model")
    @classmethod
    def _known(cls, v: Optional[str], info: Any) -> Optional[str]:
        """Checked whenever named, shadow mode or not: the live batch defaults read the hardware too, and a typo
        there left them on placeholders without a word."""
        if v is None:
            return v
        from twin.specs.hardware import get_gpu
        from twin.specs.models import get_model

        try:
            (get_gpu if info.field_name == "hardware" else get_model)(v)
        except TwinInputError as e:
            raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _names(self) -> "ShadowSpec":
        if not self.enabled:
            return self
        missing = [k for k in ("hardware", "model") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"shadow.enabled needs {' and '.join(missing)}: name the workers' GPU and model as "
                             "in a scenario (twin/specs/hardware.yaml, models.yaml), e.g. CPU-2core-AVX512, tiny-llama")
        from live.shadow import LOAD_MODELS, make_load_model

        if self.load.name not in LOAD_MODELS:
            raise ValueError(f"@load.name: unknown load model {self.load.name!r} (known: {', '.join(LOAD_MODELS)})")
        try:  # built once now: a parameter it refuses is one line at load, not at the controller's start
            make_load_model(self.load.name, self.load.params)
        except TwinInputError as e:
            raise ValueError(f"@{str(e).removeprefix('shadow.')}") from None
        return self


class LiveConfig(_Spec):
    name: str = "live"
    seed: int = 0
    model: Optional[str] = Field(None, description="the served model name (default: what the workers serve)")
    server: ServerSpec = ServerSpec()
    router: RouterSpec = RouterSpec()
    # the scenario's own predictor section: its guesses fill predicted_output_tokens before the router decides
    predictor: Optional[PredictorSpec] = None
    min_scrape_interval_s: float = Field(0.02, ge=0.001, description=(
        "live floor for router.scrape_interval_s (0 means exact in the twin; live scrapes cannot be)"))
    workers: list[WorkerSpec] = Field(default_factory=list)
    launcher: Optional[LauncherSpec] = None
    health: HealthSpec = HealthSpec()
    tokenizer: TokenizerSpec = TokenizerSpec()
    kv_events: KVEventSpec = KVEventSpec()
    scaler: ScalerSpec = ScalerSpec()
    # the scenario's own online chunk planner (live.chunk_plan): its pick is applied to workers launched after it
    chunk_plan: ChunkPlanSpec = ChunkPlanSpec()
    shadow: ShadowSpec = ShadowSpec()
    base_dir: str = Field(".", exclude=True)

    @model_validator(mode="after")
    def _some_workers(self) -> "LiveConfig":
        if not self.workers and self.launcher is None:
            raise ValueError("give workers (static URLs) or launcher (local vLLM processes), or both")
        ids = self.worker_ids()  # as the controller registers them: a clash there was a traceback at start
        if len(ids) != len(set(ids)):
            raise ValueError(f"workers: ids must be unique ({next(i for i in ids if ids.count(i) > 1)!r} twice; a "
                             "worker without an id is w0, w1, ... by its place in the list)")
        if self.launcher is not None and any(re.fullmatch(r"local-[0-9]+", i) for i in ids):
            raise ValueError("workers: an id local-N is the launcher's name for the workers it starts; choose another")
        eps = [w.kv_events_endpoint for w in self.workers if w.kv_events_endpoint]
        if len(eps) != len(set(eps)):  # one SUB socket binds an endpoint: the second worker's events would be lost
            raise ValueError(f"workers: each kv_events_endpoint must be its own (given twice: "
                             f"{next(e for e in eps if eps.count(e) > 1)})")
        if self.predictor is not None:  # built once now: a bad parameter or model file is one line at load
            from twin.policy.predictors import make_predictor

            p = make_predictor(self.predictor.name, **self.predictor.params)
            if getattr(p, "is_oracle", False) or getattr(p, "needs_truth", False):
                raise ValueError(f"predictor.name: {self.predictor.name} reads the true output length, which the "
                                 "live controller cannot know before the answer ends; use a learning predictor "
                                 "(mean, bucket-quantile, model)")
        slo_given = self.scaler.params.get("slo")
        if isinstance(slo_given, dict) or (slo_given is not None and self.scaler.name in SLO_SCALERS):
            try:
                scaler_slo(slo_given, self.scaler.name == "twin")  # now, not once the controller builds it
            except TwinInputError as e:
                raise ValueError(f"@{e}") from None
        if self.scaler.name == "twin" and not self.shadow.enabled:
            raise ValueError("scaler twin reads the shadow twin's forecasts: set shadow.enabled: true (and "
                             "shadow.hardware, shadow.model)")
        if self.scaler.name == "twin":
            lo = self.scaler.params.get("min_instances")
            if (self.launcher is not None and isinstance(lo, int) and not isinstance(lo, bool)
                    and lo > self.launcher.max_workers):  # the fleet could never reach it: found by a fuzzing pass
                raise ValueError(f"scaler.params.min_instances {lo} is above launcher.max_workers "
                                 f"{self.launcher.max_workers}: the fleet can never have that many")
            if self.scaler.params.get("oracle"):
                raise ValueError("scaler.params.oracle: the live controller cannot see the future; drop oracle")
            slo = self.scaler.params.get("slo") or self.shadow.slo.model_dump(exclude_none=True)
            if not slo:
                raise ValueError("scaler twin chooses the smallest fleet meeting an SLO: give shadow.slo (ttft_s, "
                                 "tpot_s, e2e_s) or scaler.params.slo")
        if self.scaler.name == "threshold" and self.scaler.params.get("threshold_s") is None:
            from twin.policy.scalers import SLO_METRICS

            slo = self.scaler.params.get("slo") or self.shadow.slo.model_dump(exclude_none=True)
            metric = self.scaler.params.get("metric") or next((m for m in SLO_METRICS if m in slo), "e2e_s")
            if metric not in slo:
                raise ValueError(f"scaler threshold without scaler.params.threshold_s takes it from the SLO: give "
                                 f"shadow.slo.{metric} (or scaler.params.threshold_s)")
        if not self.shadow.enabled and _router_needs_forecaster(self.router.name):
            raise ValueError(f"router {self.router.name} looks ahead with the twin (it needs a forecaster): set "
                             "shadow.enabled: true (and shadow.hardware, shadow.model, shadow.perf)")
        cp = self.chunk_plan
        if cp.online:
            if self.launcher is None:
                raise ValueError("chunk_plan.online applies its pick to the workers the launcher starts: configure "
                                 "launcher (workers given by URL run with the arguments they were started with)")
            if cp.apply != "new":
                raise ValueError("chunk_plan.apply: live applies a pick to workers started after it (apply: new); "
                                 "running workers are not restarted")
            missing = [k for k in ("hardware", "model") if getattr(self.shadow, k) is None]
            if missing:
                raise ValueError(f"chunk_plan.online plans with the twin: give shadow.{' and shadow.'.join(missing)} "
                                 "(the workers' GPU and model, as in a scenario) and shadow.perf; shadow.enabled "
                                 "is not needed")
            from twin.policy.chunk import EngineKnobs
            from twin.sim.evaluate import online_chunk_planner

            try:  # a bad candidate list or planner setting is one line now, not at the first plan
                online_chunk_planner(cp, None, EngineKnobs(1))
            except ValueError as e:
                raise ValueError(f"chunk_plan: {e}") from None
        if self.shadow.enabled or cp.online:
            from live.shadow import check_config

            check_config(self)  # builds the twin once: names, engine keys and the perf profile are checked now
        return self

    def worker_ids(self) -> list[str]:
        """Each static worker's id: its own, else w0, w1, ... by its place in the list."""
        return [w.id or f"w{i}" for i, w in enumerate(self.workers)]

    @property
    def scrape_interval_s(self) -> float:
        return max(self.router.scrape_interval_s, self.min_scrape_interval_s)

    def resolve_path(self, p: str) -> Path:
        path = Path(p)
        return path if path.is_absolute() else Path(self.base_dir) / path


SLO_SCALERS = ("twin", "threshold")  # the registered scalers that read `scaler.params.slo` as an SLO


def scaler_slo(value: Any, needs_bound: bool = False) -> Any:
    """`scaler.params.slo` as an SLO: a string, or (twin) no bound, was one every forecast met: the fleet shrank."""
    from twin.policy.scalers import SLO_METRICS

    if not isinstance(value, dict):
        if any(hasattr(value, m) for m in SLO_METRICS):  # an SLO object already (given in code)
            return value
        raise TwinInputError(f"scaler.params.slo: a mapping of {', '.join(SLO_METRICS)} (seconds), got {value!r}")
    try:
        slo = SLOSpec(**value)
    except ValidationError as e:  # pydantic's own text ran to four lines, with a link
        raise TwinInputError("; ".join(_format_error(e, "scaler.params.slo").splitlines())) from None
    if needs_bound and all(getattr(slo, m) is None for m in SLO_METRICS):
        raise TwinInputError(f"scaler.params.slo: sets no bound ({', '.join(SLO_METRICS)}): every forecast would meet "
                             "it, and the twin scaler would shrink the fleet to its minimum")
    return slo


def _router_needs_forecaster(name: str) -> bool:
    from twin.policy.base import resolve_router_class

    try:
        return bool(getattr(resolve_router_class(name), "needs_forecaster", False))
    except (KeyError, LookupError):  # an unknown name gets its own line when the router is built
        return False


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
    raw = apply_overrides(read_yaml_mapping(path, "live config"), overrides or [])
    return parse_config(raw, str(path), path.parent)
