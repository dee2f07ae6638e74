"""Train a model: ``python -m linserve.model.training.train --config configs/linear.json
[--resume]``.

AdamW with warmup and cosine decay, gradient clipping, a fixed seed, bf16 autocast (optional),
a progress bar with loss and tokens/s, periodic validation that keeps the best checkpoint,
and checkpoints from which ``--resume`` continues the run exactly (model, optimiser, RNG).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from linserve.model.architectures.own_model import LanguageModel
from linserve.model.own_config import ModelConfig
from linserve.model.training.data import DATA_DIR, load_tokens


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; ``model`` holds the :class:`ModelConfig` fields."""

    name: str
    model: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 256
    batch_size: int = 16
    max_steps: int = 1000
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 100
    eval_batches: int = 16
    checkpoint_interval: int = 50
    seed: int = 1337
    threads: int = 1
    bf16: bool = True
    out_dir: str = "runs"
    export_dir: str = ""

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        return cls(**json.loads(Path(path).read_text()))

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine decay from ``lr`` to ``min_lr`` at ``max_steps``."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    frac = min(1.0, (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps))
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * frac))


def sample_batch(tokens: np.ndarray, tc: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """Random windows ``[B, seq_len + 1]`` drawn with ``gen`` (so resume is exact)."""
    starts = torch.randint(0, len(tokens) - tc.seq_len - 1, (tc.batch_size,), generator=gen)
    rows = [torch.from_numpy(tokens[s : s + tc.seq_len + 1].astype(np.int64)) for s in starts]
    return torch.stack(rows)


@torch.no_grad()
def evaluate_loss(model: LanguageModel, tokens: np.ndarray, tc: TrainConfig) -> float:
    """Mean loss over fixed, evenly spaced validation windows (the same every call)."""
    model.eval()
    n = tc.eval_batches * tc.batch_size
    starts = np.linspace(0, len(tokens) - tc.seq_len - 1, n).astype(np.int64)
    losses = []
    for i in range(0, n, tc.batch_size):
        rows = [torch.from_numpy(tokens[s : s + tc.seq_len + 1].astype(np.int64))
                for s in starts[i : i + tc.batch_size]]
        x = torch.stack(rows)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tc.bf16):
            logits = model(x[:, :-1])
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).item())
    model.train()
    return float(np.mean(losses))


class Trainer:
    """Holds the model, optimiser and progress; checkpoints everything needed to resume."""

    def __init__(self, tc: TrainConfig, data_dir: Path = DATA_DIR) -> None:
        self.tc = tc
        torch.manual_seed(tc.seed)
        torch.set_num_threads(tc.threads)
        self.model_cfg = ModelConfig(**tc.model)
        self.model = LanguageModel(self.model_cfg)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        other = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": tc.weight_decay},
             {"params": other, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))
        self.gen = torch.Generator().manual_seed(tc.seed)
        self.train_tokens = load_tokens("train", data_dir)
        self.valid_tokens = load_tokens("valid", data_dir)
        self.run_dir = Path(tc.out_dir) / tc.name
        self.step = 0
        self.best_val = float("inf")
        self.elapsed = 0.0
        self.history: list[dict[str, float]] = []

    def save_checkpoint(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        blob = {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "gen": self.gen.get_state(), "torch_rng": torch.get_rng_state(),
                "step": self.step, "best_val": self.best_val, "elapsed": self.elapsed,
                "history": self.history, "train_config": asdict(self.tc)}
        tmp = self.run_dir / "ckpt.pt.tmp"
        torch.save(blob, tmp)
        tmp.replace(self.run_dir / "ckpt.pt")

    def load_checkpoint(self) -> None:
        blob = torch.load(self.run_dir / "ckpt.pt", weights_only=False)
        self.model.load_state_dict(blob["model"])
        self.opt.load_state_dict(blob["opt"])
        self.gen.set_state(blob["gen"])
        torch.set_rng_state(blob["torch_rng"])
        self.step, self.best_val = blob["step"], blob["best_val"]
        self.elapsed, self.history = blob["elapsed"], blob["history"]

    def train_step(self) -> float:
        tc = self.tc
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, tc)
        x = sample_batch(self.train_tokens, tc, self.gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tc.bf16):
            logits = self.model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        self.opt.step()
        self.step += 1
        return float(loss.item())

    def validate(self) -> float:
        val = evaluate_loss(self.model, self.valid_tokens, self.tc)
        self.history.append({"step": self.step, "val_loss": val, "elapsed": self.elapsed,
                             "tokens": self.step * self.tc.tokens_per_step})
        if val < self.best_val:
            self.best_val = val
            self.model.save(self.run_dir / "best")
        return val

    def run(self) -> None:
        tc = self.tc
        self.model.train()
        bar = tqdm(total=tc.max_steps, initial=self.step, desc=tc.name, dynamic_ncols=True)
        val = self.best_val
        while self.step < tc.max_steps:
            t0 = time.perf_counter()
            loss = self.train_step()
            self.elapsed += time.perf_counter() - t0
            if self.step % tc.eval_interval == 0 or self.step == tc.max_steps:
                val = self.validate()
            if self.step % tc.checkpoint_interval == 0 or self.step == tc.max_steps:
                self.save_checkpoint()
            tok_s = self.step * tc.tokens_per_step / max(self.elapsed, 1e-9)
            bar.set_postfix(loss=f"{loss:.3f}", val=f"{val:.3f}", tok_s=f"{tok_s:.0f}")
            bar.update(1)
        bar.close()
        self.write_summary()

    def write_summary(self) -> None:
        summary = {"name": self.tc.name, "steps": self.step, "best_val_loss": self.best_val,
                   "tokens_seen": self.step * self.tc.tokens_per_step,
                   "wall_seconds": round(self.elapsed, 1), "n_params": self.model.n_params(),
                   "history": self.history, "train_config": asdict(self.tc)}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if self.tc.export_dir:
            export = Path(self.tc.export_dir)
            export.mkdir(parents=True, exist_ok=True)
            for fname in ("config.json", "model.safetensors"):
                shutil.copy(self.run_dir / "best" / fname, export / fname)
            shutil.copy(self.run_dir / "summary.json", export / "training_summary.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--resume", action="store_true", help="continue from the run's ckpt.pt")
    parser.add_argument("--max-steps", type=int, help="override max_steps (e.g. smoke runs)")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    args = parser.parse_args(argv)
    tc = TrainConfig.load(args.config)
    if args.max_steps is not None:
        tc = TrainConfig(**{**asdict(tc), "max_steps": args.max_steps})
    trainer = Trainer(tc, args.data_dir)
    if args.resume and (trainer.run_dir / "ckpt.pt").exists():
        trainer.load_checkpoint()
    trainer.run()


if __name__ == "__main__":
    main()
