"""llama.cpp on the same weights, for ``bench.hf --llamacpp`` (never run by CI).

``bench/llamacpp.sh`` builds llama.cpp from the source vendored in the
``llama-cpp-python==0.3.36`` sdist and converts the checkpoint with llama.cpp's own
``convert_hf_to_gguf.py``. This module runs what the comparison needs:

- :func:`gguf`: the checkpoint as a GGUF of one weight type (converted once, kept beside the
  checkpoint);
- :func:`llama_bench`: ``llama-bench`` batch-1 decode (``tg``) and prompt processing (``pp``)
  tokens/s at given thread counts;
- :func:`serve_and_load`: ``llama-server --parallel N`` (or this project's server) driven by
  ``bench.loadtest`` with N concurrent streams: aggregate output tokens/s.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from bench import loadtest
from bench.common import server_metrics
from bench.serverproc import free_port

SCRIPT = Path(__file__).with_name("llamacpp.sh")


def binary(name: str) -> Path:
    """A built llama.cpp program (``bash bench/llamacpp.sh build`` first)."""
    out = subprocess.run(["bash", str(SCRIPT), "bin", name], check=True, capture_output=True,
                         text=True).stdout.strip()
    path = Path(out)
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `bash bench/llamacpp.sh build` first")
    return path


# made by llama-quantize from the bf16 GGUF
QUANTIZED = ("q4_0", "q4_k_m", "q5_0", "q5_k_m", "q6_k")


def gguf(checkpoint: Path, kind: str) -> Path:
    """The checkpoint as GGUF ``kind``, made once: f32, bf16, f16 and q8_0 converted by
    llama.cpp's script; q4_0 (and other :data:`QUANTIZED` types) by llama-quantize."""
    out = checkpoint / f"llamacpp-{kind}.gguf"
    if out.exists():
        return out
    if kind in QUANTIZED:
        subprocess.run(["bash", str(SCRIPT), "quantize", str(gguf(checkpoint, "bf16")),
                        str(out), kind.upper()], check=True)
    else:
        subprocess.run(["bash", str(SCRIPT), "convert", str(converter_view(checkpoint)),
                        str(out), kind], check=True)
    return out


def converter_view(checkpoint: Path) -> Path:
    """The folder llama.cpp's converter reads for ``checkpoint``: the checkpoint itself, or
    for transformers' ``bailing_hybrid`` a folder beside it of links to its files and the
    config as Ling-V3 publishes it (``BailingMoeV3ForCausalLM``: the converter takes the
    Ling hybrids in that layout, which transformers' save writes but for the config: a
    model type transformers does not know, so that the converter reads the file as it is,
    the KDA head size as ``head_dim``, and the fields it requires)."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    if cfg.get("model_type") != "bailing_hybrid":
        return checkpoint
    view = checkpoint.parent / f"{checkpoint.name}-as-bailing-moe-v3"
    view.mkdir(exist_ok=True)
    for file in checkpoint.iterdir():
        link = view / file.name
        if file.name != "config.json" and not file.name.endswith(".gguf") \
                and not link.exists():
            link.symlink_to(file.resolve())
    shared = cfg["moe_intermediate_size"] * int(cfg.get("num_shared_experts") or 1)
    cfg.update(model_type="bailing_moe_v3", architectures=["BailingMoeV3ForCausalLM"],
               no_kda_lora=True, gated_attention_proj_granularity_type="head_wise",
               score_function="sigmoid",
               moe_shared_expert_intermediate_size=shared,
               norm_topk_prob=bool(cfg.get("moe_renormalize", True)),
               head_dim=cfg.get("linear_head_dim") or cfg.get("head_dim"))
    (view / "config.json").write_text(json.dumps(cfg, indent=2))
    return view


def llama_bench(model: Path, threads: list[int], prompt: int, gen: int, reps: int = 2
                ) -> list[dict[str, Any]]:
    """``llama-bench`` rows: {threads, test ("pp<n>" / "tg<n>"), tokens_per_s}."""
    cmd = [str(binary("llama-bench")), "-m", str(model), "-p", str(prompt), "-n", str(gen),
           "-t", ",".join(map(str, threads)), "-r", str(reps), "-o", "json"]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return [{"threads": r["n_threads"],
             "test": f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}",
             "tokens_per_s": round(r["avg_ts"], 2)} for r in rows]


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 900.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become healthy")


@contextlib.contextmanager
def running(cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None
            ) -> Iterator[int]:
    """``cmd`` started (listening on ``port``, output to ``log``, ``env`` added) and healthy;
    yields its pid, stops it after."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    try:
        _wait(f"http://127.0.0.1:{port}", proc)
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def serve_and_load(cmd: list[str], port: int, streams: int, requests: int, prompt: int,
                   gen: int, log: Path, env: dict[str, str] | None = None,
                   measure: Callable[[int], int] | None = None) -> dict[str, Any]:
    """Start ``cmd`` (listening on ``port``), run ``bench.loadtest`` with ``streams``
    concurrent streaming completions (a discarded warm-up round first), stop it; returns the
    loadtest report (with ``rss_bytes``: ``measure(pid)`` after the run, when given)."""
    with running(cmd, port, log, env) as pid:
        url = f"http://127.0.0.1:{port}"
        common = ["--url", url, "--concurrency", str(streams), "--prompt-tokens", str(prompt),
                  "--max-tokens", str(gen), "--ignore-eos", "--temperature", "0.8"]
        loadtest.main([*common, "--requests", str(streams)])
        before = engine_seconds(url)
        report = loadtest.main([*common, "--requests", str(requests)])
        after = engine_seconds(url)
        if before and after:
            report["engine_seconds"] = {k: round(after[k] - before[k], 3) for k in after}
        if measure is not None:
            report["rss_bytes"] = measure(pid)
        return report


ENGINE_SERIES = {"prefill": "linserve_prefill_seconds_sum", "decode": "linserve_step_seconds_sum",
                 "decode_steps": "linserve_step_seconds_count"}


def engine_seconds(url: str) -> dict[str, float]:
    """This server's engine time so far (prefill and decode-step seconds, and decode steps)
    from its ``/metrics``; empty for a server without them (llama-server)."""
    values = server_metrics(url)
    if not all(s in values for s in ENGINE_SERIES.values()):
        return {}
    return {k: float(values[s]) for k, s in ENGINE_SERIES.items()}


def llama_server_cmd(model: Path, streams: int, context: int) -> tuple[list[str], int]:
    """``llama-server`` with ``streams`` slots of ``context`` tokens each, on a free port."""
    port = free_port()
    return [str(binary("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port",
            str(port), "--parallel", str(streams), "-c", str(streams * context),
            "--no-webui"], port
