"""``python -m bench.rwkv``: RWKV-7 at a published shape (random weights), as served.

``--make`` writes fla-hub's folder of ``rwkv7-1.5B-world``'s shape (``--shape v6-1.6b``: the
Hugging Face folder of ``v6-Finch-1B6``'s, :func:`make6`) (d 2,048, 24 layers, heads
of 64, LoRA ranks 96 / 96 / 64 / 256, channel mix 8,192, the world vocabulary) in bf16, layer
by layer. Then for each weight type: the checkpoint loaded as the server loads it, the decode
step at batch 1 and 16 (``bench.native_step``'s measure: the median of many, at position
``--context``), against the read roofline (the bytes a batch-1 step must read, every weight
but the embedding table as packed plus the state read and written, over the four-stream read
of ``bench.roofline`` on the same threads); a 2,048-token prompt's prefill; and what a
session's state costs: its bytes, a fork (a copy), an export and an import of its blob.

Writes ``bench/results/rwkv.json`` and ``rwkv.png`` (``rwkv6.*`` for an RWKV-6 shape).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.common import machine, print_table, save_figure, time_ms, write_json
from bench.native_step import measure as step_measure
from bench.quant import TYPES
from bench.roofline import read_bandwidth_gbs
from linserve.model import loader, packing
from linserve.model.world_tokenizer import WORLD_VOCAB


@dataclass(frozen=True)
class Shape:
    """A published RWKV-7 shape: hidden, layers, the LoRA ranks (w, a, v, g), the channel
    mix's width."""

    d: int
    layers: int
    ranks: tuple[int, int, int, int]
    ffn: int


SHAPES = {"1.5b": Shape(2048, 24, (96, 96, 64, 256), 8192),
          "2.9b": Shape(2560, 32, (96, 96, 64, 320), 10240)}


def make(shape: str, path: Path) -> None:
    """fla-hub's folder of ``shape`` with random bf16 weights of a plausible scale."""
    s = SHAPES[shape]
    d, layers, (rw, ra, rv, rg), f, vocab = s.d, s.layers, s.ranks, s.ffn, 65536
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)

    def rnd(*size: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * scale + shift).to(torch.bfloat16)

    t: dict[str, torch.Tensor] = {"model.embeddings.weight": rnd(vocab, d, scale=0.5),
                                  "model.norm.weight": rnd(d, shift=1.0, scale=0.1),
                                  "model.norm.bias": rnd(d, scale=0.1),
                                  "lm_head.weight": rnd(vocab, d, scale=d ** -0.5)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for norm in ["attn_norm", "ffn_norm"] + (["pre_norm"] if i == 0 else []):
            t[p + norm + ".weight"] = rnd(d, shift=1.0, scale=0.1)
            t[p + norm + ".bias"] = rnd(d, scale=0.1)
        a = p + "attn."
        for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            t[a + m] = torch.rand(1, 1, d, generator=gen).to(torch.bfloat16)
        loras = [("w", rw, True), ("a", ra, True), ("g", rg, False)]
        loras += [("v", rv, True)] if i else []
        for name, rank, bias in loras:
            t[a + f"{name}_lora.lora.0.weight"] = rnd(rank, d, scale=0.1)
            t[a + f"{name}_lora.lora.2.weight"] = rnd(d, rank, scale=0.1)
            if bias:
                t[a + f"{name}_lora.lora.2.bias"] = rnd(d, scale=0.5)
        t[a + "k_k"] = rnd(d, scale=0.05, shift=0.85)
        t[a + "k_a"] = rnd(d, scale=0.05, shift=1.0)
        t[a + "r_k"] = rnd(d // 64, 64, scale=0.1)
        for proj in ("r_proj", "k_proj", "v_proj", "o_proj"):
            t[a + proj + ".weight"] = rnd(d, d, scale=d ** -0.5)
        t[a + "g_norm.weight"] = rnd(d, shift=1.0, scale=0.1)
        t[a + "g_norm.bias"] = rnd(d, scale=0.1)
        t[p + "ffn.x_k"] = torch.rand(d, generator=gen).to(torch.bfloat16)
        t[p + "ffn.key.weight"] = rnd(f, d, scale=d ** -0.5)
        t[p + "ffn.value.weight"] = rnd(d, f, scale=f ** -0.5)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM"], "vocab_size": vocab,
        "hidden_size": d, "num_hidden_layers": layers, "head_dim": 64,
        "decay_low_rank_dim": rw, "a_low_rank_dim": ra, "v_low_rank_dim": rv,
        "gate_low_rank_dim": rg, "intermediate_size": f, "norm_eps": 1e-5,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    (path / WORLD_VOCAB.name).write_bytes(WORLD_VOCAB.read_bytes())


# RWKV-6 "Finch" 1.6B (RWKV/v6-Finch-1B6-HF): hidden, layers, channel mix
SHAPES6 = {"v6-1.6b": (2048, 24, 7168)}


def make6(shape: str, path: Path) -> None:
    """The Hugging Face folder (``Rwkv6ForCausalLM``, ``rwkv.blocks.N.*``) of an RWKV-6 shape
    with random bf16 weights of a plausible scale (the LoRA ranks 32 and 64 the modeling code
    and llama.cpp's converter take for hidden 2,048; ``rescale_every`` 6 as published)."""
    d, layers, f = SHAPES6[shape]
    vocab, head = 65536, 64
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)

    def rnd(*size: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * scale + shift).to(torch.bfloat16)

    def uni(*size: int) -> torch.Tensor:
        return torch.rand(*size, generator=gen).to(torch.bfloat16)

    t = {"rwkv.embeddings.weight": rnd(vocab, d, scale=0.5),
         "rwkv.ln_out.weight": rnd(d, shift=1.0, scale=0.1), "rwkv.ln_out.bias": rnd(d, scale=0.1),
         "head.weight": rnd(vocab, d, scale=d ** -0.5)}
    for i in range(layers):
        p = f"rwkv.blocks.{i}."
        for norm in ["ln1", "ln2"] + (["pre_ln"] if i == 0 else []):
            t[p + norm + ".weight"] = rnd(d, shift=1.0, scale=0.1)
            t[p + norm + ".bias"] = rnd(d, scale=0.1)
        a = p + "attention."
        for m in ("x", "w", "k", "v", "r", "g"):
            t[a + "time_maa_" + m] = uni(1, 1, d)
        t[a + "time_maa_w1"] = rnd(d, 5 * 32, scale=0.1)
        t[a + "time_maa_w2"] = rnd(5, 32, d, scale=0.1)
        t[a + "time_decay"] = rnd(1, 1, d, scale=0.5, shift=-2.5)
        t[a + "time_decay_w1"] = rnd(d, 64, scale=0.1)
        t[a + "time_decay_w2"] = rnd(64, d, scale=0.1)
        t[a + "time_faaaa"] = rnd(d // head, head, scale=0.5)
        for proj in ("receptance", "key", "value", "gate", "output"):
            t[a + proj + ".weight"] = rnd(d, d, scale=d ** -0.5)
        t[a + "ln_x.weight"] = rnd(d, shift=1.0, scale=0.1)
        t[a + "ln_x.bias"] = rnd(d, scale=0.1)
        ffn = p + "feed_forward."
        t[ffn + "time_maa_k"], t[ffn + "time_maa_r"] = uni(1, 1, d), uni(1, 1, d)
        t[ffn + "key.weight"] = rnd(f, d, scale=d ** -0.5)
        t[ffn + "receptance.weight"] = rnd(d, d, scale=d ** -0.5)
        t[ffn + "value.weight"] = rnd(d, f, scale=f ** -0.5)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "rwkv6", "architectures": ["Rwkv6ForCausalLM"], "vocab_size": vocab,
        "hidden_size": d, "attention_hidden_size": d, "num_hidden_layers": layers,
        "head_size": head, "head_size_divisor": 8, "intermediate_size": f,
        "layer_norm_epsilon": 1e-5, "rescale_every": 6, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "bfloat16"}))
    (path / WORLD_VOCAB.name).write_bytes(WORLD_VOCAB.read_bytes())


def state_costs(path: Path, kind: str) -> dict[str, float]:
    """A session's state: bytes, and the ms of a fork (copy), an export and an import."""
    served = loader.load(path, "bfloat16", quantization=TYPES[kind], weights=False)
    state = served.new_state(1)
    blob = served.state_to_bytes(state)
    return {"state_bytes": state.nbytes,
            "fork_ms": time_ms(state.copy, min_iters=20),
            "export_ms": time_ms(lambda: served.state_to_bytes(state), min_iters=10),
            "import_ms": time_ms(lambda: served.state_from_bytes(blob), min_iters=10),
            "blob_bytes": len(blob)}


def prefill_ms(path: Path, kind: str, tokens: int) -> float:
    served = loader.load(path, "bfloat16", quantization=TYPES[kind])
    prompt = torch.randint(0, 65529, (1, tokens), generator=torch.Generator().manual_seed(1))
    served.prefill(prompt[:, :64])  # warm
    start = time.perf_counter()
    served.prefill(prompt)
    return (time.perf_counter() - start) * 1e3


def step_bytes(path: Path, kind: str) -> int:
    """Bytes a batch-1 step reads: every packed weight but the embedding table, and the
    state read and written."""
    served = loader.load(path, "bfloat16", quantization=TYPES[kind])
    module = served.module  # type: ignore[attr-defined]
    weights = packing.resident_bytes(module) - packing.embedding_bytes(module)
    return int(weights + 2 * served.new_state(1).nbytes)


def measure(path: Path, kinds: list[str], context: int, prompt: int) -> dict[str, Any]:
    rows = []
    for kind in kinds:
        steps = {b: step_measure(path, kind, "bfloat16", b, context) for b in (1, 16)}
        nbytes = step_bytes(path, kind)
        gbs = read_bandwidth_gbs(threads=torch.get_num_threads())
        b1_ms = steps[1]["step_ms"]
        rows.append({"kind": kind, "b1_tok_s": steps[1]["tokens_per_s"],
                     "b16_tok_s": steps[16]["tokens_per_s"], "b1_step_ms": b1_ms,
                     "read_bytes": nbytes, "read_gbs": round(gbs, 1),
                     "roofline": round(nbytes / (b1_ms / 1e3) / (gbs * 1e9), 3),
                     "prefill_ms": round(prefill_ms(path, kind, prompt), 1),
                     "prefill_tok_s": 0.0, **state_costs(path, kind)})
        rows[-1]["prefill_tok_s"] = round(prompt / rows[-1]["prefill_ms"] * 1e3, 1)
    return {"machine": machine(), "checkpoint": path.name, "context": context,
            "prompt": prompt, "rows": rows}


def plot(result: dict[str, Any], name: str) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    kinds = [r["kind"] for r in rows]
    axes[0].bar([k + " b1" for k in kinds], [r["b1_tok_s"] for r in rows], color="C0")
    axes[0].bar([k + " b16" for k in kinds], [r["b16_tok_s"] for r in rows], color="C1")
    axes[0].set_ylabel("tokens / s")
    axes[1].bar(kinds, [r["roofline"] for r in rows], color="C2")
    axes[1].axhline(0.85, color="black", lw=0.8, ls="--")
    axes[1].set_ylabel("batch-1 step, of the read roofline")
    fig.suptitle(f"{result['checkpoint']} (random weights), 2 cores", fontsize=9)
    save_figure(fig, name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1.5b", choices=[*SHAPES, *SHAPES6])
    p.add_argument("--root", type=Path, default=Path("/tmp"))
    p.add_argument("--make", action="store_true")
    p.add_argument("--kinds", nargs="+", default=["int8", "bf16"], choices=list(TYPES))
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    v6 = args.shape in SHAPES6
    path = args.root / (f"rwkv6-{args.shape[3:]}-shapes" if v6 else f"rwkv7-{args.shape}-shapes")
    if args.make and not (path / "config.json").exists():
        (make6 if v6 else make)(args.shape, path)
    result = measure(path, args.kinds, args.context, args.prompt)
    print_table(result["rows"], ["kind", "b1_tok_s", "b16_tok_s", "roofline", "prefill_tok_s",
                                 "state_bytes", "fork_ms", "export_ms", "import_ms"])
    name = "rwkv6" if v6 else "rwkv"  # bench/results/NAME.json and .png
    write_json(name, result)
    plot(result, name)


if __name__ == "__main__":
    main()
