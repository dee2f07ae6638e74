"""LFM2-VL reads images as transformers' ``Lfm2VlForConditionalGeneration`` does: the SigLIP2
tower and projector give the features of ``get_image_features`` for a single image, a tiled
one and its thumbnail; the whole model the same logits and greedy continuations for prompts
with no image, one and two, small and tiled. The processor's layout follows transformers'
rules (tiles, thumbnail, markers), checked on worked examples.

*Not checked against transformers:* the processor's pixels. Its ``Lfm2VlImageProcessor``
exists only for torchvision, and no torchvision wheel here loads with torch 2.13.0 (0.28.0,
0.29.0 and 0.29.1 stop at ``operator torchvision::nms does not exist``); the resize here is
the call torchvision makes for a uint8 image (``F.interpolate``, bilinear, antialiased)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from linserve.model import loader
from linserve.model.inputs import InsertTable
from linserve.model.served import ServedModule
from linserve.model.vision import lfm2_prep
from tests.model import lfm2_vl_fixtures as F

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(F.SHAPES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Path:
    return F.make(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> ServedModule:
    model = loader.load(checkpoint, "float32")
    assert isinstance(model, ServedModule)
    return model


@pytest.fixture(scope="module")
def ref(checkpoint: Path) -> Any:
    return F.reference(checkpoint)


SMALL, TALL, LARGE = F.picture(50, 60, 1), F.picture(200, 90, 2), F.picture(300, 250, 3)
CASES = {"none": [[5, 6, 7, 8]], "small": [[5, 6], SMALL, [7, 8, 9]],
         "tiled": [LARGE, [10, 11]], "two": [[4], TALL, [5, 6], LARGE, [7]]}


def test_the_layout_follows_transformers_rules() -> None:
    spec = lfm2_prep.Lfm2ImageSpec(placeholder=1, markers={
        m: i for i, m in enumerate(F.SPECIAL[1:], start=2)}, **{
        "patch": 16, "downsample": 2, "tile_size": 64, "min_image_tokens": 4,
        "max_image_tokens": 16, "min_tiles": 2, "max_tiles": 4})
    small = lfm2_prep.layout(spec, 50, 60)  # 64 × 64: 2 × 2 tokens
    assert (small.rows, small.cols, small.size, small.tokens) == (1, 1, (64, 64), 4 + 2)
    big = lfm2_prep.layout(spec, 300, 250)  # over 16 tokens × 2: tiles, 2 × 2 of 64 pixels
    assert (big.rows, big.cols) == (2, 2) and big.size == (128, 96)
    assert big.tokens == 1 + 4 * (1 + 4) + 1 + 12 + 1  # start, tiles, thumbnail, end
    assert lfm2_prep.grid(spec, 100, 400) == (4, 1)  # wide: four columns
    published = lfm2_prep.Lfm2ImageSpec(placeholder=1)
    assert lfm2_prep.smart_resize(published, 1024, 768) == (576, 416)  # beta = sqrt(3)
    assert lfm2_prep.grid(published, 768, 1024) == (3, 2)  # 4 × 3 is 12 tiles, over 10


def test_features_equal_get_image_features(served: ServedModule, ref: Any) -> None:
    spec = served.info.image_spec
    for pic in (SMALL, LARGE):
        inputs = F.hf_inputs(spec, [pic])
        with torch.no_grad():
            want = torch.cat(list(ref.model.get_image_features(**inputs).pooler_output))
        _, _, inserts = F.build([pic], spec)
        rows = served.encoders()["image"].encode(inserts[0])
        image_rows = torch.tensor([t < 0 for t in lfm2_prep.layout(
            spec, *_size(pic)).sequence for _ in range(-t if t < 0 else 1)])
        assert (rows[image_rows] - want).abs().max().item() <= 1e-4


def _size(data: bytes) -> tuple[int, int]:
    from linserve.model.vision import images

    rgb = images.decode(data)
    return rgb.height, rgb.width


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_text_equal_transformers(served: ServedModule, ref: Any,
                                                   case: str) -> None:
    spec = served.info.image_spec
    segs = CASES[case]
    hf_ids, ours, inserts = F.build(segs, spec)
    pics = [s for s in segs if isinstance(s, bytes)]
    extra = F.hf_inputs(spec, pics) if pics else {}
    table = InsertTable()
    for item in inserts:
        table.add(item, served.encoders()["image"].encode(item))
    logits, state = served.prefill(torch.tensor([ours]), all_logits=True, inserts=table)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([hf_ids]), **extra).logits[0]
        gen = ref.generate(input_ids=torch.tensor([hf_ids]), **extra, max_new_tokens=6,
                           do_sample=False)
    assert (logits[0] - want).abs().max().item() <= 1e-4
    out, last = [], logits[0, -1]
    for _ in range(6):
        out.append(int(last.argmax()))
        last = served.step(torch.tensor([out[-1]]), state)[0]
    assert out == gen[0, len(hf_ids):].tolist()
