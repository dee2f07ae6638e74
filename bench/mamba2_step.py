"""``python -m bench.mamba2_step``: the Mamba2 decode step alone against the read roofline
(never run by CI).

A model of Mamba2 layers only, at Granite-4.0-H-Micro's Mamba2 shape (hidden 2048, 64 heads
of 64, a state of 128, one group, conv 4; 8 layers), made with transformers as a Nemotron-H
checkpoint of ``linear_attention`` blocks (each ``x + mamba(norm(x))``) with random weights,
so that a step is the Mamba2 layers and the head and nothing else. Per weight type (bf16,
int8, int4) and thread count, the batch-1 native step (``decoder_step.cpp``) is timed and
set against the bytes it must read: every tensor of the native plan but the embedding table
(of which a step reads one row), as packed, plus the state read and written (the SSM states
and conv windows, fp32). The roofline is those bytes over the read bandwidth at the same
thread count, measured alternately with the step by ``bench.roofline``'s native
four-stream read.

Writes ``bench/results/mamba2_step.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, time_interleaved, write_json
from bench.roofline import stream_read

ROOT = Path(__file__).resolve().parents[1]
SHAPE: dict[str, Any] = {"hidden_size": 2048, "mamba_num_heads": 64, "mamba_head_dim": 64,
         "ssm_state_size": 128, "n_groups": 1, "conv_kernel": 4, "vocab_size": 8192}
QUANT = {"bf16": "none", "int8": "int8", "int4": "int4"}


def make(path: Path, layers: int) -> Path:
    """The Mamba2-only checkpoint (made once)."""
    if (path / "config.json").exists():
        return path
    import transformers

    fields: dict[str, Any] = {
        **SHAPE, "layers_block_type": ["linear_attention"] * layers,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 4096, "n_routed_experts": 0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False}
    cfg = transformers.NemotronHConfig(**fields)
    torch.manual_seed(0)
    transformers.NemotronHForCausalLM(cfg).eval().save_pretrained(path)
    shutil.copy(ROOT / "weights" / "tokenizer.json", path / "tokenizer.json")
    return path


def read_bytes(model: Any, state: Any) -> tuple[int, int]:
    """(bytes of the plan's tensors a step reads, bytes of state read and written)."""
    plan = model.module.native_plan()
    assert plan is not None, "the Mamba2 model did not get a native plan"
    weights = sum(t.numel() * t.element_size() for t in plan.weights[1:])
    return weights, 2 * state.nbytes


def one(path: Path, kind: str, threads: list[int], probe: Any) -> dict[str, Any]:
    """One weight type's step at each thread count, timed alternately with ``probe`` (the
    native four-stream read of a buffer larger than the cache) at the same thread count:
    this VM's bandwidth drifts within minutes, so a ceiling measured once at the start is
    not the ceiling of a step timed later."""
    from linserve.model import loader

    model = loader.load(path, "bfloat16", quantization=QUANT[kind])
    assert model.info.decode_step.startswith("fused"), model.info.decode_step
    _, state = model.prefill(torch.randint(0, SHAPE["vocab_size"], (1, 16)))
    weights, state_bytes = read_bytes(model, state)
    token = torch.tensor([5])
    buffer = torch.ones(256 * 2**20 // 4)
    out: dict[str, Any] = {"weight_bytes_read": weights, "state_bytes_rw": state_bytes}
    for n in threads:
        torch.set_num_threads(n)
        ms = time_interleaved({"step": lambda: model.step(token, state),
                               "read": lambda: probe(buffer)}, rounds=9, round_seconds=0.3)
        gbs = (weights + state_bytes) / (ms["step"] / 1e3) / 1e9
        read_gbs = buffer.nbytes / (ms["read"] / 1e3) / 1e9
        out[f"threads_{n}"] = {"step_ms": ms["step"], "step_gbs": gbs, "read_gbs": read_gbs,
                               "roofline_fraction": gbs / read_gbs}
        print(kind, n, "thread(s):", round(ms["step"], 2), "ms,", round(gbs, 1), "GB/s of",
              round(read_gbs, 1), "read:", round(gbs / read_gbs, 3), "of the roofline",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", type=Path, default=Path("/tmp/mamba2-step"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kinds", nargs="+", default=list(QUANT), choices=list(QUANT))
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    args = p.parse_args(argv)
    command = "python -m bench.mamba2_step " + " ".join(argv or sys.argv[1:])
    path = make(args.path, args.layers)
    probe = stream_read()
    assert probe is not None, "the native read probe did not build"
    result = {"command": command, "machine": machine(),
              "shape": {**SHAPE, "layers": args.layers},
              "types": {kind: one(path, kind, args.threads, probe) for kind in args.kinds}}
    write_json("mamba2_step", result)


if __name__ == "__main__":
    main()
