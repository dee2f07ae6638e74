"""Layers shared by the Hugging Face architecture families (``linserve/model/architectures/``): each
family is one module that assembles these, as vLLM's ``model_executor/models/`` assemble its
``layers/``.

- :mod:`.norms`: RMSNorm (``w · x`` and Qwen's ``(1 + w) · x``), the gated RMSNorm of Mamba2.
- :mod:`.mlp`: SwiGLU and squared-ReLU MLPs.
- :mod:`.rope`: rotary positions (full or partial).
- :mod:`.attention`: grouped-query attention over a KV cache, optional q/k norms.
- :mod:`.short_conv`: LFM2's double-gated short convolution.
- :mod:`.own`: the project's own checkpoints' blocks (linear, softmax, window, FAVOR+
  attention; :mod:`linserve.model.architectures.own_model`).
- :mod:`.decoder`: the causal LM around a stack of layers: embeddings, prefill (whole,
  chunked, ragged), step, head.

Every layer takes ``[B, T, d]`` for a prefill (``new [B]``: real tokens of a right-padded
ragged batch) and ``[B, d]`` for one step, keeps its state in :mod:`linserve.model.state` entries
(fp32), and uses the batch-invariant GEMMs of :mod:`linserve.model.invariant`.
"""
