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

from linserve.model import modes
from linserve.model.heap import keep_scratch, trim
from linserve.model.interface import CheckpointError, ServedModel
from linserve.model.loader import (
    batch_invariant_active,
    check,
    load,
    max_state_bytes,
    pick_dtype,
)
from linserve.server.engine.calls import describe
from linserve.server.engine.description import ModelDescription
from linserve.server.engine.sizing import engine_threads, resolve_checkpoint
from linserve.server.settings import Settings, parse_cli
from linserve.server.speculative.draft import check_speculative, load_draft
from linserve.server.system.cpus import available_cpus

log = logging.getLogger("linserve")
# Loading a checkpoint this large leaves gigabytes of freed temporaries in the heap; below it
# the few MB left are reused by the server's own allocations, so nothing is trimmed.
TRIM_ABOVE = 256 << 20



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
    """The model without its weights (:func:`linserve.model.loader.load` with
    ``weights=False``: config, tokenizer, template, fingerprint, states and their codec),
    which the checks read state files against and the early description is made of."""
    apply_image_settings(settings)
    model = load(settings.weights, settings.dtype, settings.fused_step, settings.batch_invariant,
                 settings.quantization, weights=False, kv_cache_dtype=settings.kv_cache_dtype)
    apply_initial_state(model, settings)
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


def check_settings(settings: Settings) -> tuple[int, ModelDescription]:
    """Everything about ``settings``' checkpoint that can be checked before serving (its
    memory, its family's checks, a vision tower, a speculative config, the state files of
    ``--initial-state`` and ``--state-dir``); returns the bytes of its largest state (what an
    import may send) and the model described without its weights (the HTTP process reads
    its tokenizer while the engine loads). Raises CheckpointError, OSError or ValueError (a
    StateError) with the one line to say."""
    apply_image_settings(settings)  # a vision tower, --mmproj's too, is checked with it
    check(settings.weights, settings.dtype, settings.quantization, settings.max_memory)
    state_limit = max_state_bytes(settings.weights) + (1 << 16)  # and the blob's header
    if settings.speculative is not None:
        check_speculative(settings.speculative, settings.weights)
    return state_limit, describe(describe_model(settings), settings)  # state files read


Verdict = tuple[Settings | None, str | None, int, ModelDescription | None]


def check_early(argv: list[str]) -> Verdict:
    """``linserve serve argv``'s settings, resolved and checked quietly
    (:func:`check_settings`), in a prelaunched engine process: (the settings, None, the
    largest state's bytes, the model described), or (None, the one line saying why it
    cannot load, 0, None), or (None, None, 0, None) where the settings do not parse (the
    HTTP process says why)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            settings = parse_cli(argv)
        except (Exception, SystemExit):  # the HTTP process reports it, once
            return None, None, 0, None
        try:
            settings = resolve_checkpoint(settings)
            return settings, None, *check_settings(settings)
        except (CheckpointError, OSError, ValueError) as exc:
            return None, f"cannot load {settings.model or settings.weights}: {exc}", 0, None


def load_prepared(settings: Settings) -> LoadedEngine | None:
    """The engine loaded on ``settings`` (:func:`check_early`'s), in a prelaunched engine
    process while the HTTP process imports and checks, or None where the load fails (a
    draft model that is not there: the HTTP process says why, once; the engine loads again
    on its settings if it does start). Used only if the server's settings agree
    (:meth:`LoadedEngine.serves`)."""
    try:
        setup_engine_process(settings)
        return load_engine(settings)
    except (Exception, SystemExit):  # the HTTP process reports it, once
        return None
