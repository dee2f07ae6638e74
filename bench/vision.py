"""``python -m bench.vision``: pictures to Qwen3.5, this server against llama-server with
llama.cpp's mmproj, both up at once on the same files, measured alternately by one client
over HTTP (the openai SDK's chat API, streamed, as a user sends a picture).

``--make DIR`` writes a random-weight ``Qwen3_5ForConditionalGeneration`` of the published
0.8B shapes (the text model of ``bench.hf``; the tower assumed as Qwen3.5-0.8B's: depth 12,
width 768, MLP 3,072, 12 heads, patch 16, a 48×48 position table, the 2×2 merger to 1,024)
with the Qwen tokenizer, Qwen3.5's template and ``preprocessor_config.json``, then
llama.cpp's converter writes ``model-q8_0.gguf`` (``--outtype q8_0``) and
``mmproj-f16.gguf`` (``--mmproj``, its default type) beside it.

Measured, with a fresh picture each request (so neither server's caches answer):
- time to first token of one 448×448 and one 1024×768 picture with a short question
  (``--reps`` each, the median), and the prompt tokens each server counted;
- an 8-turn chat that starts with a picture and adds a line of text each turn, the whole
  conversation resent each turn (stateless, as OpenAI clients send it): time to first
  token at every turn;
- resident memory of each server's processes after them (PSS: a page two processes share
  counted once).

Writes ``bench/results/vision.json`` and ``vision.png``.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import io
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai
import torch
from PIL import Image

from bench import llamacpp_compare as lc
from bench import memory
from bench.common import RESULTS, machine, save_figure, write_json
from bench.hf import PUBLISHED_0_8B

TOWER_0_8B = {"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "num_heads": 12,
              "out_hidden_size": 1024, "patch_size": 16, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "num_position_embeddings": 2304}
IMAGE_IDS = {"image_token_id": 151655, "video_token_id": 151656,
             "vision_start_token_id": 151652, "vision_end_token_id": 151653}
QUESTION = "Describe this picture in one sentence."


def make(path: Path) -> None:
    """The checkpoint and its two GGUF files (see the module docstring)."""
    from bench.llamacpp_assets import write_qwen_tokenizer_files

    transformers: Any = importlib.import_module("transformers")  # a dev dependency

    cfg = transformers.Qwen3_5Config(text_config=PUBLISHED_0_8B, vision_config=TOWER_0_8B,
                                     tie_word_embeddings=True, **IMAGE_IDS)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.tie_weights()
    model.save_pretrained(path)
    write_qwen_tokenizer_files(path)
    proc = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil
    proc(patch_size=16, merge_size=2, temporal_patch_size=2,
         size={"shortest_edge": 65_536, "longest_edge": 16_777_216},
         image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)
    for out, extra in ((path / "model-q8_0.gguf", ["q8_0"]),
                       (path / "mmproj-f16.gguf", ["f16", "--mmproj"])):
        subprocess.run(["bash", str(lc.SCRIPT), "convert", str(path), str(out), *extra],
                       check=True)


def picture(width: int, height: int, seed: int) -> str:
    """A random picture as a PNG data URL."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(arr).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def first_token(client: openai.OpenAI, messages: Any) -> tuple[float, int, str]:
    """Seconds to the first token (of the answer or of its thinking), the prompt tokens the
    server counted, and the reply's answer."""
    start = time.perf_counter()
    first, usage, text = None, 0, ""
    for chunk in client.chat.completions.create(
            model="m", messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        delta = chunk.choices[0].delta if chunk.choices else None
        thought = getattr(delta, "reasoning_content", None) if delta is not None else None
        if delta is not None and (delta.content or thought) and first is None:
            first = time.perf_counter() - start  # the first token, thinking or not
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage.prompt_tokens
    return (first if first is not None else time.perf_counter() - start), usage, text


def user(text: str, image: str | None = None) -> dict[str, Any]:
    if image is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": image}}]}


def single(clients: dict[str, openai.OpenAI], size: tuple[int, int], reps: int, seed: int
           ) -> dict[str, Any]:
    out: dict[str, Any] = {who: {"ttft_s": [], "prompt_tokens": 0} for who in clients}
    for rep in range(reps):
        for who, client in clients.items():  # alternately, a fresh picture each
            ttft, tokens, _ = first_token(client, [user(QUESTION,
                                                        picture(*size, seed + rep * 7))])
            out[who]["ttft_s"].append(round(ttft, 3))
            out[who]["prompt_tokens"] = tokens
    for who in clients:
        out[who]["median_s"] = statistics.median(out[who]["ttft_s"])
    return out


def chat(clients: dict[str, openai.OpenAI], turns: int, size: tuple[int, int], seed: int
         ) -> dict[str, Any]:
    """A chat about one picture, ``turns`` turns, resent whole; each server its own copy."""
    convs: dict[str, list[dict[str, Any]]] = {who: [] for who in clients}
    out: dict[str, Any] = {who: {"ttft_s": [], "prompt_tokens": []} for who in clients}
    image = picture(*size, seed)
    for turn in range(turns):
        line = f"Turn {turn + 1}: what else do you see?"
        for who, client in clients.items():
            convs[who].append(user(QUESTION if turn == 0 else line,
                                   image if turn == 0 else None))
            ttft, tokens, text = first_token(client, convs[who])
            convs[who].append({"role": "assistant", "content": text})
            out[who]["ttft_s"].append(round(ttft, 3))
            out[who]["prompt_tokens"].append(tokens)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model, proj = args.checkpoint / "model-q8_0.gguf", args.checkpoint / "mmproj-f16.gguf"
    port = lc.free_port()
    ours_cmd = [sys.executable, "-m", "linserve", "serve", str(model), "--mmproj", str(proj),
                "--port", str(port), "--threads", "2", *shlex.split(args.ours_args)]
    theirs_cmd, theirs_port = lc.llama_server_cmd(model, 1, 16384)
    theirs_cmd += ["-t", "2", "--mmproj", str(proj)]
    out: dict[str, Any] = {"machine": machine(), "files": [model.name, proj.name]}
    with lc.running(ours_cmd, port, RESULTS / "vision-ours.log") as ours_pid, \
            lc.running(theirs_cmd, theirs_port, RESULTS / "vision-llama.log") as theirs_pid:
        clients = {"ours": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                         api_key="none", timeout=600),
                   "llama_server": openai.OpenAI(base_url=f"http://127.0.0.1:{theirs_port}/v1",
                                                 api_key="none", timeout=600)}
        first_token(clients["ours"], [user("Hi")])  # warm both
        first_token(clients["llama_server"], [user("Hi")])
        out["448x448"] = single(clients, (448, 448), args.reps, 1)
        out["1024x768"] = single(clients, (1024, 768), args.reps, 2)
        out["chat"] = chat(clients, args.turns, (448, 448), 3)
        time.sleep(2.0)
        out["pss_bytes"] = {"ours": memory.pss_bytes(ours_pid),
                            "llama_server": memory.pss_bytes(theirs_pid)}
    out["ratios"] = ratios(out)
    return out


def ratios(out: dict[str, Any]) -> dict[str, float]:
    """llama-server ÷ ours for times (so > 1 is faster here), ours ÷ theirs for memory."""
    chat_ = out["chat"]
    return {"ttft_448": out["448x448"]["llama_server"]["median_s"]
            / out["448x448"]["ours"]["median_s"],
            "ttft_1024x768": out["1024x768"]["llama_server"]["median_s"]
            / out["1024x768"]["ours"]["median_s"],
            "chat_last_turn_ttft": chat_["llama_server"]["ttft_s"][-1]
            / chat_["ours"]["ttft_s"][-1],
            "pss": out["pss_bytes"]["ours"] / out["pss_bytes"]["llama_server"]}


def plot(out: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for who, style in (("ours", "o-"), ("llama_server", "s--")):
        ttfts = out["chat"][who]["ttft_s"]
        b.plot(range(1, len(ttfts) + 1), ttfts, style, label=who.replace("_", "-"))
    b.set_xlabel("turn (the picture sent in turn 1, the chat resent whole)")
    b.set_ylabel("time to first token, s")
    b.legend()
    names = ["448×448", "1024×768"]
    keys = ["448x448", "1024x768"]
    x = np.arange(len(names))
    for i, who in enumerate(("ours", "llama_server")):
        a.bar(x + (i - 0.5) * 0.38, [out[k][who]["median_s"] for k in keys], 0.38,
              label=who.replace("_", "-"))
    a.set_xticks(x, names)
    a.set_ylabel("time to first token, s (one picture)")
    a.legend()
    fig.suptitle("Qwen3.5-0.8B shapes, Q8_0 + f16 mmproj, 2 threads")
    save_figure(fig, "vision")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-vl"))
    p.add_argument("--make", action="store_true", help="write the checkpoint and its GGUFs")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--ours-args", default="--reasoning-parser qwen3",
                   help="this server's extra flags, one string (default: Qwen's reasoning "
                   "parser, as llama-server splits the thinking off by default)")
    args = p.parse_args(argv)
    if args.make:
        make(args.checkpoint)
        return
    out = measure(args)
    write_json("vision", out)
    print(json.dumps(out["ratios"], indent=2))
    plot(out)


if __name__ == "__main__":
    main()
