"""Qwen3.5 reads images exactly as transformers does: the image processor (pinned to its PIL
backend) gives the same ``pixel_values`` and grids; the vision tower the same features as
``get_image_features``; and the whole model, with its multimodal rotary positions, the same
logits and greedy continuations as ``Qwen3_5ForConditionalGeneration`` for prompts with
zero, one and two images of several sizes, first, in the middle and last. A prompt split
inside an image, a ragged prefill after one, the native step, a saved state: all the same."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from linserve.model import loader, modes
from linserve.model.inputs import Insert
from linserve.model.layers import native_step
from linserve.model.served import ServedModule
from linserve.model.state import PositionEntry
from linserve.model.vision import images, qwen_prep
from tests.model.qwen_fixtures import IMAGE_IDS, make_checkpoint, reference
from tests.model.vision_fixtures import build, hf_processor, picture, table

pytest.importorskip("transformers")

SHAPES = [("i4-tied", "v1"), ("i2-untied", "v2")]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda p: f"{p[0]}-{p[1]}")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Path:
    text, tower = request.param
    return make_checkpoint(tmp_path_factory.mktemp(tower), text, vision=tower,
                           tokenizer="project")


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> ServedModule:
    model = loader.load(checkpoint, "float32")
    assert isinstance(model, ServedModule)
    return model


@pytest.fixture(scope="module")
def ref(checkpoint: Path) -> Any:
    return reference(checkpoint)


def _text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 7000, n).tolist()


IMAGE_CASES = {
    "none": [_text(1, 12)],
    "first": [picture(100, 180, 1), _text(2, 9)],
    "middle": [_text(3, 7), picture(200, 90, 2), _text(4, 5)],
    "last": [_text(5, 6), picture(64, 64, 3)],
    "two": [_text(6, 4), picture(150, 150, 4), _text(7, 3), picture(300, 120, 5), _text(8, 6)],
}


@pytest.mark.parametrize("size", [(100, 180), (200, 90), (33, 500), (600, 400), (20, 20)])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_the_processor_equals_transformers(checkpoint: Path, served: ServedModule,
                                           size: tuple[int, int], mode: str) -> None:
    data = picture(*size, seed=sum(size), mode=mode)
    spec = served.info.image_spec
    want = hf_processor(checkpoint)(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    prepared = qwen_prep.prepare(spec, images.decode(data))
    values, grid = qwen_prep.patches(spec, qwen_prep.unpack(prepared.payload))
    assert np.array_equal(values, want["pixel_values"])
    assert [1, *grid] == want["image_grid_thw"][0].tolist()
    assert prepared.tokens == values.shape[0] // spec.merge ** 2


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF"])
def test_every_format_is_read_as_pil_reads_it(fmt: str) -> None:
    data = picture(40, 70, 9, fmt)
    got = images.decode(data)
    want = Image.open(io.BytesIO(data)).convert("RGB")
    assert (got.width, got.height) == want.size and got.pixels == want.tobytes()


def test_bad_images_are_refused_with_a_reason() -> None:
    data = picture(40, 70, 9)
    with pytest.raises(images.ImageError, match="not a PNG"):
        images.decode(b"hello, world")
    with pytest.raises(images.ImageError, match="corrupt or truncated"):
        images.decode(data[: len(data) // 2])
    with pytest.raises(images.ImageError, match="more than the limit"):
        images.decode(data, max_pixels=1000)
    with pytest.raises(images.ImageError, match="aspect ratio"):
        qwen_prep.smart_resize(10, 2100, 32, 64, 10**6)


def test_image_features_equal_get_image_features(checkpoint: Path, served: ServedModule,
                                                 ref: Any) -> None:
    pics = [picture(100, 180, 1), picture(300, 120, 5)]
    proc = hf_processor(checkpoint)(images=[Image.open(io.BytesIO(p)) for p in pics],
                                    return_tensors="pt")
    with torch.no_grad():
        want = ref.model.get_image_features(proc["pixel_values"],
                                            proc["image_grid_thw"]).pooler_output
    encoder, spec = served.encoders()["image"], served.info.image_spec
    for data, expected in zip(pics, want, strict=True):
        prepared = qwen_prep.prepare(spec, images.decode(data))
        got = encoder.encode(Insert("image", 0, prepared.tokens, "x", prepared.payload,
                                    prepared.grid))
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= 1e-4


def _greedy(served: ServedModule, logits: torch.Tensor, state: Any, n: int) -> list[int]:
    out, last = [], logits
    for _ in range(n):
        out.append(int(last.argmax()))
        last = served.step(torch.tensor([out[-1]]), state)[0]
    return out


@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
def test_logits_and_greedy_text_equal_transformers(checkpoint: Path, served: ServedModule,
                                                   ref: Any, case: str) -> None:
    prompt = build(IMAGE_CASES[case], served.info.image_spec, IMAGE_IDS["project"], checkpoint)
    tab = table(served.encoders()["image"], prompt.inserts)
    logits, state = served.prefill(torch.tensor([prompt.ours]), all_logits=True, inserts=tab)
    with torch.no_grad():
        want = ref(**prompt.hf_inputs).logits[0]
        gen = ref.generate(**prompt.hf_inputs, max_new_tokens=6, do_sample=False)
    assert (logits[0] - want).abs().max().item() <= 1e-4
    assert _greedy(served, logits[0, -1], state, 6) == gen[0, len(prompt.hf_ids):].tolist()


@pytest.mark.parametrize("split", [1, 5, 11, 20])
def test_a_prompt_split_inside_an_image_answers_as_whole(checkpoint: Path,
                                                         served: ServedModule, split: int
                                                         ) -> None:
    prompt = build(IMAGE_CASES["two"], served.info.image_spec, IMAGE_IDS["project"], checkpoint)
    tab = table(served.encoders()["image"], prompt.inserts)
    ids = torch.tensor([prompt.ours])
    whole, full = served.prefill(ids, all_logits=True, inserts=tab)
    first, state = served.prefill(ids[:, :split], all_logits=True, inserts=tab)
    rest, state = served.prefill(ids[:, split:], state, all_logits=True, inserts=tab)
    assert (torch.cat([first, rest], 1) - whole).abs().max().item() <= 1e-4
    assert _offsets(state) == _offsets(full) != [0]


def _offsets(state: Any) -> list[int]:
    return next(e for e in state.entries() if isinstance(e, PositionEntry)).offset.tolist()


def test_text_after_an_image_ragged_native_and_saved(served: ServedModule, checkpoint: Path
                                                     ) -> None:
    """After an image, a ragged prefill, the native step and a state read back from bytes
    continue at the image's positions."""
    prompt = build(IMAGE_CASES["middle"], served.info.image_spec, IMAGE_IDS["project"],
                   checkpoint)
    tab = table(served.encoders()["image"], prompt.inserts)
    _, state = served.prefill(torch.tensor([prompt.ours]), inserts=tab)
    more = _text(11, 5)
    want, _ = served.prefill(torch.tensor([more]), state)
    ragged, _ = served.prefill_ragged([more, more[:2]], [state, served.new_state()])
    assert (ragged[0] - want[0]).abs().max().item() <= 1e-4
    plan = served.module.native_plan()
    if plan is not None:
        a, b = state.copy(), state.copy()
        a.reserve(int(a.lengths[0]) + 1)
        native = native_step.step(plan, torch.tensor([more[0]]), a)
        eager = served.module.step_eager(torch.tensor([more[0]]), b)
        assert native is not None and (native - eager).abs().max().item() <= 1e-4
    back, _ = served.state_from_bytes(served.state_to_bytes(state))
    assert _offsets(back) == _offsets(state) != [0]
    again, _ = served.prefill(torch.tensor([more]), back)
    assert torch.equal(again, want)


def test_limit_zero_leaves_the_tower_unread(checkpoint: Path) -> None:
    modes.set_images(False)
    try:
        model = loader.load(checkpoint, "float32")
    finally:
        modes.set_images(True)
    assert model.info.input_kinds == () and model.info.image_spec is None
    assert isinstance(model, ServedModule) and model.module.visual is None


def test_processor_limits_override_the_checkpoints(checkpoint: Path) -> None:
    modes.set_images(True, {"max_pixels": 64 * 64})
    try:
        model = loader.load(checkpoint, "float32", weights=False)
    finally:
        modes.set_images(True)
    spec = model.info.image_spec
    assert spec.max_pixels == 64 * 64
    assert qwen_prep.prepare(spec, images.decode(picture(300, 300, 1))).tokens == 4
    assert json.loads((checkpoint / "preprocessor_config.json").read_text())["size"][
        "longest_edge"] == 256 * 256
