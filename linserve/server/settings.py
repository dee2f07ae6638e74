"""Server settings: environment variables prefixed ``LINSERVE_`` or command-line flags.

``linserve serve --help`` lists every setting; each flag ``--some-name`` is also
``LINSERVE_SOME_NAME`` in the environment. Bad values fail at start-up, not on a request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from linserve.server.speculative.config import SpeculativeConfig
from linserve.server.speculative.config import parse as parse_speculative

ENV_PREFIX = "LINSERVE_"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class Settings(BaseSettings):
    """All server configuration. Defaults serve ``weights/linear`` on 127.0.0.1:8000."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    weights: Path = Field(Path("weights/linear"), description="model folder (config.json, "
                          "model.safetensors, tokenizer.json)")
    model: str = Field("", description="a Hugging Face checkpoint: a folder (config.json, "
                       "safetensors, tokenizer.json), a GGUF file (any shard of a split one), "
                       "or a repo id owner/name (owner/name:FILE.gguf for one GGUF file of "
                       "it), resolved through huggingface_hub's cache (downloaded when online; "
                       "HF_HUB_OFFLINE=1 reads the cache only); overrides --weights")
    served_model_name: str = Field("", description="name served in /v1/models (default: "
                                   "--model as given, else the weights folder's name)")
    model_name: str = Field("", description="the same as --served-model-name (older name)")
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="weight dtype; 'auto' picks bfloat16 where the CPU has native bf16 "
        "dot products (AVX512-BF16 or AMX), float32 otherwise; recurrent states are always "
        "float32 (KV caches: --kv-cache-dtype)")
    quantization: Literal["none", "int8", "int4"] = Field(
        "none", description="quantization of every projection, MLP and output-head weight at "
        "load time: int8 (per output channel) or int4 (groups of 32, fp16 scales, as "
        "llama.cpp's Q4_0), multiplied as integer dot products with the GEMM's input rounded "
        "to int8 per block of 32 (as llama.cpp's Q8_0); embeddings, norms and states stay as "
        "they are (KV caches: --kv-cache-dtype)")
    kv_cache_dtype: Literal["auto", "fp32", "bf16", "int8"] = Field(
        "auto", description="what attention layers' KV caches hold, as llama.cpp's -ctk / -ctv: "
        "fp32; bf16 (half the bytes); int8 with an fp32 scale per block of 32 values (about "
        "0.28 of fp32's bytes, as llama.cpp's q8_0); attention runs in fp32 on what was "
        "stored. 'auto': bf16 where the weights are quantized (a GGUF file's quantized "
        "types, --quantization), fp32 otherwise. Recurrent states stay fp32")
    threads: int = Field(0, ge=0, description="torch threads for the engine (0: auto)")
    initial_state: str = Field(
        "", description="a state file every request without a session starts from (RWKV's "
        "state-tuned .pth: blocks.N.att.time_state per layer); its digest joins the model's "
        "fingerprint, so states and shared prefixes made from it stay apart")
    state_dir: str = Field(
        "", description="a folder of state files (RWKV's state-tuned .pth), each a named "
        "initial state a request picks with \"state\": \"NAME\" (the file's stem), as ai00 "
        "serves them; GET /v1/states lists them")
    chat_template: str = Field("", description="a Jinja chat template file that replaces the "
                               "checkpoint's own")
    tool_call_parser: Literal["", "qwen3_xml", "qwen3_coder", "hermes", "lfm2", "pythonic",
                              "nemotron"] = Field(
        "", description="how tool calls are read from the output (vLLM's names; default: "
        "from the template: qwen3_xml for <function=…> calls, lfm2 for LFM2's Python calls, "
        "nemotron for <TOOLCALL> arrays, else hermes)")
    reasoning_parser: Literal["", "qwen3", "deepseek_r1"] = Field(
        "", description="put <think>…</think> text in reasoning_content (vLLM's names)")
    fused_step: bool = Field(
        True, description="decode with the native fused step (elu+1 and softmax models; "
        "compiled once, or LINSERVE_KERNEL_LIB); the eager step is used where it is "
        "unavailable")
    batch_invariant: bool = Field(
        True, description="batch-invariant kernels: a request's logits do not depend on the "
        "requests batched with it, so a seeded request gives the same text alone and under "
        "load on any CPU (--no-batch-invariant: ATen's GEMMs, faster for bf16 at large "
        "batches; greedy identical, seeded best-effort)")
    engine_mode: Literal["process", "thread"] = Field(
        "process", description="run the engine in its own process (no GIL contention with "
        "HTTP) or as a thread of the server process")
    engine_stall_seconds: float = Field(
        10.0, gt=0, description="an engine that makes no progress for this long (its thread "
        "neither finishes an iteration nor computes: stopped, deadlocked or blocked) is "
        "declared stuck and restarted; a long step that computes never trips it")
    engine_max_restarts: int = Field(
        5, ge=0, description="restarts allowed within engine_restart_window; past that the "
        "supervisor gives up and /health/live answers 503")
    engine_restart_window: float = Field(300.0, gt=0, description="seconds; see "
                                         "engine_max_restarts")
    fault_injection: bool = Field(
        False, description="TESTING ONLY: honour the request field linserve_fault "
        "(submit|prefill|first_token|decode) to make the engine fail that request")
    session_store: str = Field("memory", description="'memory' or redis://HOST:PORT/DB")
    session_ttl: float = Field(3600.0, gt=0, description="seconds an idle session is kept")
    session_lock_seconds: float = Field(
        10.0, gt=0, description="Redis busy-lock lifetime (renewed while a request runs)")
    malloc_mmap_threshold: int = Field(
        65536, ge=0, description="glibc mmap threshold of the HTTP process, so that freed "
        "session buffers go back to the system (0: malloc defaults); see "
        "linserve/server/system/malloc.py")
    session_memory_bytes: int = Field(
        8 * 2**30, gt=0, description="byte budget of the in-memory session store (LRU)")
    max_running: int = Field(64, ge=1, le=1024, description="sequences decoded together")
    max_waiting: int = Field(256, ge=0, description="queued requests before 429")
    max_memory: int = Field(
        0, ge=0, description="bytes the engine may use for weights, session states, KV caches "
        "and the prefix cache; requests whose KV cache would not fit wait in the queue (then "
        "429), and one that could never fit is refused (400). 0: four fifths of the memory "
        "available at start (the cgroup limit, else MemAvailable)")
    max_prompt_tokens: int = Field(32768, ge=1, description="longest prompt accepted")
    max_tokens_limit: int = Field(8192, ge=1, description="largest max_tokens accepted")
    max_body_bytes: int = Field(32 << 20, ge=1024, description="largest JSON request body "
                                "(images sent inline as data: URLs count)")
    limit_mm_per_prompt: str = Field(
        "", description='items other than text a prompt may hold, by kind, as JSON (vLLM\'s '
        'flag): {"image": N}, default 8; {"image": 0} does not load a vision tower at all, '
        "so a vision-language checkpoint serves text only and its tower takes no memory")
    mm_processor_kwargs: str = Field(
        "", description='the image processor\'s limits, as JSON (vLLM\'s flag): '
        '{"min_pixels": N, "max_pixels": N} replace the checkpoint\'s '
        "preprocessor_config.json (fewer pixels, fewer tokens an image)")
    mmproj: str = Field(
        "", description="a GGUF model's vision tower: llama.cpp's mmproj file, as llama-server "
        "takes it (clip.* keys, v.* / mm.* tensors; Qwen3.5's qwen3vl_merger)")
    allowed_media_domains: str = Field(
        "", description="comma-separated hosts whose http(s) image URLs are fetched (vLLM's "
        "flag; empty: none are; data: URLs are always read)")
    allowed_local_media_path: str = Field(
        "", description="a folder whose files file:// image URLs may read (vLLM's flag; "
        "empty: none)")
    media_fetch_timeout: float = Field(
        10.0, gt=0, description="seconds an image URL may take to fetch")
    media_max_bytes: int = Field(
        20 << 20, ge=1024, description="largest image accepted, as sent or fetched (bytes)")
    prefill_chunk: int = Field(512, ge=16, description="prompt tokens per prefill chunk")
    step_token_budget: int = Field(
        512, ge=1, description="prompt tokens prefilled per engine iteration")
    prefix_cache_bytes: int = Field(
        -1, ge=-1, description="byte budget of the automatic prefix-state cache for "
        "requests without a session_id (LRU; 0 turns it off). -1: a thirty-second of "
        "--max-memory, from 64 MiB to 4 GiB (536 MiB of 18 GB)")
    next_turn_cache: bool = Field(
        True, description="after a stateless chat reply with a checkpoint's template, "
        "prefill the conversation as the template renders it for the next turn into the "
        "prefix cache, so a client that resends the whole conversation prefills only its "
        "new messages")
    prefix_cache_interval: int = Field(
        1024, ge=0, description="also keep a prefix state every this many tokens inside a "
        "long prefill, so a prompt that diverges inside it resumes nearby (0: off)")
    prefix_cache_redis_ttl: float = Field(
        600.0, gt=0, description="with a Redis session store, prefix states are also "
        "published to Redis for the other replicas, kept this many seconds")
    prefix_cache_redis_max_entry_bytes: int = Field(
        4 << 20, ge=0, description="largest prefix state published to Redis (a softmax KV "
        "prefix grows 8 KiB a token; a linear state is 296 KiB)")
    api_keys: str = Field("", description="comma-separated Bearer keys (empty: open server)")
    api_keys_file: Path | None = Field(None, description="file with one API key per line")
    cors_origins: str = Field("", description="comma-separated allowed CORS origins")
    keepalive_seconds: float = Field(10.0, gt=0, description="SSE keep-alive comment interval")
    shutdown_grace_seconds: float = Field(
        15.0, ge=0, description="time in-flight streams get to finish on shutdown")
    speculative_config: str = Field(
        "", description='speculative decoding, as JSON with vLLM\'s keys: {"method": "ngram", '
        '"num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M} (drafts '
        'from the request\'s own text) or {"method": "draft_model", "model": PATH_OR_ID, '
        '"num_speculative_tokens": K} (a smaller checkpoint with the same tokenizer); '
        '"max_batch" (default 4): speculate only while at most this many requests decode. '
        "Output is unchanged: greedy text is the same, sampled text keeps its distribution "
        "(a seeded request samples the same tokens)")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("session_store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        if value != "memory" and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("session_store must be 'memory' or a redis:// URL")
        return value

    @field_validator("speculative_config")
    @classmethod
    def _check_speculative(cls, value: str) -> str:
        parse_speculative(value)  # raises one line for a bad config
        return value

    @field_validator("limit_mm_per_prompt", "mm_processor_kwargs")
    @classmethod
    def _check_json_ints(cls, value: str) -> str:
        json_ints(value)  # raises one line for one that is not a JSON object of integers
        return value

    @property
    def image_limit(self) -> int:
        """Images a prompt may hold (``--limit-mm-per-prompt``; 0: the tower not loaded)."""
        return json_ints(self.limit_mm_per_prompt).get("image", DEFAULT_IMAGES)

    @property
    def processor_limits(self) -> dict[str, int]:
        return json_ints(self.mm_processor_kwargs)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed (None: off)."""
        return parse_speculative(self.speculative_config)

    @field_validator("weights")
    @classmethod
    def _find_weights(cls, value: Path) -> Path:
        """A relative folder is looked up from the working directory, then from the project
        root (so the default works from anywhere in a checkout); a missing one fails here,
        with the setting's name, not later with a raw FileNotFoundError."""
        candidates = [value] if value.is_absolute() else [value, PROJECT_ROOT / value]
        for path in candidates:
            if (path / "config.json").is_file():
                return path
        raise ValueError(f"no model folder (config.json) at {value}; give --weights PATH "
                         f"or {ENV_PREFIX}WEIGHTS")

    def keys(self) -> set[str]:
        """The configured API keys (from ``api_keys`` and ``api_keys_file``)."""
        keys = {k.strip() for k in self.api_keys.split(",") if k.strip()}
        if self.api_keys_file is not None:
            keys |= {line.strip() for line in self.api_keys_file.read_text().splitlines()
                     if line.strip() and not line.startswith("#")}
        return keys

    @property
    def served_name(self) -> str:
        return (self.served_model_name or self.model_name or self.model
                or self.weights.resolve().name)


DEFAULT_IMAGES = 8  # images a prompt may hold, unless --limit-mm-per-prompt says


def json_ints(value: str) -> dict[str, int]:
    """A flag's JSON object of non-negative integers ({} for empty); ValueError otherwise."""
    if not value.strip():
        return {}
    try:
        parsed = json.loads(value)
    except ValueError:
        raise ValueError(f"{value!r} is not JSON") from None
    if not isinstance(parsed, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in parsed.values()):
        raise ValueError(f"{value!r} must be a JSON object of non-negative integers")
    return {str(k): int(v) for k, v in parsed.items()}


def parse_cli(argv: list[str] | None = None) -> Settings:
    """Settings from flags, then environment, then defaults; ``--help`` lists them all."""
    from pydantic_settings import CliSettingsSource

    class CliSettings(Settings):
        model_config = SettingsConfigDict(
            env_prefix=ENV_PREFIX, extra="ignore", cli_kebab_case=True,
            cli_prog_name="linserve serve", cli_implicit_flags=True)

    source: CliSettingsSource[CliSettings] = CliSettingsSource(
        CliSettings, cli_parse_args=argv if argv is not None else True)
    return Settings(**CliSettings(_cli_settings_source=source).model_dump())  # type: ignore[call-arg]
