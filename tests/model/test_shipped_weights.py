"""The shipped checkpoints: they load, their configs round-trip, the linear model's
perplexity matches its model card, and the three forms agree on real weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from linserve.model.architectures.own_model import load_model
from linserve.model.own_config import ModelConfig
from linserve.model.sampling import SamplingParams
from linserve.model.tokenizer import Tokenizer
from linserve.model.training.evaluate import slice_perplexity

WEIGHTS = Path(__file__).resolve().parents[2] / "weights"
# the project's own checkpoints (a Hugging Face one, weights/qwen35-mtp, names its model_type)
SHIPPED = [d for d in sorted(WEIGHTS.glob("*")) if (d / "model.safetensors").exists()
           and "model_type" not in json.loads((d / "config.json").read_text())]

pytestmark = pytest.mark.skipif(not SHIPPED, reason="no shipped weights yet")


@pytest.mark.parametrize("weights", SHIPPED, ids=[d.name for d in SHIPPED])
def test_checkpoint_loads_and_config_round_trips(weights: Path, tmp_path: Path) -> None:
    cfg = ModelConfig.load(weights / "config.json")
    cfg.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == cfg
    assert json.loads((weights / "config.json").read_text()) == cfg.to_dict()
    model = load_model(weights)
    tok = Tokenizer.from_file(weights / cfg.tokenizer)
    assert tok.vocab_size == cfg.vocab_size
    assert model.n_params() > 1_000_000


def test_linear_perplexity_matches_model_card() -> None:
    """Perplexity on a fixed slice of the test split is within 2% of the card's figure
    (catches broken loading or a changed tokenizer)."""
    weights = WEIGHTS / "linear"
    card = (weights / "MODEL_CARD.md").read_text()
    expected = float(re.search(r"test-slice perplexity \| ([0-9.]+)", card).group(1))  # type: ignore[union-attr]
    assert slice_perplexity(weights) == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_greedy_is_deterministic_and_forms_agree(kind: str) -> None:
    weights = WEIGHTS / kind
    if not (weights / "model.safetensors").exists():
        pytest.skip("not shipped")
    model = load_model(weights)
    tok = Tokenizer.from_file(weights / "tokenizer.json")
    from linserve.model.generate import generate

    params = SamplingParams(temperature=0.0, max_tokens=40)
    first = "".join(generate(model, tok, "MACBETH.\n", params))
    assert first == "".join(generate(model, tok, "MACBETH.\n", params))
    ids = tok.encode("MACBETH.\nIs this a dagger which I see before me, the handle toward")
    x = torch.tensor([ids])
    with torch.no_grad():
        full = model(x)
    logits, state = model.prefill(x[:, :5])
    stepped = [logits]
    for t in range(5, x.shape[1]):
        stepped.append(model.step(x[:, t], state))
    got = torch.stack(stepped[1:], 1)
    assert (got - full[:, 5:]).abs().max().item() <= 1e-3
    assert (logits - full[:, 4]).abs().max().item() <= 1e-3


# the trained Qwen3.5s with an MTP layer: 7M parameters, and 45M (a step that reads its
# weights from memory, for the speculative-decoding figures)
QWEN_MTP = [WEIGHTS / "qwen35-mtp", WEIGHTS / "qwen35-mtp-45m"]


@pytest.mark.parametrize("folder", QWEN_MTP, ids=lambda p: p.name)
def test_the_trained_qwen_with_mtp_is_transformers_and_drafts_well(folder: Path) -> None:
    """weights/qwen35-mtp*: logits as transformers computes them (fp32), and its MTP layer's
    greedy drafts are kept often on held-out text (random weights keep almost none)."""
    if not (folder / "model.safetensors").exists():
        pytest.skip("not shipped")
    transformers = pytest.importorskip("transformers")
    from linserve.model import loader
    from linserve.server.engine.engine import Engine, EngineLimits
    from linserve.server.engine.types import GenerationRequest
    from linserve.server.speculative.config import SpeculativeConfig

    ours = loader.load(folder, "float32")
    ref = transformers.Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = ours.tokenizer()
    ids = torch.tensor([tok.encode("MACBETH.\nIs this a dagger which I see before me,")])
    with torch.no_grad():
        want = ref(ids).logits[0]
    got, _ = ours.prefill(ids, all_logits=True)
    assert (got[0] - want).abs().max().item() <= 1e-3
    config = SpeculativeConfig.model_validate({"method": "mtp", "num_speculative_tokens": 2,
                                               "adaptive": False})
    engine = Engine(ours, EngineLimits(max_running=4), lambda _: None, speculative=config)
    engine.submit(GenerationRequest("m", ids[0].tolist(), SamplingParams(
        temperature=0.0, max_tokens=48, ignore_eos=True)), lambda _: None)
    engine.iterate()  # takes the request in
    while engine.running or engine.waiting or engine.prefilling:
        engine.iterate()
    assert engine.spec is not None and engine.spec.drafted > 0
    assert engine.spec.accepted / engine.spec.drafted > 0.2
