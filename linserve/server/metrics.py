"""Prometheus metrics (prometheus-client), with conventional names."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

TTFT = Histogram("linserve_time_to_first_token_seconds", "Time to first token", buckets=_LAT)
ITL = Histogram("linserve_inter_token_latency_seconds", "Time between streamed tokens",
                buckets=_LAT)
E2E = Histogram("linserve_e2e_request_latency_seconds", "End-to-end request latency",
                buckets=_LAT)
QUEUE_TIME = Histogram("linserve_queue_time_seconds", "Time waiting before prefill",
                       buckets=_LAT)
STEP_TIME = Histogram("linserve_step_seconds", "Duration of one batched decode step",
                      buckets=_LAT)
PREFILL_TIME = Histogram("linserve_prefill_seconds", "Duration of one engine iteration's "
                         "prefill work (replays and prompt chunks)", buckets=_LAT)
RUNNING = Gauge("linserve_num_requests_running", "Requests prefilling or decoding")
WAITING = Gauge("linserve_num_requests_waiting", "Requests queued")
BATCH_SIZE = Gauge("linserve_batch_size", "Rows in the last decode step")
SESSIONS = Gauge("linserve_sessions", "Live sessions in the store")
SESSION_BYTES = Gauge("linserve_session_bytes", "Bytes of state held by live sessions")
PROMPT_TOKENS = Counter("linserve_prompt_tokens", "Prompt tokens prefilled")
PROMPT_COMPUTED = Counter("linserve_prompt_tokens_computed", "Prompt tokens the model ran, by "
                          "request kind: client (a request's own prompt), next_turn (a "
                          "conversation prefilled after its reply), session", ["kind"])
PROMPT_REUSED = Counter("linserve_prompt_tokens_reused", "Prompt tokens not run, taken from "
                        "the prefix cache, by request kind (as prompt_tokens_computed)",
                        ["kind"])
GENERATION_TOKENS = Counter("linserve_generation_tokens", "Tokens generated")
REQUESTS = Counter("linserve_requests", "Finished engine requests by status", ["status"])
HTTP_REQUESTS = Counter("linserve_http_requests", "HTTP responses by route and status code",
                        ["route", "code"])
DISCONNECTS = Counter("linserve_client_disconnects", "Streams cancelled by client disconnect")
ENGINE_UP = Gauge("linserve_engine_up", "1 while the engine process serves, 0 while it is "
                  "down or restarting")
ENGINE_RESTARTS = Counter("linserve_engine_restarts", "Engine processes restarted by the "
                          "supervisor after a death or a stall")
PREFIX_QUERIES = Counter("linserve_prefix_cache_queries", "Prompt tokens looked up in the "
                         "prefix-state cache (vLLM: prefix_cache_queries)")
PREFIX_HITS = Counter("linserve_prefix_cache_hits", "Prompt tokens served from the "
                      "prefix-state cache (vLLM: prefix_cache_hits)")
PREFIX_HIT_RATE = Gauge("linserve_prefix_cache_hit_rate", "Cached prompt tokens / prompt "
                        "tokens looked up, since start")
PREFIX_BYTES = Gauge("linserve_prefix_cache_bytes", "Bytes of state held by the prefix cache")
PREFIX_ENTRIES = Gauge("linserve_prefix_cache_entries", "States held by the prefix cache")
PREFIX_BUDGET = Gauge("linserve_prefix_cache_budget_bytes", "The prefix cache's byte budget "
                      "(--prefix-cache-bytes)")
PREFIX_LONGEST = Gauge("linserve_prefix_cache_longest_tokens", "Tokens of the longest prefix "
                       "the prefix cache holds a state after")
PREFIX_SHARED = Gauge("linserve_prefix_cache_shared_bytes", "Bytes of the prefix cache's "
                      "entries that other entries read too (a long prompt's keys, held once)")
PREFIX_REMOTE_HITS = Counter("linserve_prefix_cache_remote_hits", "Prompt tokens served from "
                             "a prefix state another replica published to Redis")
PREFIX_REMOTE_FETCHES = Counter("linserve_prefix_cache_remote_fetches", "Prefix states read "
                                "from Redis (published by another replica)")
PREFIX_REMOTE_FETCH_BYTES = Counter("linserve_prefix_cache_remote_fetch_bytes", "Bytes of the "
                                    "prefix states read from Redis")
PREFIX_REMOTE_ERRORS = Counter("linserve_prefix_cache_remote_errors", "Redis calls of the "
                               "prefix cache that failed or timed out (requests went on)")
PREFIX_EVICTIONS = Counter("linserve_prefix_cache_evictions", "Prefix-cache entries evicted "
                           "(LRU, byte budget)")
MEMORY = Gauge("linserve_memory_bytes", "Resident bytes by part: the engine's weights, "
               "embeddings, slot_states, kv_cache, request_states and prefix_cache, the HTTP "
               "process's sessions, and the runtime (both processes' RSS less the rest)",
               ["part"])
SPEC_DRAFT_TOKENS = Counter("linserve_spec_decode_draft_tokens", "Draft tokens verified by "
                            "speculative decoding (vLLM: spec_decode_num_draft_tokens)")
SPEC_ACCEPTED_TOKENS = Counter("linserve_spec_decode_accepted_tokens", "Draft tokens the "
                               "served model kept (vLLM: spec_decode_num_accepted_tokens)")
SPEC_ACCEPTED_BY_POSITION = Counter("linserve_spec_decode_accepted_tokens_per_pos", "Draft "
                                    "tokens kept, by position in the draft (0: the first)",
                                    ["position"])
