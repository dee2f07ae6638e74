"""Tiny random RWKV-7 checkpoints written as BlinkDL's ``.pth`` and as fla-hub's folder of
the same weights, and the reference's figures on them (``rwkv_reference``, in a process of
its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from linserve.model.architectures import rwkv_pth
from tests.paths import ROOT

# hidden, layers, head size (the reference's CPU path takes any), LoRA ranks (w, a, v, g),
# the channel mix's width, the vocabulary (the world vocabulary's 65,536)
SHAPES = {
    "d128-l3": dict(d=128, layers=3, head=64, ranks=(16, 16, 8, 32), ffn=448, vocab=65536),
    "d192-l2-h32": dict(d=192, layers=2, head=32, ranks=(8, 8, 8, 16), ffn=384, vocab=65536),
}


class Normal(Protocol):
    def __call__(self, *size: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor: ...


def _random(seed: int) -> tuple[Normal, Callable[..., torch.Tensor]]:
    """Draws of one seeded generator: normal (scaled, shifted) and uniform in [0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*size: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * scale + shift

    def uni(*size: int) -> torch.Tensor:
        return torch.rand(*size, generator=gen)

    return rnd, uni


def blinkdl_weights(shape: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of a plausible scale, named and shaped as BlinkDL's ``.pth``."""
    s = SHAPES[shape]
    d, n_layers, head, (rw, ra, rv, rg), f, vocab = (
        s["d"], s["layers"], s["head"], s["ranks"], s["ffn"], s["vocab"])
    rnd, uni = _random(seed)

    sd = {"emb.weight": rnd(vocab, d, scale=0.5), "ln_out.weight": rnd(d, scale=0.1, shift=1),
          "ln_out.bias": rnd(d, scale=0.1), "head.weight": rnd(vocab, d, scale=d ** -0.5)}
    for i in range(n_layers):
        p = f"blocks.{i}."
        norms = ["ln1", "ln2"] + (["ln0"] if i == 0 else [])
        for ln in norms:
            sd[p + ln + ".weight"] = rnd(d, scale=0.1, shift=1)
            sd[p + ln + ".bias"] = rnd(d, scale=0.1)
        a = p + "att."
        for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            sd[a + m] = uni(1, 1, d)
        for name, rank, bias in (("w", rw, -0.5), ("a", ra, 0.0), ("v", rv, 0.0)):
            sd[a + name + "0"] = rnd(1, 1, d, scale=0.5, shift=bias)
            sd[a + name + "1"] = rnd(d, rank, scale=0.1)
            sd[a + name + "2"] = rnd(rank, d, scale=0.1)
        sd[a + "g1"] = rnd(d, rg, scale=0.1)
        sd[a + "g2"] = rnd(rg, d, scale=0.1)
        sd[a + "k_k"] = rnd(1, 1, d, scale=0.05, shift=0.85)
        sd[a + "k_a"] = rnd(1, 1, d, scale=0.05, shift=1.0)
        sd[a + "r_k"] = rnd(d // head, head, scale=0.1)
        for proj in ("receptance", "key", "value", "output"):
            sd[a + proj + ".weight"] = rnd(d, d, scale=d ** -0.5)
        sd[a + "ln_x.weight"] = rnd(d, scale=0.1, shift=1)
        sd[a + "ln_x.bias"] = rnd(d, scale=0.1)
        sd[p + "ffn.x_k"] = uni(1, 1, d)
        sd[p + "ffn.key.weight"] = rnd(f, d, scale=d ** -0.5)
        sd[p + "ffn.value.weight"] = rnd(d, f, scale=f ** -0.5)
    return sd


def write_pth(folder: Path, shape: str, seed: int = 0) -> Path:
    """``folder/model.pth`` of :func:`blinkdl_weights`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.pth"
    torch.save(blinkdl_weights(shape, seed), path)
    return path


def write_fla(folder: Path, pth: Path) -> Path:
    """fla-hub's folder of the weights of ``pth``: config.json, model.safetensors and the
    world vocabulary beside them."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = rwkv_pth.config(pth)
    (folder / "config.json").write_text(json.dumps({
        **cfg, "architectures": ["RWKV7ForCausalLM"], "attn_mode": "chunk",
        "value_dim": [cfg["hidden_size"]] * cfg["num_hidden_layers"], "norm_bias": True,
        "hidden_act": "sqrelu", "fuse_norm": True}))
    tensors = {n: rwkv_pth.read(pth, n).contiguous() for n in rwkv_pth.sources(pth)}
    save_file(tensors, str(folder / "model.safetensors"))
    vocab = ROOT / "linserve/model/vocab/rwkv_vocab_v20230424.txt"
    (folder / vocab.name).write_bytes(vocab.read_bytes())
    return folder


def write_state_file(path: Path, shape: str, seed: int = 1) -> Path:
    """A random state-tuned file of the shape: ``blocks.{i}.att.time_state [H, N, N]``."""
    s = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    heads = s["d"] // s["head"]
    torch.save({f"blocks.{i}.att.time_state":
                torch.randn(heads, s["head"], s["head"], generator=gen) * 0.5
                for i in range(s["layers"])}, path)
    return path


def reference(pth: Path, prompt: list[int], steps: list[int], tmp: Path,
              state_file: Path | None = None) -> dict[str, object]:
    """The reference's logits ``[len(prompt) + len(steps), V]`` and final state (from the
    state file's state where given)."""
    ids, out = tmp / "ids.json", tmp / "ref.pt"
    ids.write_text(json.dumps({"prompt": prompt, "steps": steps,
                               "state_file": str(state_file) if state_file else None}))
    subprocess.run([sys.executable, "-m", "tests.model.rwkv_reference", str(pth), str(ids),
                    str(out)], cwd=ROOT, check=True, capture_output=True)
    found: dict[str, object] = torch.load(out, weights_only=True)
    return found


# RWKV-6: hidden, layers, head size, the token-shift and decay LoRA ranks, the channel mix
SHAPES6 = {
    "d128-l3": dict(d=128, layers=3, head=64, ranks=(32, 64), ffn=448, vocab=65536),
    "d96-l2-h32": dict(d=96, layers=2, head=32, ranks=(32, 64), ffn=320, vocab=65536),
}


def blinkdl_weights6(shape: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random RWKV-6 weights of a plausible scale, named and shaped as BlinkDL's ``.pth``."""
    s = SHAPES6[shape]
    d, n_layers, head, (rm, rd), f, vocab = (
        s["d"], s["layers"], s["head"], s["ranks"], s["ffn"], s["vocab"])
    rnd, uni = _random(seed)

    sd = _outer(rnd, vocab, d)
    for i in range(n_layers):
        p = f"blocks.{i}."
        _norms(sd, rnd, p, d, i == 0)
        a = p + "att."
        for m in ("x", "w", "k", "v", "r", "g"):
            sd[a + "time_maa_" + m] = uni(1, 1, d)
        sd[a + "time_maa_w1"] = rnd(d, 5 * rm, scale=0.1)
        sd[a + "time_maa_w2"] = rnd(5, rm, d, scale=0.1)
        sd[a + "time_decay"] = rnd(1, 1, d, scale=0.5, shift=-2.5)
        sd[a + "time_decay_w1"] = rnd(d, rd, scale=0.1)
        sd[a + "time_decay_w2"] = rnd(rd, d, scale=0.1)
        sd[a + "time_faaaa"] = rnd(d // head, head, scale=0.5)
        for proj in ("receptance", "key", "value", "gate", "output"):
            sd[a + proj + ".weight"] = rnd(d, d, scale=d ** -0.5)
        sd[a + "ln_x.weight"] = rnd(d, scale=0.1, shift=1)
        sd[a + "ln_x.bias"] = rnd(d, scale=0.1)
        _channel_mix(sd, rnd, uni, p + "ffn.", d, f, ("time_maa_k", "time_maa_r"))
    return sd


def blinkdl_weights4(d: int = 96, n_layers: int = 3, f: int = 256, vocab: int = 65536,
                     seed: int = 0) -> dict[str, torch.Tensor]:
    """Random RWKV-4 weights, named and shaped as BlinkDL's ``.pth``."""
    rnd, uni = _random(seed)

    sd = _outer(rnd, vocab, d)
    for i in range(n_layers):
        p = f"blocks.{i}."
        _norms(sd, rnd, p, d, i == 0)
        a = p + "att."
        sd[a + "time_decay"] = rnd(d, scale=1.0, shift=-1.0)
        sd[a + "time_first"] = rnd(d, scale=1.0)
        for m in ("k", "v", "r"):
            sd[a + "time_mix_" + m] = uni(1, 1, d)
        for proj in ("receptance", "key", "value", "output"):
            sd[a + proj + ".weight"] = rnd(d, d, scale=d ** -0.5 * 2)
        _channel_mix(sd, rnd, uni, p + "ffn.", d, f, ("time_mix_k", "time_mix_r"))
    return sd


def _outer(rnd: Any, vocab: int, d: int) -> dict[str, torch.Tensor]:
    return {"emb.weight": rnd(vocab, d, scale=0.5), "ln_out.weight": rnd(d, scale=0.1, shift=1),
            "ln_out.bias": rnd(d, scale=0.1), "head.weight": rnd(vocab, d, scale=d ** -0.5)}


def _norms(sd: dict[str, torch.Tensor], rnd: Any, p: str, d: int, first: bool) -> None:
    for ln in ["ln1", "ln2"] + (["ln0"] if first else []):
        sd[p + ln + ".weight"] = rnd(d, scale=0.1, shift=1)
        sd[p + ln + ".bias"] = rnd(d, scale=0.1)


def _channel_mix(sd: dict[str, torch.Tensor], rnd: Any, uni: Any, f_: str, d: int, f: int,
                 mixes: tuple[str, str]) -> None:
    for m in mixes:
        sd[f_ + m] = uni(1, 1, d)
    sd[f_ + "key.weight"] = rnd(f, d, scale=d ** -0.5)
    sd[f_ + "receptance.weight"] = rnd(d, d, scale=d ** -0.5)
    sd[f_ + "value.weight"] = rnd(d, f, scale=f ** -0.5)


def write_pth_of(folder: Path, weights: dict[str, torch.Tensor]) -> Path:
    """``folder/model.pth`` holding ``weights``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.pth"
    torch.save(weights, path)
    return path


def write_hf_rwkv(folder: Path, pth: Path, rescale_every: int = 0) -> Path:
    """The Hugging Face folder of an RWKV-6 or RWKV-4 ``.pth``'s weights (``rwkv.*`` names, as
    their converters write them): config.json, model.safetensors, the world vocabulary."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = rwkv_pth.config(pth)
    arch = "Rwkv6ForCausalLM" if cfg["model_type"] == "rwkv6" else "RwkvForCausalLM"
    (folder / "config.json").write_text(json.dumps({
        **cfg, "architectures": [arch], "rescale_every": rescale_every,
        "head_size_divisor": 8, "bos_token_id": 0, "eos_token_id": 0}))
    tensors = {n: rwkv_pth.read(pth, n).contiguous() for n in rwkv_pth.sources(pth)}
    save_file(tensors, str(folder / "model.safetensors"))
    vocab = ROOT / "linserve/model/vocab/rwkv_vocab_v20230424.txt"
    (folder / vocab.name).write_bytes(vocab.read_bytes())
    return folder
