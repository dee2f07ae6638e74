"""The native step's typed boundary: each kind of layer part is a dataclass in
``linserve/model/layers/step_parts.py`` and a struct in ``linserve/model/kernels/step_parts.h``
with the same fields in the same order, the same state count and snapshot rule; a plan whose
record names other fields fails when it is built, naming both lists."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from linserve.model.layers import step_parts
from tests.paths import ROOT

HEADER = ROOT / "linserve/model/kernels/step_parts.h"


def _structs() -> dict[str, dict[str, str]]:
    """Each C++ record struct's constants, by its kKind."""
    text = HEADER.read_text()
    out: dict[str, dict[str, str]] = {}
    for body in re.findall(r"struct \w+ \{(.*?)\n\};", text, re.S):
        consts = dict(re.findall(r"static constexpr [\w ]+?\*? ?(k\w+) =\s*(.*?);", body,
                                 re.S))
        if "kKind" in consts:
            fields = "".join(re.findall(r'"([^"]*)"', consts.get("kFields", "")))
            out[consts["kKind"].strip('"')] = {**consts, "kFields": fields}
    return out


def _parts() -> list[type[step_parts.NativePart]]:
    return [c for c in vars(step_parts).values() if isinstance(c, type)
            and issubclass(c, step_parts.NativePart) and c is not step_parts.NativePart]


def test_every_record_kind_has_one_struct_with_its_fields_in_order() -> None:
    structs = _structs()
    parts = _parts()
    assert {p.KIND for p in parts} == set(structs)
    for part in parts:
        names = [f.name for f in dataclasses.fields(part) if f.metadata.get("record", True)]
        c = structs[part.KIND]
        assert c["kFields"].split() == names, part.__name__
        if "kState" in c:
            assert int(c["kState"]) == part.STATE, part.__name__


def test_records_put_each_value_in_its_stream() -> None:
    records = step_parts.Records()
    t = torch.ones(3)
    empty = step_parts.EMPTY
    records.add(step_parts.Residual(t, empty, empty, empty, True, False, 1e-5, 0.0, 1.0, 2))
    assert records.kinds == ["residual"]
    assert records.fields == [
        "pre post pre_bias post_bias from_normed layer_norm pre_eps post_eps a b"]
    assert records.ints == [1, 0] and records.floats == [1e-5, 0.0, 1.0, 2.0]
    assert len(records.tensors) == 4


def test_a_plan_names_a_field_the_kernel_does_not_take() -> None:
    from linserve.model import kernels

    if not kernels.load():
        pytest.skip("native kernels unavailable")
    d, f = 32, 64
    records = step_parts.Records()
    empty = step_parts.EMPTY
    records.add(step_parts.Residual(torch.ones(d), empty, empty, empty, False, False, 1e-5, 0.0,
                                    1.0, 1.0))
    records.add(step_parts.SwiGLUPart(torch.randn(d, 2 * f), torch.randn(f, d)))
    head = [torch.randn(100, d), torch.randn(d, 100), torch.ones(d), empty]
    args = (head, [1e-5, 1.0, 1.0, 0.0], records.kinds, records.fields, records.tensors,
            records.ints, records.floats, [])
    plan = torch.classes.linserve.DecoderPlan(*args)
    assert plan.state_count() == 0
    bad = list(records.fields)
    bad[1] = "up gate_down"
    with pytest.raises(RuntimeError, match=r'"up gate_down" in Python but "gate_up down"'):
        torch.classes.linserve.DecoderPlan(head, [1e-5, 1.0, 1.0, 0.0], records.kinds, bad,
                                           records.tensors, records.ints, records.floats, [])
    with pytest.raises(RuntimeError, match="no layer part of kind conv9"):
        torch.classes.linserve.DecoderPlan(head, [1e-5, 1.0, 1.0, 0.0], ["residual", "conv9"],
                                           records.fields, records.tensors, records.ints,
                                           records.floats, [])
