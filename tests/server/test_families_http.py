"""Each Hugging Face family built on the shared layers, served through HTTP
(``linserve serve --model``): greedy output equal to transformers' ``generate`` through the
openai SDK, the prefix cache, streaming, ``n`` / ``best_of`` / logprobs, ragged batches,
sessions with fork and export/import, structured outputs, and int8 / int4 weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from bench.serverproc import ROOT, ServerProcess
from tests.model.family_fixtures import SHAPES, make, reference
from tests.reliability.helpers import FULL

pytestmark = pytest.mark.integration
pytest.importorskip("transformers")
# one shape a family through HTTP, and Granite and Nemotron-H both dense and with experts
# (every shape is checked against transformers in tests/model/test_families.py)
SERVED = [(family, sorted(shapes)[0]) for family, shapes in SHAPES.items()]
SERVED.insert(SERVED.index(("granitemoehybrid", "moe-e5k2")) + 1, ("granitemoehybrid", "nope-g1"))
SERVED.insert(SERVED.index(("nemotron_h", "a-g2")) + 1, ("nemotron_h", "moe-e8k2-g4"))


@pytest.fixture(scope="module", params=SERVED, ids=[f"{f}-{n}" for f, n in SERVED])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Path:
    family, name = request.param
    return make(tmp_path_factory.mktemp(f"http-{family}"), family, name)


def _server(checkpoint: Path, *args: str) -> ServerProcess:
    return ServerProcess.serving(checkpoint, "--served-model-name", "tiny", *args)


@pytest.fixture(scope="module")
def srv(checkpoint: Path) -> Iterator[ServerProcess]:
    with _server(checkpoint) as s:
        yield s


def test_greedy_continuations_equal_transformers_generate(checkpoint: Path,
                                                          srv: ServerProcess) -> None:
    """64 greedy tokens for three prompts, through the openai SDK, token for token."""
    from openai import OpenAI

    ref = reference(checkpoint)
    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    for prompt in ("ROMEO.\n", "To be, or not to be", "Enter a Messenger."):
        ids = httpx.post(srv.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                eos_token_id=None)[0, len(ids):].tolist()
        out = client.completions.create(model="tiny", prompt=ids, max_tokens=64,
                                        temperature=0, logprobs=0, extra_body={
                                            "ignore_eos": True,
                                            "return_tokens_as_token_ids": True})
        assert out.choices[0].logprobs is not None
        got = [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens or []]
        assert got == want


def test_health_and_models_name_the_family(checkpoint: Path, srv: ServerProcess) -> None:
    family = json.loads((checkpoint / "config.json").read_text())["model_type"]
    family = family.removesuffix("_text")  # a text model names its family
    health = httpx.get(srv.url + "/health").json()
    model = httpx.get(srv.url + "/v1/models").json()["data"][0]
    assert health["status"] == "ok"
    assert health["architecture"] == model["architecture"]
    assert model["architecture"].startswith(family)
    assert model["state_bytes"] > 0 and model["weight_bytes"] > 0


def test_prefix_cache_streaming_n_best_of_and_logprobs(srv: ServerProcess) -> None:
    from openai import OpenAI

    c = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    prompt = " ".join(["Now is the winter of our discontent made glorious summer."] * 12)
    c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    longer = prompt + " Thus conscience does make cowards of us all."
    cached = c.completions.create(model="tiny", prompt=longer, max_tokens=16, temperature=0)
    details = cached.usage.prompt_tokens_details if cached.usage else None
    assert details is not None and (details.cached_tokens or 0) >= 100
    uncached = c.completions.create(model="tiny", prompt=longer, max_tokens=16,
                                    temperature=0, echo=True, logprobs=0)
    assert uncached.choices[0].text == longer + cached.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=longer, max_tokens=16, temperature=0, stream=True)
        if ch.choices)
    assert streamed == cached.choices[0].text
    many = c.completions.create(model="tiny", prompt="To be", max_tokens=8, n=3, seed=4,
                                best_of=4, logprobs=2)
    assert len(many.choices) == 3
    for choice in many.choices:
        assert choice.logprobs is not None and len(choice.logprobs.top_logprobs or []) >= 1


def _concurrent_equal_alone(url: str) -> None:
    """Eight prompts of different lengths sent together (one ragged prefill, decoded
    together) give the greedy and seeded texts each gives alone."""
    prompts = [("Enter Hamlet. " * n).strip() for n in (1, 3, 7, 12, 20, 2, 9, 30)]

    def one(k: int) -> str:
        body = {"prompt": prompts[k], "max_tokens": 12, "temperature": 0.0 if k % 2 else 0.9,
                "seed": k}
        out = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        return str(out["choices"][0]["text"])

    alone = [one(k) for k in range(len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(one, range(len(prompts))))
    assert together == alone


def test_concurrent_prompts_equal_each_alone(srv: ServerProcess) -> None:
    _concurrent_equal_alone(srv.url)


def test_sessions_fork_and_export_import_continue_like_stateless(srv: ServerProcess) -> None:
    """A session fed in two turns, forked, exported and imported, continues exactly as one
    stateless request over the same tokens."""
    def ids(text: str) -> list[int]:
        return list(httpx.post(srv.url + "/tokenize", json={"prompt": text}).json()["tokens"])

    with httpx.Client(base_url=srv.url, timeout=120) as c:
        sess = c.post("/v1/sessions", json={"prompt": "KING LEAR.\n"}).json()
        first = c.post("/v1/completions", json={
            "prompt": "Blow, winds", "session_id": sess["id"], "max_tokens": 10,
            "temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": True}).json()
        said = [int(t.split(":")[1]) for t in first["choices"][0]["logprobs"]["tokens"]]
        fork = c.post(f"/v1/sessions/{sess['id']}/fork").json()
        blob = c.get(f"/v1/sessions/{sess['id']}/state").content
        imported = c.post("/v1/sessions/import", content=blob,
                          headers={"content-type": "application/octet-stream"}).json()
        whole = ids("KING LEAR.\n") + ids("Blow, winds") + said + ids(" and crack")
        stateless = c.post("/v1/completions", json={"prompt": whole, "max_tokens": 12,
                                                     "temperature": 0}).json()
        for sid in (imported["id"], fork["id"], sess["id"]):
            cont = c.post("/v1/completions", json={"prompt": " and crack", "max_tokens": 12,
                                                    "session_id": sid, "temperature": 0}).json()
            assert cont["choices"][0]["text"] == stateless["choices"][0]["text"]


def test_structured_output(srv: ServerProcess) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "prompt": "A person:", "max_tokens": 80, "guided_json": schema, "seed": 1})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_weights_serve_batch_invariantly(checkpoint: Path, mode: str,
                                                   request: pytest.FixtureRequest) -> None:
    """Served with int8 or int4 weights: the health and models routes say so, and
    concurrent requests give what each gives alone. CI serves each family in one of the
    two, alternately (every server start is 12 s on two AVX2 cores, 44 of them were 9 min
    of CI; the products are the same for every family, tests/model/test_quantize.py);
    ``LINSERVE_FULL=1`` serves each in both."""
    index = SERVED.index(request.node.callspec.params["checkpoint"])
    if not FULL and mode != ("int8", "int4")[index % 2]:
        pytest.skip("CI serves each family in one quantization, alternately "
                    "(LINSERVE_FULL=1: both)")
    with _server(checkpoint, "--quantization", mode) as s:
        health = httpx.get(s.url + "/health").json()
        assert health["quantization"] == mode
        full = httpx.get(s.url + "/v1/models").json()["data"][0]
        assert full["quantization"] == mode
        _concurrent_equal_alone(s.url)


@pytest.mark.parametrize(("family", "change", "says"), [
    ("nemotron_h", {"mlp_hidden_act": "gelu"}, "mlp_hidden_act 'gelu' is not served"),
    ("nemotron_h", {"layers_block_type": ["linear_attention", "moe"], "n_routed_experts": 6,
                    "n_group": 4}, "cannot route 6 experts in 4 groups"),
    ("granitemoehybrid", {"num_local_experts": 7}, "the config implies"),
    ("lfm2_moe", {"num_experts_per_tok": 12}, "top_k 12 is not in 1..6 experts"),
    ("lfm2", {"num_attention_heads": 5}, "hidden_size is not a multiple"),
    ("falcon_h1", {"mamba_n_heads": 5}, "mamba_n_heads"),
    ("mamba", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not served"),
    ("mamba2", {"num_heads": 5}, "num_heads × head_dim is not expand × hidden_size"),
    ("bamba", {"mamba_n_heads": 5}, "mamba_n_heads × mamba_d_head"),
    ("jamba", {"hidden_act": "relu"}, "hidden_act 'relu' is not served"),
    ("zamba2", {"use_shared_attention_adapter": True},
     "attention adapters need num_key_value_heads = num_attention_heads"),
    ("recurrent_gemma", {"hidden_activation": "relu"}, "hidden_activation 'relu' is not served"),
    ("lfm3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}},
     "rope_type 'yarn' is not served"),
    ("minimax", {"sliding_window": 32}, "sliding_window is not served for MiniMax"),
    ("kimi_linear", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not served"),
    ("bailing_hybrid", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 6e6}},
     "rope_type 'yarn' is not served"),
    ("olmo_hybrid", {"linear_num_value_heads": 4},
     "linear_num_value_heads 4 is not a multiple of linear_num_key_heads 3"),
])
def test_an_unserved_or_bad_config_gets_one_line(tmp_path: Path, family: str,
                                                 change: dict, says: str) -> None:
    import subprocess
    import sys

    path = make(tmp_path / family, family, sorted(SHAPES[family])[0])
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    proc = subprocess.run([sys.executable, "-m", "linserve", "serve", "--model", str(path),
                           "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and says in lines[0], proc.stderr
