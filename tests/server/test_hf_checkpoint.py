"""Serving a Hugging Face Qwen3.5 checkpoint with its real 150k-token Qwen tokenizer
(``linserve serve --model``): structured outputs over that vocabulary; bad checkpoints and
weights over ``--max-memory`` refused with one line at startup; a hub id resolved from the
local cache offline. What every family shares through HTTP (greedy output equal to
transformers' ``generate``, the prefix cache, sessions) runs on Qwen3.5 in
tests/server/test_families_http.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.serverproc import ROOT, ServerProcess
from tests.model.qwen_fixtures import make_checkpoint

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen"), "i4-tied")


@pytest.fixture(scope="module")
def qwen_server(checkpoint: Path) -> Iterator[ServerProcess]:
    with ServerProcess.serving(checkpoint, "--served-model-name", "qwen-tiny") as srv:
        yield srv


def test_structured_outputs_with_a_150k_vocabulary(qwen_server: ServerProcess) -> None:
    """JSON-schema output through the llguidance bitmask over the Qwen tokenizer's 151,936
    ids (the model's vocabulary): every sampled reply validates, chat and completions."""
    from openai import OpenAI

    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "mood": {"enum": ["calm", "wild"]}},
        "required": ["name", "count", "mood"], "additionalProperties": False}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                       "strict": True}}
    client = OpenAI(base_url=qwen_server.url + "/v1", api_key="none", max_retries=0)
    for seed in range(6):
        chat = client.chat.completions.create(
            model="qwen-tiny", messages=[{"role": "user", "content": "Describe a cat."}],
            response_format=fmt, seed=seed, temperature=1.0, max_tokens=80)
        jsonschema.validate(json.loads(chat.choices[0].message.content or ""), schema)
        text = client.completions.create(model="qwen-tiny", prompt="A cat:", seed=seed,
                                         max_tokens=80, extra_body={"guided_json": schema})
        jsonschema.validate(json.loads(text.choices[0].text), schema)


def _start(model: Path | str, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "linserve", "serve", "--model", str(model),
                           "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _broken(base: Path, dest: Path, how: str) -> Path:
    shutil.copytree(base, dest)
    cfg = json.loads((dest / "config.json").read_text())
    if how == "model_type":
        cfg["model_type"] = "llama"
    elif how == "config":
        cfg["num_key_value_heads"] = 3  # 4 heads are not a multiple of 3
    elif how == "tokenizer":
        (dest / "tokenizer.json").unlink()
    elif how in ("tensor", "shape"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(dest / "model.safetensors")
        name = "model.layers.0.linear_attn.out_proj.weight"
        if how == "tensor":
            del tensors[name]
        else:
            tensors[name] = tensors[name][:, :-1].contiguous()
        save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    elif how == "shard":
        index = {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
        (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "memory":
        cfg["intermediate_size"] = 1 << 26  # billions of parameters: refused before loading
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize(("how", "says"), [
    ("model_type", "unknown architecture"), ("config", "num_key_value_heads"),
    ("tokenizer", "tokenizer.json is missing"), ("tensor", "is missing"),
    ("shape", "has shape"), ("shard", "shard model-00002-of-00002.safetensors is missing"),
    ("memory", "GiB is available")])
def test_a_bad_checkpoint_gets_one_line_and_a_nonzero_exit(checkpoint: Path, tmp_path: Path,
                                                           how: str, says: str) -> None:
    proc = _start(_broken(checkpoint, tmp_path / how, how))
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_weights_over_max_memory_get_one_line(checkpoint: Path, quantization: str) -> None:
    """Weights larger, as served, than ``--max-memory`` are refused at startup in one line
    naming the size they would take (smaller with int4)."""
    proc = _start(checkpoint, {"LINSERVE_MAX_MEMORY": "200000",
                               "LINSERVE_QUANTIZATION": quantization})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "more than --max-memory" in lines[0]
    assert ("as int4" in lines[0]) == (quantization == "int4")


def test_a_repo_id_resolves_from_the_local_cache_offline(checkpoint: Path, tmp_path: Path
                                                        ) -> None:
    """A Hub cache laid out as huggingface_hub writes it (models--owner--name, a snapshot and
    refs/main) serves ``--model owner/name`` with HF_HUB_OFFLINE=1; an id not in the cache is
    one clear line."""
    from linserve.model.checkpoint_path import resolve
    from linserve.model.interface import CheckpointError

    repo = tmp_path / "hub" / "models--acme--qwen-tiny"
    shutil.copytree(checkpoint, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    code = ("import sys; from linserve.model.checkpoint_path import resolve; "
            "print(resolve(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, "acme/qwen-tiny"], cwd=ROOT, text=True,
                         capture_output=True, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve() == (repo / "snapshots" / "0123abc").resolve()
    proc = _start("acme/missing", env)
    assert proc.returncode != 0 and "not found in the local Hugging Face cache" in proc.stderr
    with pytest.raises(CheckpointError):
        resolve("not a repo id at all/x/y")
