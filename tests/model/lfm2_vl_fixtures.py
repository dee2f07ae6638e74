"""Tiny random LFM2-VL checkpoints (transformers' ``Lfm2VlForConditionalGeneration``) with
the project's tokenizer plus LFM2-VL's image tokens, a small processor config (64-pixel
tiles of 16-pixel patches), and an LFM2-VL-like chat template; and a prompt built both ways,
as transformers' model takes it (``pixel_values`` padded, ``pixel_attention_mask``,
``spatial_shapes``, each image's tokens expanded) and as this server does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from linserve.model.inputs import Insert, mark
from linserve.model.vision import images, lfm2_prep
from linserve.model.vision.siglip2_tower import patches_of, pieces
from tests.model.family_fixtures import TOKENIZER

VOCAB = 8320  # the project's 8,192 ids and LFM2-VL's image tokens after them
SPECIAL = ["<image>", *lfm2_prep.MARKERS,
           *(f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11))]
PROCESSOR = {"encoder_patch_size": 16, "downsample_factor": 2, "tile_size": 64,
             "min_image_tokens": 4, "max_image_tokens": 16, "min_tiles": 2, "max_tiles": 4,
             "use_thumbnail": True, "do_image_splitting": True, "max_pixels_tolerance": 2.0,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}"
            "{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == 'text' %}"
            "{{ p.text }}{% elif p.type in ('image', 'image_url') %}<image>{% endif %}"
            "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPES: dict[str, dict[str, Any]] = {
    "s1": {"vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "num_patches": 16},
           "projector": 48, "types": ["conv", "full_attention", "conv"]},
    "s2": {"vision": {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
                      "num_attention_heads": 3, "num_patches": 64},
           "projector": 40, "types": ["full_attention", "conv", "conv", "full_attention"]},
}


def write_tokenizer(path: Path) -> dict[str, int]:
    """The project's tokenizer with LFM2-VL's image tokens added; returns their ids."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tok.save(str(path / "tokenizer.json"))
    return {t: int(tok.token_to_id(t)) for t in SPECIAL}


def make(path: Path, name: str, seed: int = 0) -> Path:
    t = pytest.importorskip("transformers")
    shape = SHAPES[name]
    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path)
    text = t.Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=len(shape["types"]), layer_types=shape["types"],
                        num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=4096, block_multiple_of=32)
    cfg = t.Lfm2VlConfig(text_config=text.to_dict(), vision_config={
        **shape["vision"], "patch_size": 16, "vision_use_head": False,
        "model_type": "siglip2_vision_model"}, image_token_id=ids["<image>"],
        projector_hidden_size=shape["projector"], downsample_factor=2)
    torch.manual_seed(seed)
    model = t.Lfm2VlForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0 if p.dim() > 1 else 1.0)
    model.eval().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return path


def reference(path: Path) -> Any:
    t = pytest.importorskip("transformers")
    return t.Lfm2VlForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def picture(height: int, width: int, seed: int) -> bytes:
    import io

    arr = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(arr).save(out, "PNG")
    return out.getvalue()


def hf_inputs(spec: lfm2_prep.Lfm2ImageSpec, pics: list[bytes]) -> dict[str, torch.Tensor]:
    """``pixel_values`` ``[pieces, max patches, 3·P·P]`` padded with zeros,
    ``pixel_attention_mask`` and ``spatial_shapes``, as transformers' processor lays them out
    (each image's tiles row-major, then its thumbnail)."""
    rows, shapes = [], []
    for data in pics:
        rgb = images.decode(data)
        arr = np.frombuffer(rgb.pixels, np.uint8).reshape(rgb.height, rgb.width, 3)
        pix = torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()
        for piece in pieces(spec, pix, lfm2_prep.layout(spec, rgb.height, rgb.width)):
            values, h, w = patches_of(spec, piece)
            rows.append(values)
            shapes.append((h, w))
    longest = max((spec.tile_size // spec.patch) ** 2, spec.max_image_tokens * 4)
    values = torch.zeros(len(rows), longest, rows[0].shape[1])
    mask = torch.zeros(len(rows), longest, dtype=torch.int32)
    for i, r in enumerate(rows):
        values[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = 1
    return {"pixel_values": values, "pixel_attention_mask": mask,
            "spatial_shapes": torch.tensor(shapes)}


def build(segments: list[list[int] | bytes], spec: lfm2_prep.Lfm2ImageSpec
          ) -> tuple[list[int], list[int], list[Insert]]:
    """A prompt of text and pictures: transformers' ids, ours (virtual ids) and the items."""
    hf_ids: list[int] = []
    inserts: list[Insert] = []
    for seg in segments:
        if isinstance(seg, bytes):
            rgb = images.decode(seg)
            lay = lfm2_prep.layout(spec, rgb.height, rgb.width)
            tokens, payload = lfm2_prep.prepare(spec, rgb)
            inserts.append(Insert("image", len(hf_ids), tokens, images.digest(rgb), payload,
                                  (1, tokens)))
            for t in lay.sequence:
                hf_ids += [spec.placeholder] * -t if t < 0 else [t]
        else:
            hf_ids += seg
    return hf_ids, mark(hf_ids, inserts), inserts

