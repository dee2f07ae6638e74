"""What both processes work out from the settings alone, torch-free: the checkpoint's
path and the memory given (:func:`resolve_checkpoint`), the prefix cache's default budget,
the budget of growing states (:func:`state_budget`) and the engine's threads."""

from __future__ import annotations

from linserve.model.checkpoint_path import resolve
from linserve.model.info import ModelInfo
from linserve.model.inputs import ENCODED_CACHE_BYTES
from linserve.model.memory import available_memory
from linserve.server.settings import Settings
from linserve.server.system.cpus import available_cpus

# Weights from which the engine takes every CPU by default (``--threads 0``): the step's
# arithmetic then dwarfs what the HTTP process does per token. The 0.8B shapes' Q4_K_M file
# decoded at 73 ms a token on one of two cores and 43 ms on both, over HTTP; a model of
# a few MB, whose thousands of tokens a second keep the HTTP process busy, ran faster with a
# core left to it.
ALL_CPUS_ABOVE = 64 << 20

PREFIX_MIN_BYTES, PREFIX_MAX_BYTES = 64 << 20, 4 << 30  # the prefix cache's default bounds


def engine_threads(settings: Settings, weight_bytes: int) -> int:
    """The engine's torch threads: ``--threads``, else every CPU this process may use for
    weights of :data:`ALL_CPUS_ABOVE` or more, one fewer (at least one) below."""
    if settings.threads:
        return settings.threads
    cpus = available_cpus()
    return cpus if weight_bytes >= ALL_CPUS_ABOVE else max(1, cpus - 1)


def resolve_checkpoint(settings: Settings) -> Settings:
    """``settings`` with what both processes must agree on resolved: ``--model`` (a folder,
    a GGUF file or a repo id) as the ``weights`` path, and an unset ``--max-memory`` as 0.8
    of the memory available."""
    if settings.model:
        settings = settings.model_copy(update={"weights": resolve(settings.model)})
    if not settings.max_memory:
        settings = settings.model_copy(update={"max_memory": int(0.8 * available_memory())})
    if settings.prefix_cache_bytes < 0:
        budget = prefix_budget(settings.max_memory)
        settings = settings.model_copy(update={"prefix_cache_bytes": budget})
    return settings


def prefix_budget(max_memory: int) -> int:
    """The prefix cache's default budget: a thirty-second of ``--max-memory``, from 64 MiB
    to 4 GiB. Running requests come first (their KV caches take the rest); a long
    document's entries share their keys, so 536 MiB of 18 GB hold a 32k-token document of
    Qwen3.5-0.8B's shapes in bf16 (384 MiB of keys) and a few of its states."""
    return min(max(max_memory // 32, PREFIX_MIN_BYTES), PREFIX_MAX_BYTES)


def state_budget(settings: Settings, info: ModelInfo) -> int:
    """Bytes the engine's growing states (KV caches) may take: ``--max-memory`` less the
    weights, the slot pool's fixed part (a fresh state per row) and the prefix cache. 0 when
    states do not grow (nothing to limit)."""
    if not info.state_grows:
        return 0
    fixed = info.weight_bytes + info.state_bytes * settings.max_running
    if info.input_kinds:  # the encoded items' cache (an image's embeddings, by content)
        fixed += ENCODED_CACHE_BYTES
    return max(settings.max_memory - fixed - settings.prefix_cache_bytes, 1)
