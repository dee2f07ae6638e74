"""Run BlinkDL's reference (the ``rwkv`` package, ``RWKV_V7_ON=1``, ``cpu fp32``) on a ``.pth``:
``python -m tests.model.rwkv_reference MODEL.pth IDS.json OUT.pt`` writes the logits of every
prompt position (one sequence call, from a state file's state where IDS.json names one),
then of each later token fed one at a time, and the state after them (``[att shift, S, ffn
shift]`` per layer). Its own process: the package sets
process-wide torch flags and scripts its functions at import."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["RWKV_V7_ON"] = "1"
os.environ.setdefault("RWKV_JIT_ON", "0")

import torch


def main(model: Path, ids_file: Path, out: Path) -> None:
    from rwkv.model import RWKV

    spec = json.loads(ids_file.read_text())
    prompt, steps = spec["prompt"], spec["steps"]
    rwkv = RWKV(model=str(model.with_suffix("")), strategy="cpu fp32")
    state = None
    if spec.get("state_file"):  # a state-tuned file: S per layer, the shifts zero
        tuned = torch.load(spec["state_file"], weights_only=True)
        state = rwkv.generate_zero_state()
        for i in range(rwkv.n_layer):
            state[3 * i + 1] = tuned[f"blocks.{i}.att.time_state"].float().clone()
    with torch.no_grad():
        seq, state = rwkv.forward(prompt, state, full_output=True)
        logits = [seq.reshape(len(prompt), -1)]
        for token in steps:
            one, state = rwkv.forward([token], state)
            logits.append(one.reshape(1, -1))
    torch.save({"logits": torch.cat(logits).float(),
                "state": [s.float().clone() for s in state]}, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
