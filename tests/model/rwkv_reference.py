"""Run BlinkDL's reference (the ``rwkv`` package, ``cpu fp32``; ``RWKV_V7_ON=1`` for an RWKV-7
``.pth``) on a ``.pth``: ``python -m tests.model.rwkv_reference MODEL.pth IDS.json OUT.pt``
writes the logits of every prompt position (one sequence call, from a state file's state
where IDS.json names one), then of each later token fed one at a time, and the state after
them (the package's list: ``[att shift, S, ffn shift]`` per layer for v6 and v7, S key ×
value for v6; ``[att shift, num, den, p, ffn shift]`` for v4). Its own process: the package
sets process-wide torch flags and scripts its functions at import, and chooses its model
class by the environment."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("RWKV_JIT_ON", "0")

import torch


def main(model: Path, ids_file: Path, out: Path) -> None:
    v7 = "blocks.0.att.r_k" in torch.load(model, weights_only=True, mmap=True)
    if v7:
        os.environ["RWKV_V7_ON"] = "1"
    from rwkv.model import RWKV

    spec = json.loads(ids_file.read_text())
    prompt, steps = spec["prompt"], spec["steps"]
    rwkv = RWKV(model=str(model.with_suffix("")), strategy="cpu fp32")
    state = None
    if spec.get("state_file"):  # a state-tuned file: S per layer, the shifts zero
        tuned = torch.load(spec["state_file"], weights_only=True)
        state = rwkv.generate_zero_state() if v7 else _zero_state_v6(rwkv)
        for i in range(len(state) // 3):
            s = tuned[f"blocks.{i}.att.time_state"].float()
            state[3 * i + 1] = (s if v7 else s.transpose(1, 2)).contiguous().clone()
    with torch.no_grad():
        seq, state = rwkv.forward(prompt, state, full_output=True)
        logits = [seq.reshape(len(prompt), -1)]
        for token in steps:
            one, state = rwkv.forward([token], state)
            logits.append(one.reshape(1, -1))
    torch.save({"logits": torch.cat(logits).float(),
                "state": [s.float().clone() for s in state]}, out)


def _zero_state_v6(rwkv: object) -> list[torch.Tensor]:
    """The package's fresh v6 state (its v6 class has no ``generate_zero_state``)."""
    args = rwkv.args  # type: ignore[attr-defined]
    n = args.n_att // args.n_head
    state = []
    for _ in range(args.n_layer):
        state += [torch.zeros(args.n_embd), torch.zeros(args.n_head, n, n),
                  torch.zeros(args.n_embd)]
    return state


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
