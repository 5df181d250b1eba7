"""The settings schema: one pydantic model per ``[section]``, and ``Settings`` holding them all.

Plugins' own tables (``[plugins.NAME]``) and tier entries (``[[kv_cache.tiers]]``)
are kept raw here and validated by the models their plugins registered, by
``load_settings`` or on first access through ``Settings.plugin_options``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tierserve.core.tables import validate_table
from tierserve.core.tier_settings import FLAT_TIER_KEYS, TierSettings, apply_shorthands, unique_names

M = TypeVar("M", bound=BaseModel)
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerSettings(Section):
    """[server]: where and how the HTTP server listens."""

    host: str = Field("127.0.0.1", description="the address to listen on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="the TCP port to listen on")
    max_request_bytes: int = Field(
        10 * 1024 * 1024, gt=0, description="bytes of one request body at most; more is a 413 before it is parsed"
    )
    max_prompt_bytes: int = Field(
        1024 * 1024,
        gt=0,
        description="UTF-8 bytes of prompt text (a completion's prompts, a chat's messages, embedding inputs) "
        "one request may carry; more is a 400 before anything is tokenized",
    )
    max_tokens_limit: int = Field(
        32768,
        gt=0,
        description="the most tokens one choice may generate, on every route, sliding window or not: a larger "
        "max_tokens (or max_completion_tokens) is a 400, and a request that names none gets at most this many",
    )
    max_stream_backlog: int = Field(
        1024,
        gt=0,
        description="outputs (about one per engine step) a request's reader may leave unread; a stream whose "
        "client stops reading is aborted past it and its blocks freed",
    )
    shutdown_grace_seconds: float = Field(
        30.0, ge=0, description="at shutdown, requests in flight get this long to finish before they are cancelled"
    )
    header_timeout_seconds: float = Field(
        10.0, gt=0, description="a client must send a request's headers within this (slow clients are disconnected)"
    )
    body_timeout_seconds: float = Field(
        60.0, gt=0, description="...and its body within this, from the end of its headers"
    )
    max_connections: int = Field(
        1024, ge=2, description="open connections at most; past it requests are answered 503 (uvicorn's "
        "limit_concurrency, which counts the connection asking)"
    )
    rate_limit_per_minute: int | None = Field(None, gt=0, description="requests per minute per API key (or client address)")
    public_health: bool = Field(True, description="/health and its probes without an API key")
    public_metrics: bool | None = Field(
        None, description="/metrics without an API key; unset: public while no API key is configured, private once "
        "one is (Prometheus then sends a key: bearer_token in its scrape config)"
    )
    retry_after_seconds: int = Field(1, ge=1, description="Retry-After sent with 503 when the queue is full")
    responses_max_stored: int = Field(
        1024, ge=0, description="/v1/responses kept for GET and previous_response_id (store: true); over it, the "
        "oldest response of the tenant holding the most goes first"
    )
    responses_max_bytes: int = Field(
        64 * 2**20, ge=0, description="bytes the stored /v1/responses may take in all (each as stored, JSON); over "
        "it, the oldest response of the tenant holding the most bytes goes first"
    )
    responses_ttl_seconds: float | None = Field(
        3600.0, gt=0, description="how long a stored /v1/responses response is kept; unset: until pushed out"
    )
    timeout_seconds: float | None = Field(
        600.0,
        gt=0,
        description="a generation request still running after this many seconds (queue wait included) is "
        "aborted, its blocks freed, and answered 504 (a stream ends with an error event); unset: no limit",
    )
    engine_process: bool = Field(
        True,
        description="run the engine core in a child process (tokenizing, detokenizing and HTTP stay in the server "
        "process); false: on a thread of the server process",
    )
    engine_max_restarts: int = Field(
        5,
        ge=0,
        description="with engine_process, how many times in a row the engine core process is started again after "
        "it dies (killed, crashed); past it the server stays unhealthy until restarted by hand. A core that ran "
        "for 5 minutes starts the count afresh; 0: never restarted",
    )
    engine_restart_backoff_seconds: float = Field(
        1.0,
        gt=0,
        description="the wait before the first restart of a dead engine core process; each further restart in a "
        "row waits twice as long, at most 60 s (or this, if longer)",
    )


class ModelSettings(Section):
    """[model]: which checkpoint, which backend, on which device."""

    path: str = Field(
        "builtin:tiny",
        description="a Hugging Face checkpoint directory, a .gguf file (or its directory with gguf_file), "
        "or builtin:NAME",
    )
    gguf_file: str | None = Field(
        None,
        description="the GGUF file to load from the directory model.path names (a file name in it, as "
        "transformers' gguf_file); unset: model.path is a checkpoint directory or a .gguf file itself",
    )
    served_model_name: str | list[str] | None = Field(
        None,
        description="the names clients may send as 'model' (one or a list, as vLLM's --served-model-name); "
        "the first is the one responses carry by default; unset: model.path",
    )
    accepted_names: list[str] = Field(
        default_factory=list,
        description="more names clients may send as 'model' for this model, answered as its own and not listed in "
        "/v1/models (the presets accept the serving spec's example names, 'default-model' and 'advanced-model'); "
        "the single [model] only: a [[models]] entry has aliases",
    )
    backend: str = Field(
        "auto",
        description="auto: native for Llama/Mistral/Qwen2/Qwen3 (fastest), else transformers (any architecture "
        "whose attention goes through transformers' AttentionInterface, on the paged arena), else "
        "transformers-unpaged (no prefix cache); or name one",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the weights' dtype: auto = float32 on a CPU, bfloat16 on a GPU"
    )
    quantization: Literal[
        "none", "int8", "gguf", "q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m"
    ] = Field(
        "none",
        description="int8: every weight matrix stored as int8 with one scale per output row, computed at load "
        "(about 1 byte per weight; the native backend's fastest int8 kernel here runs it); gguf (a GGUF file on "
        "the native backend): Q4_0, Q4_1, Q4_K, Q6_K and Q8_0 tensors kept as the file stores them (0.56-1.1 "
        "bytes per weight, tierserve's q4, q6k and q8 kernels), any other type as int8 does; q4_0, q4_1, q8_0 (a "
        "Hugging Face directory on the native backend): every weight matrix rounded at load to that GGUF block "
        "type by llama.cpp's reference quantizer, then run as a GGUF file of that type is; q4_k, q5_k, q6_k the same "
        "in K super-blocks, q4_k_m and q5_k_m in llama-quantize's mixes of them (the head, v and down in Q6_K "
        "where it puts them; a width that is not whole super-blocks of 256 falls back to Q5_0, Q5_1 or Q8_0)",
    )
    device: str = Field("auto", description="cpu, cuda, cuda:N; auto: a GPU where torch sees one, else the CPU")
    max_model_len: int | None = Field(
        None, gt=0, description="the context length served (prompt + output); unset: all the checkpoint has"
    )
    seed: int = Field(
        0,
        description="seeds the random draws of requests that bring no seed: an engine started with the same "
        "seed samples the same outputs for the same requests in the same order",
    )
    max_loras: int = Field(
        0,
        ge=0,
        le=64,
        description="LoRA adapter slots kept resident (as vLLM's --max-loras); 0: LoRA off, no memory reserved. "
        "Requests with different adapters, and with none, decode in one batch (native backend)",
    )
    max_lora_rank: int = Field(16, gt=0, le=512, description="the highest adapter rank a slot holds (vLLM's --max-lora-rank)")
    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="adapters loaded at start-up, name -> PEFT adapter directory; a request names one in 'model'",
    )

    @field_validator("served_model_name")
    @classmethod
    def _names(cls, value: str | list[str] | None) -> str | list[str] | None:
        names = [value] if isinstance(value, str) else (value or [])
        if isinstance(value, list) and not value:
            raise ValueError("give at least one name, or leave it unset")
        if any(not name.strip() for name in names):
            raise ValueError("a served model name must not be empty")
        if len(set(names)) != len(names):
            raise ValueError(f"names must be unique, got {names}")
        return value

    @model_validator(mode="after")
    def _lora_slots(self) -> ModelSettings:
        if len(self.lora_adapters) > self.max_loras:
            raise ValueError(
                f"lora_adapters names {len(self.lora_adapters)} adapters and max_loras is {self.max_loras}; "
                "raise model.max_loras to at least the number of adapters"
            )
        if any(not name.strip() or "@" in name for name in self.lora_adapters):
            raise ValueError("lora_adapters: an adapter name must not be empty or contain '@'")
        return self

    @property
    def model_names(self) -> list[str]:
        """The served names, first the default one (empty when unset: the model path serves)."""
        value = self.served_model_name
        return [value] if isinstance(value, str) else list(value or [])

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        kind = value.split(":", 1)[0]
        if kind not in {"auto", "cpu", "cuda", "mps"}:
            raise ValueError("must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")
        return value


MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


class ModelEntry(ModelSettings):
    """One ``[[models]]`` table (or a ``POST /v1/models`` body): a model version served next to others.

    Its ``id`` is ``name@version``; ``name`` alone and each of ``aliases`` are aliases that point at
    one version (the first one loaded under that name) until switched. The [model] keys set how it loads;
    ``kv_share`` is its part of ``[kv_cache] l1_capacity`` (the live KV pool), ``scheduler`` overrides
    ``[scheduler]`` keys for it alone.
    """

    name: str = Field(description="the model's name; requests send it, or name@version, or an alias, as 'model'")
    version: str = Field("1", description="the version; name@version always names this one")
    aliases: list[str] = Field(default_factory=list, description="more names that point at this version")
    kv_share: float | None = Field(
        None, gt=0, le=1, description="its share of kv_cache.l1_capacity; unset: an equal share of the [[models]]"
    )
    scheduler: dict[str, Any] = Field(
        default_factory=dict, description="[scheduler] keys for this model alone (max_num_seqs, max_num_batched_tokens, ...)"
    )

    @field_validator("name", "version")
    @classmethod
    def _plain(cls, value: str) -> str:
        if not MODEL_NAME.fullmatch(value):
            raise ValueError("use 1-128 letters, digits and . _ : / - (no '@', no spaces)")
        return value

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, value: list[str]) -> list[str]:
        for alias in value:
            if not MODEL_NAME.fullmatch(alias):
                raise ValueError(f"alias {alias!r}: use 1-128 letters, digits and . _ : / - (no '@', no spaces)")
        return value

    @field_validator("scheduler")
    @classmethod
    def _scheduler(cls, value: dict[str, Any]) -> dict[str, Any]:
        SchedulerSettings(**value)  # unknown keys and bad values fail here, named
        return value

    @model_validator(mode="after")
    def _no_served_names(self) -> ModelEntry:
        if self.served_model_name is not None:
            raise ValueError("served_model_name: a [[models]] entry names itself with name and aliases")
        if self.accepted_names:
            raise ValueError("accepted_names: a [[models]] entry names itself with name and aliases")
        return self

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"


class RegistrySettings(Section):
    """[registry]: how many models one server keeps loaded (``[[models]]``, ``POST /v1/models``)."""

    max_loaded_models: int = Field(4, gt=0, description="models (versions) loaded at once; a load past it is refused")
    memory_budget_bytes: int | None = Field(
        None,
        gt=0,
        description="the most memory the loaded models' weights and KV pools may take together (estimated from "
        "each checkpoint and its KV pool); a load past it is refused; unset: no bound",
    )
    unload_idle: bool = Field(
        False,
        description="instead of refusing a load past max_loaded_models or memory_budget_bytes, unload the least "
        "recently used idle versions; their names keep answering and load them again on the next request "
        "(as Ollama's keep-alive does)",
    )
    warm_prompts_on_switch: int = Field(
        16, ge=0, description="an alias switch with warm=true replays the old version's this many most used prompts"
    )


class SchedulerSettings(Section):
    """[scheduler]: batching budgets and queue bounds."""

    name: str = Field("fcfs", description="the scheduler plugin: fcfs (first come, first served), priority, or an installed one")
    max_num_seqs: int = Field(64, gt=0, description="sequences one step runs at most (the decode batch)")
    max_num_batched_tokens: int = Field(
        2048, gt=0, description="tokens one step computes at most (prefill chunks and decodes together)"
    )
    max_waiting_requests: int = Field(
        512, gt=0, description="requests queued for a slot at most; past it a request is answered 503 with Retry-After"
    )
    prefill_group_tokens: int = Field(
        0,
        ge=0,
        description="new prompts share a step only while their tokens together stay within this many (the uncached "
        "tokens of those admitted this step plus the next one's whole prompt; the first always runs): a burst of "
        "prompts is prefilled one group a step, so the first get their first token sooner; 0 = no limit but "
        "max_num_batched_tokens",
    )
    decode_steps_between_prefills: int = Field(
        0,
        ge=0,
        description="after a step that started new prompts, this many steps start none while sequences are "
        "decoding (those steps run the decodes, and any prompt already part-way through its prefill): a decoding "
        "sequence never waits behind two prefill steps in a row, and chat clients that send their next turn as "
        "the last one ends stop queuing behind each other's prefill; 0 = prompts start in any step with room",
    )


class KVCacheSettings(Section):
    """[kv_cache]: the L1 block pool and the ordered tiers below it (``[[kv_cache.tiers]]``).

    ``tiers`` unset: one memory tier, ``l2``. The flat shorthands (``l2_capacity``,
    ``max_memory_bytes``, ``disk_path``, ``persistence``, ``max_disk_bytes``) are
    written into the list, as ``tier_settings.apply_shorthands`` says; they are not
    fields of their own.
    """

    block_size: int = Field(16, gt=0, description="tokens per KV block: the unit of caching, sharing and eviction")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="how L1 holds keys and values (and so what L2/L3 store): auto = the model's dtype; "
        "bfloat16 with float32 weights halves the KV bytes",
    )
    l1_capacity: int = Field(5000, gt=0, description="blocks in the L1 pool")
    l1_max_bytes: int | None = Field(None, gt=0, description="size L1 by bytes instead (overrides l1_capacity)")
    l1_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="the most of the memory free once the weights are loaded (the GPU's, or the host's on a CPU) "
        "that the L1 pool may take; a larger l1_capacity is lowered, with a logged reason (kv_l1_sized_down); "
        "unset: 0.9 on a GPU, 0.5 on a CPU",
    )
    eviction_policy: str = Field("adaptive", description="L1's policy, and every tier's unless the tier sets one")
    ttl_seconds: float | None = Field(3600, ge=0, description="0 or unset: entries never expire; tiers may override")
    tiers: list[TierSettings] = Field(
        default_factory=list, description="the tiers below L1, in order (unset: one memory tier, l2)"
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse cached KV blocks of a prompt's longest cached prefix; false: no cache and no tiers"
    )
    reuse_partial_blocks: bool = Field(
        True,
        description="a prompt whose whole cached blocks end inside a block L1 holds (the same prefix, then some "
        "of the prompt's next tokens: a chat's last turn ended there) copies that block's start instead of "
        "recomputing it; false: reuse whole blocks only",
    )
    warm_prompts: list[str] = Field(
        default_factory=list, description="prompts computed into the cache at start-up, so their first request hits"
    )
    warm_prompts_file: str | None = Field(None, description="a text file of more start-up prompts, one a line")
    warm_frequent_blocks: int = Field(
        256, gt=0, description="blocks POST /v1/cache/warm with no prompts promotes at most (most used prefixes first)"
    )
    warm_write_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="a prompt warm waits this long at most, in all, for room in full tier write queues and for "
        "its writes to be stored (other requests' decoding pauses while it waits); writes still queued then are "
        "reported pending",
    )
    cache_keys_max: int = Field(1024, gt=0, description="named prefixes (request cache_key) kept; the least recently used goes first")
    cache_key_ttl_seconds: float | None = Field(
        3600, ge=0, description="a cache_key unused this long is unpinned and forgotten; 0 or unset: never"
    )
    cache_keys_max_pinned_bytes: int | None = Field(
        None, gt=0, description="bytes of KV that cache keys pin at most; unset: a quarter of L1"
    )

    @model_validator(mode="before")
    @classmethod
    def _fold_shorthands(cls, data: Any) -> Any:
        # load_settings folds them first, recording sources; this covers settings built directly
        if isinstance(data, Mapping) and ("tiers" not in data or FLAT_TIER_KEYS & data.keys()):
            return apply_shorthands(data, lambda key: "the Settings object").table
        return data

    @field_validator("tiers", mode="before")
    @classmethod
    def _tier_defaults(cls, value: Any, info: ValidationInfo) -> Any:
        # eviction_policy and ttl_seconds are declared above tiers, so info.data holds them
        if not isinstance(value, list):
            return value
        filled = []
        for item in value:
            if isinstance(item, Mapping):
                item = dict(item)
                if item.get("eviction_policy") is None:
                    item["eviction_policy"] = info.data.get("eviction_policy")
                item.setdefault("ttl_seconds", info.data.get("ttl_seconds"))
            filled.append(item)
        return filled

    @field_validator("tiers")
    @classmethod
    def _unique_tier_names(cls, value: list[TierSettings]) -> list[TierSettings]:
        return unique_names(value)


class SpeculativeSettings(Section):
    """[speculative]: speculative decoding and beam search defaults."""

    method: str | None = Field(
        None, description="the speculator: ngram, draft_model, ngram_tree, medusa or an installed one; unset: none"
    )
    num_speculative_tokens: int = Field(4, ge=1, le=64, description="draft tokens proposed per step at most (k)")
    adaptive: bool = Field(
        True, description="shrink k when drafts are rejected and grow it back when they are accepted; false: always k"
    )
    max_tree_nodes: int = Field(
        16, ge=1, le=128,
        description="tree speculators (ngram_tree, medusa): the most nodes of one sequence's token tree",
    )
    step_tree_nodes: int = Field(
        64, ge=1, le=4096,
        description="tree speculators: the tree nodes one step verifies, shared among its sequences "
        "(each gets min(max_tree_nodes, step_tree_nodes // sequences), at least 1): a big batch gets smaller "
        "trees; at most half of scheduler.max_num_batched_tokens is used, so real tokens keep the rest",
    )
    beam_width: int = Field(4, ge=1, le=16, description="beams of use_beam_search when a request names no beam_width")
    temperature: float = Field(0.8, ge=0, description="the temperature of a /v1/cached/* request that names none (0: greedy)")
    top_k: int = Field(40, ge=-1, description="...its top_k (0 or -1: off)")
    top_p: float = Field(0.9, gt=0, le=1, description="...its top_p")


class SlidingWindowSettings(Section):
    """[sliding_window]: bounded-memory generation past the KV budget."""

    enabled: bool = Field(
        False, description="streaming mode for every request: sink tokens plus the last window_size tokens are kept"
    )
    allow_per_request: bool = Field(
        True,
        description="requests may turn streaming mode on (enable_sliding_window: true on /v1/cached/*, with "
        "their own window_size of 64-1024 tokens if they like) while enabled is false; false: that flag is a "
        "400 unless enabled is true",
    )
    window_size: int = Field(
        512, gt=0, description="tokens of recent context kept in streaming mode (a request may name its own, 64-1024)"
    )
    window_overlap: int = Field(
        64, ge=0, description="tokens the window may run past window_size before old blocks are released in one go"
    )
    sink_tokens: int = Field(4, ge=0, description="first tokens kept for good in streaming mode (attention sinks)")
    use_flash_attention: bool = Field(
        True, description="let torch pick its fused attention kernel; false: the math kernel (another cache fingerprint)"
    )

    @model_validator(mode="after")
    def _overlap_fits(self) -> SlidingWindowSettings:
        if self.window_overlap >= self.window_size:
            raise ValueError(
                f"window_overlap ({self.window_overlap}) must be smaller than window_size ({self.window_size})"
            )
        return self


class MonitoringSettings(Section):
    """[monitoring]: metrics collection."""

    enabled: bool = Field(True, description="sample the statistics for /v1/cache/stats trends and alerts")
    collection_interval_seconds: float = Field(30, gt=0, description="seconds between two samples")
    detailed_profiling: bool = Field(
        False, description="time each phase of every engine step (schedule, lookup, forward, sample) in /v1/cache/stats"
    )
    prometheus: bool = Field(True, description="serve /metrics; false: it is a 404")
    trend_samples: int = Field(120, gt=0, description="samples kept for /v1/cache/stats trends")
    alert_hit_rate_below: float | None = Field(None, ge=0, le=1, description="alert when the hit rate is below this; unset: never")
    alert_memory_bytes_above: int | None = Field(
        None, gt=0, description="alert when the cache holds more bytes than this; unset: never"
    )
    alert_dropped_writes_above: int | None = Field(
        0, ge=0, description="alert when more tier writes than this were dropped; unset: never"
    )
    alert_queue_fraction_above: float | None = Field(
        0.9, gt=0, le=1, description="alert when the waiting queue is fuller than this fraction; unset: never"
    )


class PluginSettings(Section):
    """[plugins]: which installed plugins load (``TIERSERVE_PLUGINS`` overrides), and one
    ``[plugins.NAME]`` table per component that declares settings (kept raw here)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    enabled: list[str] | None = None

    @model_validator(mode="after")
    def _tables_are_tables(self) -> PluginSettings:
        for name, table in (self.model_extra or {}).items():
            if not isinstance(table, Mapping):
                raise ValueError(f"plugins.{name} must be a table of keys ([plugins.{name}]), got {table!r}")
        return self

    def table(self, name: str) -> dict[str, Any]:
        """The raw ``[plugins.NAME]`` table (empty if not given)."""
        return dict((self.model_extra or {}).get(name.strip().lower(), {}))


class AuthSettings(Section):
    """[auth]: API keys; with none configured the API is open."""

    api_keys: list[str] = Field(
        default_factory=list, description="keys a request must bring (Authorization: Bearer KEY); each is a tenant of its own"
    )
    admin_api_keys: list[str] = Field(
        default_factory=list, description="keys that may manage caches, models and adapters; with api_keys and none of these, admin routes are refused"
    )
    tenants: dict[str, list[str]] = Field(
        default_factory=dict,
        description="tenant name -> its API keys: keys of one tenant share cached prefixes, cache keys and "
        "statistics; any key not listed is a tenant of its own",
    )
    shared_cache_keys: list[str] = Field(
        default_factory=list, description="API keys that share one cache namespace (the tenant 'shared')"
    )
    public_stats: bool = Field(
        False, description="every key reads the global /v1/cache/stats; false: only admin keys, others see their tenant's"
    )

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, keys in value.items():
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(f"tenant name {name!r}: use 1-64 letters, digits, '.', '_' or '-'")
            if not keys:
                raise ValueError(f"tenant {name!r} lists no API keys")
        return value


class LoggingSettings(Section):
    """[logging]: structlog output."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="the lowest level logged")
    format: Literal["console", "json"] = Field("console", description="one line of text, or one JSON object, per event")


class FleetSettings(Section):
    """[fleet]: ``tierserve fleet``, engine replicas as a Ray Serve application behind one ingress."""

    replicas: int = Field(2, ge=1, description="engine replicas when autoscaling is off")
    autoscaling: bool = Field(False, description="let Ray Serve add and remove replicas by ongoing requests")
    min_replicas: int = Field(1, ge=0, description="autoscaling's lower bound")
    max_replicas: int = Field(2, ge=1, description="autoscaling's upper bound")
    target_ongoing_requests: float = Field(
        4.0, gt=0, description="autoscaling adds a replica when requests per replica stay above this"
    )
    upscale_delay_seconds: float = Field(10.0, ge=0, description="how long load stays above target before a replica is added")
    downscale_delay_seconds: float = Field(300.0, ge=0, description="how long load stays below target before one is removed")
    load_window_seconds: float = Field(30.0, gt=0, description="ongoing requests are averaged over this window (reported a few times per window)")
    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves for each engine replica")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each engine replica")
    max_replicas_per_node: int | None = Field(
        None, ge=1, description="engine (and prefill) replicas Ray places on one node at most, so losing a node loses "
        "at most this many (Ray Serve's max_replicas_per_node); unset: as many as the node's resources hold",
    )
    routing: Literal["kv_events", "cache_aware", "power_of_two"] = Field(
        "cache_aware",
        description="kv_events: the replica whose cache holds the longest prefix of the request's blocks, as the "
        "replicas' published block events say, weighed against load, free KV blocks and TTFT; cache_aware: the "
        "replica this router last sent the longest prefix (or the cache_key) to; power_of_two: Ray's default",
    )
    max_imbalance: int = Field(
        8,
        ge=0,
        description="the replica holding a request's prefix keeps it while it has at most this many more ongoing "
        "requests than the least loaded replica; beyond, the least loaded takes it",
    )
    prefill_replicas: int = Field(
        0,
        ge=0,
        description="replicas that only prefill prompts into the shared tier, for the others to decode from; "
        "0: every replica does both",
    )

    @model_validator(mode="after")
    def _bounds(self) -> FleetSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        return self


class Settings(BaseSettings):
    """All of tierserve's settings, one section per concern."""

    # the environment's spelling, read by pydantic-settings' EnvSettingsSource in layers.py
    model_config = SettingsConfigDict(
        extra="forbid", validate_assignment=True, env_prefix="TIERSERVE_", env_nested_delimiter="__"
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    kv_cache: KVCacheSettings = Field(default_factory=KVCacheSettings)
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)
    sliding_window: SlidingWindowSettings = Field(default_factory=SlidingWindowSettings)
    monitoring: MonitoringSettings = Field(default_factory=MonitoringSettings)
    plugins: PluginSettings = Field(default_factory=PluginSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    models: list[ModelEntry] = Field(
        default_factory=list, description="[[models]]: several models and versions in one server (unset: [model] alone)"
    )

    @field_validator("models")
    @classmethod
    def _distinct_models(cls, value: list[ModelEntry]) -> list[ModelEntry]:
        ids = [entry.id for entry in value]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"each name@version may appear once; repeated: {', '.join(repeated)}")
        owner: dict[str, str] = {}
        for entry in value:
            for alias in entry.aliases:
                if alias in owner and owner[alias] != entry.id:
                    raise ValueError(f"alias {alias!r} points at both {owner[alias]} and {entry.id}; give it to one")
                owner[alias] = entry.id
        return value

    _plugin_options: dict[str, BaseModel] = PrivateAttr(default_factory=dict)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, *args, **kwargs):
        # Built directly (tests, the engine's own process), settings hold what they are given and
        # never the process's TIERSERVE_* variables; load_settings reads each source as one layer,
        # through pydantic-settings' TOML and environment sources, so it can say where each value came from.
        return (init_settings,)

    def plugin_options(self, name: str, model: type[M]) -> M:
        """A component's own settings: its ``[plugins.NAME]`` table as ``model``.

        ``load_settings`` validated it already (with the source of every value
        in its errors); on settings built directly the table, or the model's
        defaults, is validated on first access. Raises ``ConfigError``.

        Example: ``settings.plugin_options("ngram", NgramSettings).max_n``.
        """
        key = name.strip().lower()
        options = self._plugin_options.get(key)
        if not isinstance(options, model):
            options = validate_table(model, self.plugins.table(key), f"plugins.{key}", lambda _: "the Settings object")
            self._plugin_options[key] = options
        return options

    def set_plugin_options(self, name: str, options: BaseModel) -> None:
        """Record a component's validated settings (``load_settings`` does, for each one)."""
        self._plugin_options[name.strip().lower()] = options
