"""Loading the model for the engine: weights, dtype, threads, tokenizer, and a warm-up.

Shared by the engine process and the thread mode; kept out of ``linserve.server.api.app`` so that
the engine process does not import the app that starts it.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from linserve.model import kernels, modes
from linserve.model.heap import keep_scratch, trim
from linserve.model.inputs import ENCODED_CACHE_BYTES
from linserve.model.interface import ModelInfo, ServedModel
from linserve.model.kernels import bf16_gemm  # noqa: F401 (re-exported for the app's startup)
from linserve.model.loader import (
    available_memory,
    batch_invariant_active,
    check,
    load,
    pick_dtype,
    resolve,
)
from linserve.server.settings import Settings, parse_cli
from linserve.server.speculative.draft import load_draft
from linserve.server.system.cpus import available_cpus

log = logging.getLogger("linserve")
# Loading a checkpoint this large leaves gigabytes of freed temporaries in the heap; below it
# the few MB left are reused by the server's own allocations, so nothing is trimmed.
TRIM_ABOVE = 256 << 20

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


def load_engine_model(settings: Settings) -> ServedModel:
    """The served model, loaded on every CPU (or ``--threads``), then run on
    :func:`engine_threads`."""
    torch.set_num_threads(settings.threads or available_cpus())
    start = time.perf_counter()
    apply_image_settings(settings)
    model = load(settings.weights, settings.dtype, settings.fused_step, settings.batch_invariant,
                 settings.quantization, kv_cache_dtype=settings.kv_cache_dtype)
    apply_initial_state(model, settings)
    info = model.info
    torch.set_num_threads(engine_threads(settings, info.weight_bytes))
    if info.weight_bytes >= TRIM_ABOVE:
        trim()
    # What loading made (modules, parameters, the tokenizer) lives as long as the process:
    # frozen, the collector stops walking it on every full pass (1.8% of a 16-row Granite
    # step was gc_collect_main), as vLLM does after its start-up.
    gc.collect()
    gc.freeze()
    keep_scratch()  # a step's scratch is reused from the heap, not faulted in afresh
    log.info("model: %s, %s parameters, loaded in %.1f s, state %s bytes a session (%s); "
             "decode step %s; weights %s (%s), quantization %s, %s MB resident; "
             "batch-invariant %s; %d engine threads",
             info.architecture, f"{info.params:,}", time.perf_counter() - start,
             f"{info.state_bytes:,}",
             "grows with context" if info.state_grows else "constant", info.decode_step,
             info.dtype, pick_dtype(settings.dtype)[1], info.quantization,
             f"{info.weight_bytes / 1e6:,.1f}", "on" if batch_invariant_active() else "off",
             torch.get_num_threads())
    return model


def describe_model(settings: Settings) -> ServedModel:
    """The model without its weights (:func:`linserve.model.loader.load` with ``weights=False``):
    what the HTTP process needs beside an engine process that holds the weights. Its
    ``info`` is replaced by the engine's once that has loaded."""
    apply_image_settings(settings)
    model = load(settings.weights, settings.dtype, settings.fused_step, settings.batch_invariant,
                 settings.quantization, weights=False, kv_cache_dtype=settings.kv_cache_dtype)
    apply_initial_state(model, settings)
    # reading a tokenizer leaves ~100 MB of free heap; one read later (a kept GGUF
    # vocabulary) is read while the engine loads, and trimmed after
    model.tokenizer().prefetch(then=trim)
    trim()
    return model


def apply_image_settings(settings: Settings) -> None:
    """``--limit-mm-per-prompt '{"image": 0}'`` leaves a vision tower unread;
    ``--mm-processor-kwargs`` replaces the image processor's limits (both processes, so
    that they count an image's tokens alike)."""
    modes.set_images(settings.image_limit > 0, settings.processor_limits,
                     Path(settings.mmproj) if settings.mmproj else None)


def apply_initial_state(model: ServedModel, settings: Settings) -> None:
    """``--initial-state``: every new state starts from that file (both processes, so that
    they agree on the fingerprint); raises StateError (a ValueError) for one that does not
    fit the model."""
    if settings.initial_state:
        model.set_initial_state(Path(settings.initial_state))


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


def warm_up(model: ServedModel) -> None:
    """Run each form once so the first request does not pay for lazy initialisation."""
    _, state = model.prefill(torch.zeros(1, 8, dtype=torch.long))
    model.step(torch.zeros(1, dtype=torch.long), state)


# The settings that decide what the engine loads (and how it logs while loading): a model
# loaded early on the command line's settings serves only if the server's agree on these.
LOAD_FIELDS = {"weights", "dtype", "fused_step", "batch_invariant", "quantization", "threads",
               "speculative_config", "log_level"}


@dataclass
class LoadedEngine:
    """What an engine process loads before it runs: the settings it loaded on, the served
    model and the draft model of a ``draft_model`` speculative config (else None)."""

    settings: Settings
    model: ServedModel
    draft: ServedModel | None

    def serves(self, settings: Settings) -> bool:
        """Whether this load is the one ``settings`` ask for."""
        return (self.settings.model_dump(include=LOAD_FIELDS)
                == settings.model_dump(include=LOAD_FIELDS))


def setup_engine_process(settings: Settings) -> None:
    """Logging for an engine process. malloc stays at glibc's defaults here, unlike the HTTP
    process (``linserve.server.system.malloc``): a pinned 64 KiB mmap threshold sends every
    step's temporaries (the logits, the MLP's hidden rows) to fresh mappings, page-faulted
    anew each step: 1,367 minor faults a batch-64 step against 41. That cost the engine loop
    55% of its throughput (``bench.engine_loop --malloc-threshold``) and halved the soak
    test's streams; the dynamic threshold keeps them on the heap, and the soak still holds
    RSS flat with the prefix cache churning."""
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def load_engine(settings: Settings) -> LoadedEngine:
    """The draft (first: loading sets the process's GEMM modes, which must end as the served
    model's), then the served model, warmed up."""
    draft = load_draft(settings.speculative, settings.dtype, settings.fused_step,
                       settings.batch_invariant, settings.quantization)
    model = load_engine_model(settings)
    warm_up(model)
    return LoadedEngine(settings, model, draft)


def load_early(argv: list[str]) -> LoadedEngine | None:
    """The engine loaded on ``linserve serve argv``'s own settings (:func:`prepare_early`,
    then :func:`load_prepared`), or None where that cannot be done quietly."""
    settings = prepare_early(argv)
    return None if settings is None else load_prepared(settings)


def prepare_early(argv: list[str]) -> Settings | None:
    """``linserve serve argv``'s own settings, resolved, with the checkpoint checked
    quietly (``loader.check``: its memory, then the family's checks, which are not run
    again for the same files): what a prelaunched engine process loads early. Run before
    that process is forked (:mod:`.prelaunch`), so it has the file's metadata read, its
    names matched and the check done. None where the settings do not parse, the checkpoint
    fails its check (the HTTP process says why, once), or the kernels are not built yet for
    this CPU (a first start: the HTTP process compiles them, logged)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            settings = resolve_checkpoint(parse_cli(argv))
            if not kernels.cached():
                return None
            check(settings.weights, settings.dtype, settings.quantization, settings.max_memory)
    except (Exception, SystemExit):  # the HTTP process reports it, once
        return None
    return settings


def load_prepared(settings: Settings) -> LoadedEngine | None:
    """The engine loaded on ``settings`` (:func:`prepare_early`'s), in a prelaunched engine
    process while the HTTP process imports and checks, or None where the load fails (a
    draft model that is not there: the HTTP process says why, once; the engine loads again
    on its settings if it does start). Used only if the server's settings agree
    (:meth:`LoadedEngine.serves`)."""
    try:
        setup_engine_process(settings)
        return load_engine(settings)
    except (Exception, SystemExit):  # the HTTP process reports it, once
        return None
