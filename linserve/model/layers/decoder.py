"""The causal LM around a stack of hybrid layers: token embeddings, the layers, a final norm
and the head; whole, chunked and ragged prefill and the one-token step, for every family.

A *mixer* (attention, short convolution, Mamba2) is an ``nn.Module`` with
``forward(x [B, T, d], entries, lengths [B], new [B] | None) -> [B, T, d]``,
``step(x [B, d], entries, lengths [B]) -> [B, d]`` and
``new_entries(batch, max_context) -> {name: Entry}``; its state lives in the layer's dict of
:mod:`linserve.model.state` entries and is updated *in place* (a decode step runs on a view of the
slot pool's rows: a tensor replaced on the view would be lost when the view is rebuilt).
A *layer* takes ``(x, entries, lengths, one_token, new)`` and owns ``new_entries`` too
(:class:`~linserve.model.layers.block.Block` is the common pre-norm residual one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from linserve.model import invariant, kernels, modes, packing
from linserve.model.inputs import InsertTable
from linserve.model.invariant import Linear
from linserve.model.layers import native_step
from linserve.model.layers.block import build_weights
from linserve.model.state import State, prefill_state
from linserve.model.verify import Trail, verify_by_steps


class Body(nn.Module):
    """``model.*`` of a checkpoint: embeddings, layers, final norm."""

    def __init__(self, vocab: int, dim: int, layers: Sequence[nn.Module], norm: nn.Module
                 ) -> None:
        super().__init__()
        # Built on the meta device to be loaded into, the table skips its random init: on
        # meta, normal_ runs through torch._refs, whose first import took 1 s of every start.
        meta = torch.empty(0).is_meta
        self.embed_tokens = nn.Embedding(vocab, dim,
                                         _weight=torch.empty(vocab, dim) if meta else None)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class DecoderLM(nn.Module):
    """``model.embed_tokens``, ``linserve.model.layers``, ``model.norm`` and ``lm_head`` (None when
    tied), as Hugging Face checkpoints name them after a family's renames. Logits are
    ``head(norm(x)) / logits_scaling`` fp32, then ``cap · tanh(logits / cap)`` with a
    ``logits_soft_cap`` (Gemma's); embeddings are scaled by ``embedding_scale``.
    ``cfg`` is the family's config (``vocab_size``, ``max_position_embeddings`` at least)."""

    def __init__(self, cfg: Any, vocab: int, dim: int, layers: Sequence[nn.Module],
                 norm: nn.Module, tie: bool, embedding_scale: float = 1.0,
                 logits_scaling: float = 1.0, logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Body(vocab, dim, layers, norm)
        self.lm_head = None if tie else Linear(dim, vocab, bias=False)
        self.embedding_scale, self.logits_scaling = embedding_scale, logits_scaling
        self.logits_soft_cap = logits_soft_cap
        self.native = True  # step in one native call where the layers allow (native_step)
        self._plan: tuple[Any, native_step.Plan | None] | None = None

    def new_state(self, batch: int = 1, max_context: int | None = None) -> State:
        ctx = max_context or self.cfg.max_position_embeddings
        layers: list[Any] = list(self.model.layers)
        return State([layer.new_entries(batch, ctx) for layer in layers],
                     torch.zeros(batch, dtype=torch.long))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = invariant.embed(self.model.embed_tokens, tokens)
        return x * self.embedding_scale if self.embedding_scale != 1.0 else x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.model.norm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head on normed hidden states ``[..., d]`` -> fp32 ``[..., V]``."""
        if self.lm_head is not None:
            logits = self.lm_head(x).float()
        else:
            emb = self.model.embed_tokens
            logits = invariant.linear(x, emb.weight, emb).float()
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        cap = self.logits_soft_cap
        return logits if cap is None else invariant.rowwise(torch.tanh, logits / cap) * cap

    def _run(self, x: torch.Tensor, state: State, one_token: bool = False,
             new: torch.Tensor | None = None, lengths: torch.Tensor | None = None
             ) -> torch.Tensor:
        lengths = state.lengths if lengths is None else lengths
        for layer, entries in zip(self.model.layers, state.layers, strict=True):
            x = layer(x, entries, lengths, one_token=one_token, new=new)
        return x

    def embed_prompt(self, tokens: torch.Tensor, inserts: InsertTable | None) -> torch.Tensor:
        """:meth:`embed` of ``tokens`` ``[B, T]``, where virtual ids (negative) take their
        items' rows from ``inserts`` (:mod:`linserve.model.inputs`) -> ``[B, T, d]``."""
        if inserts is None:
            inserts = InsertTable()  # raises on a virtual id, if there is one
        if not bool((tokens < 0).any()):
            return self.embed(tokens)
        return inserts.place(tokens, self.embed(tokens.clamp(min=0)))

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, state: State | None = None,
                all_logits: bool = False, inserts: InsertTable | None = None,
                room: int = 0) -> tuple[torch.Tensor, State]:
        """tokens ``[B, T]`` after ``state`` (None: empty; every row at one length; not
        modified) -> last logits ``[B, V]`` (``[B, T, V]`` with ``all_logits``), new state.
        ``inserts``: the embeddings of the items whose virtual ids ``tokens`` holds;
        ``room``: the prompt's tokens still to prefill (:meth:`ServedModel.prefill`)."""
        b, t = tokens.shape
        state = prefill_state(state, lambda: self.new_state(b), t, room)
        if bool((state.lengths != state.lengths[0]).any()):
            raise ValueError("prefill needs rows of equal length")
        x = self._run(self.embed_prompt(tokens, inserts), state)
        state.lengths += t
        return self.head(x if all_logits else x[:, -1]), state

    @torch.inference_mode()
    def prefill_ragged(self, prompts: list[list[int]], states: list[State | None]
                       ) -> tuple[torch.Tensor, list[State]]:
        """Prompts of different lengths after states at different lengths, in one
        right-padded pass: each prompt's last logits ``[B, V]`` and its new one-row state
        (the given states are not modified); equal to :meth:`prefill` of each alone."""
        if not prompts or any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        new = torch.tensor([len(p) for p in prompts])
        tokens = torch.nn.utils.rnn.pad_sequence([torch.tensor(p) for p in prompts],
                                                 batch_first=True)
        state = State.cat([st if st is not None else self.new_state(1) for st in states])
        starts = state.lengths.clone()
        state.reserve(int((starts + new).max()))
        x = self._run(self.embed(tokens), state, new=new, lengths=starts)
        state.lengths += new
        return self.head(x[torch.arange(len(prompts)), new - 1]), state.unbatch()

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """tokens ``[B]`` -> logits ``[B, V]``; advances every row of ``state`` in place. One
        native call for the whole model where the kernels are built and every layer is one
        it implements (:mod:`linserve.model.layers.native_step`), else :meth:`step_eager`."""
        plan = self.native_plan() if self.native and kernels.available() else None
        if plan is not None:
            state.reserve(int(state.lengths.max()) + 1)
            logits = native_step.step(plan, tokens, state)
            if logits is not None:
                state.lengths += 1
                return logits
        return self.step_eager(tokens, state)

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, Trail]:
        """tokens ``[B, T]`` -> logits ``[B, T, V]`` and the trail of a verify
        (:mod:`linserve.model.verify`): one native call where the step is native
        (``decoder_verify``), else a step per position."""
        plan = self.native_plan() if self.native and kernels.available() else None
        state.reserve(int(state.lengths.max()) + tokens.shape[1])
        if plan is not None:
            out = native_step.verify(plan, tokens, state, self.keeps_hidden)
            if out is not None:
                state.lengths += tokens.shape[1]
                return out
        return verify_by_steps(self.step, tokens, state)

    @torch.inference_mode()
    def step_eager(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """:meth:`step` layer by layer in PyTorch (the native step's reference)."""
        state.reserve(int(state.lengths.max()) + 1)
        x = self._run(self.embed(tokens), state, one_token=True)
        state.lengths += 1
        return self.head(x)

    def weights_key(self) -> tuple[Any, ...]:
        """What a native step's arguments depend on: the batch-invariant mode, the
        quantization, and the weights (a cast or a load replaces the embedding table)."""
        emb = self.model.embed_tokens.weight
        return (modes.enabled(), modes.quantization(), emb.data_ptr(), emb.dtype)

    def native_plan(self) -> native_step.Plan | None:
        """The native step's arguments (None: a layer it does not implement); rebuilt when
        the mode flips or the weights are replaced."""
        key = self.weights_key()
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, native_step.plan(self))
        return self._plan[1]

    @property
    def keeps_hidden(self) -> bool:
        """Whether a verify keeps the final norm's outputs in its trail (a draft head that
        drafts from them wants them)."""
        return False

    @property
    def split_invariant(self) -> bool:
        """Whether a prompt gives the same bits whole, split anywhere, or fed token by token
        (every mixer's arithmetic per token independent of the call; a chunked SSD is not)."""
        return all(getattr(m, "split_invariant", True) for m in self.model.layers.modules())

    def prepare(self, fused: bool) -> bool:
        """After the load: build every packed weight the forms read, and say whether a step
        is one native call (``fused``: the whole-model native step is wanted)."""
        self.pack_weights()
        return fused and kernels.available() and self.native_plan() is not None

    def pack_weights(self) -> None:
        """Build every packed GEMM weight (one two-token prefill and one step), so that
        :func:`packing.release` can free the originals."""
        _, state = self.prefill(torch.zeros(1, 2, dtype=torch.long))
        self.step(torch.zeros(1, dtype=torch.long), state)
        build_weights(self)

    @torch.inference_mode()
    def pack_head(self) -> None:
        """Build the head's packed weight (a tied table is then read from it)."""
        emb = self.model.embed_tokens
        self.head(torch.zeros(1, emb.embedding_dim, dtype=emb.weight.dtype))

    @torch.inference_mode()
    def pack_layer(self, i: int) -> None:
        """Build layer ``i``'s packed GEMM weights alone (its prefill and its step on zeros),
        so that a checkpoint is packed layer by layer as it is read."""
        emb = self.model.embed_tokens
        entries = self.new_state(1, 64).layers[i]
        x = torch.zeros(1, 2, emb.embedding_dim, dtype=emb.weight.dtype)
        layer = self.model.layers[i]
        layer(x, entries, torch.zeros(1, dtype=torch.long))
        layer(x[:, 0], entries, torch.full((1,), 2), one_token=True)
        build_weights(layer)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def drop_weights(self) -> None:
        """Free every weight (states can still be built; the model cannot run)."""
        self._plan = None
        packing.strip(self)
