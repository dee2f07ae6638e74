"""The engine's side of the border with the HTTP process: states in and out as blobs, the
model described, and the calls the HTTP process makes of the model. Run by the engine
process (:mod:`.child`) and, in-process, by the thread mode (:mod:`.thread_client`); the
HTTP side of each is torch-free (:mod:`.description`, :mod:`.types`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from linserve.model import kernels
from linserve.model.blob_view import StateBlob
from linserve.model.interface import ServedModel, State
from linserve.model.loader import pick_dtype
from linserve.server.engine.description import ModelDescription
from linserve.server.engine.types import GenerationRequest, Output
from linserve.server.sessions.named_states import load_named_states
from linserve.server.settings import Settings


def describe(model: ServedModel, settings: Settings) -> ModelDescription:
    """What the HTTP process needs of ``model``: its info, fingerprint, template and
    tokenizer, ``--state-dir``'s states (raises StateError for one that does not fit) and
    what the kernels are."""
    named = load_named_states(lambda data: import_state(model, data)[0], settings.state_dir)
    return ModelDescription(model.info, model.fingerprint(), model.chat_template(),
                            model.tokenizer(), named, pick_dtype(settings.dtype),
                            kernels.bf16_gemm(), kernels.describe(), kernels.build_seconds())


def blob_of(model: ServedModel, state: State) -> StateBlob:
    return StateBlob(model.state_to_bytes(state))


def import_state(model: ServedModel, data: bytes) -> tuple[StateBlob, dict[str, Any]]:
    """A blob or the model's own state file, validated (StateError otherwise), as this
    server's blob of its state, and the ``extra`` it carried."""
    state, extra = model.state_from_bytes(data)
    return blob_of(model, state), extra


def state_file(model: ServedModel, blob: StateBlob, extra: dict[str, Any]) -> bytes:
    """``blob`` as the model's own state file (RWKV's ``.pth``; StateError for a model
    without one)."""
    state, _ = model.state_from_bytes(blob.data)
    return model.state_to_bytes(state, extra, "pth")


# The calls by the names they cross as (``("call", (id, name, args))``).
CALLS: dict[str, Callable[..., Any]] = {"import_state": import_state, "state_file": state_file}


def take_request(model: ServedModel, req: GenerationRequest) -> GenerationRequest:
    """A request as the engine runs it (a copy): its blobs read as states (StateError for a
    bad one)."""
    start = None if req.start_blob is None else model.state_from_bytes(req.start_blob.data)[0]
    prefix = None if req.prefix_blob is None else model.state_from_bytes(req.prefix_blob)[0]
    return dataclasses.replace(req, start_blob=None, start_state=start, prefix_blob=None,
                               prefix_state=prefix)


def give_output(model: ServedModel, out: Output) -> Output:
    """An output as the HTTP side takes it: a final state as a blob."""
    if out.final_state is None:
        return out
    return dataclasses.replace(out, final_state=None, final_blob=blob_of(model, out.final_state))
