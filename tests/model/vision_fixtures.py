"""Images and prompts for the vision-language tests: random pictures in every format the
server reads, and a prompt of text and images built both ways, as transformers takes it
(placeholders, ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``) and as this
server does (virtual ids and :class:`~linserve.model.inputs.Insert` items)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from linserve.model.inputs import Insert, InsertTable, mark
from linserve.model.vision import images, qwen_prep
from linserve.model.vision.qwen_prep import QwenImageSpec

# a prompt: token ids and images (encoded files), in order
Segment = list[int] | bytes


def picture(height: int, width: int, seed: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """A random ``width × height`` picture as a ``fmt`` file (``mode``: RGB, RGBA, L, P)."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "P": 1}[mode]
    arr = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if channels == 1 else arr,
                          "L" if channels == 1 else mode)
    if mode == "P":
        img = img.convert("P")
    out = io.BytesIO()
    img.save(out, fmt)
    return out.getvalue()


def hf_processor(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    proc = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil
    return proc.from_pretrained(path)


@dataclass
class BuiltPrompt:
    """One prompt both ways."""

    hf_ids: list[int]
    ours: list[int]
    inserts: list[Insert]
    hf_inputs: dict[str, Any]


def build(segments: list[Segment], spec: QwenImageSpec, ids: dict[str, int], path: Path
          ) -> BuiltPrompt:
    """``segments`` as transformers' processor and this server's would give them (each
    image wrapped in vision start / end tokens, as Qwen's chat template writes it)."""
    hf_ids: list[int] = []
    inserts: list[Insert] = []
    pictures = []
    for seg in segments:
        if isinstance(seg, bytes):
            prepared = qwen_prep.prepare(spec, images.decode(seg))
            hf_ids.append(ids["vision_start_token_id"])
            inserts.append(Insert("image", len(hf_ids), prepared.tokens,
                                  images.digest(images.decode(seg)), prepared.payload,
                                  prepared.grid))
            hf_ids += [spec.placeholder] * prepared.tokens + [ids["vision_end_token_id"]]
            pictures.append(Image.open(io.BytesIO(seg)))
        else:
            hf_ids += seg
    inputs: dict[str, Any] = {"input_ids": torch.tensor([hf_ids])}
    if pictures:
        proc = hf_processor(path)(images=pictures, return_tensors="pt")
        inputs.update(pixel_values=proc["pixel_values"], image_grid_thw=proc["image_grid_thw"],
                      mm_token_type_ids=(inputs["input_ids"] == spec.placeholder).int())
    return BuiltPrompt(hf_ids, mark(hf_ids, inserts), inserts, inputs)


def table(encoder: Any, inserts: list[Insert]) -> InsertTable:
    out = InsertTable()
    for item in inserts:
        out.add(item, encoder.encode(item))
    return out
