"""The sparse mixture of experts (``linserve/model/layers/moe.py``): only the chosen experts run,
rows that choose different experts are batch-invariant, ties go where transformers sends
them, stacked expert tensors load like one-by-one ones, and the router stays fp32 and
unquantized. Exactness against transformers per family is in ``test_families.py``."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from linserve.model import kernels, loader, packing
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.moe import ExpertsSpec, RouterSpec, SparseMoE
from linserve.model.served import ServedModule
from linserve.model.state import State
from tests.model.family_fixtures import VOCAB, make

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make(tmp_path_factory.mktemp("qwen-moe"), "qwen3_5_moe", "e8k2-tied")


def _served(path: Path, dtype: str = "float32", quantization: str = "none") -> ServedModule:
    model = loader.load(path, dtype, quantization=quantization)
    assert isinstance(model, ServedModule)
    return model


class _Calls:
    """Counts each expert's forward calls and the rows it ran on, per MoE layer."""

    def __init__(self, model: ServedModule) -> None:
        self.rows: Counter[tuple[int, int]] = Counter()
        self.calls: Counter[tuple[int, int]] = Counter()
        self.chosen: dict[int, torch.Tensor] = {}
        self._undo: list[tuple[SwiGLU, object]] = []
        moes = [m for m in model.module.modules() if isinstance(m, SparseMoE)]
        for li, moe in enumerate(moes):
            for e, expert in enumerate(moe.experts):
                self._wrap(expert, li, e)
            self._wrap_route(moe, li)

    def _wrap(self, expert: SwiGLU, li: int, e: int) -> None:
        inner = expert.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            self.calls[li, e] += 1
            self.rows[li, e] += x.shape[0]
            return inner(x)

        expert.forward = forward  # type: ignore[method-assign]

    def _wrap_route(self, moe: SparseMoE, li: int) -> None:
        inner = moe.route

        def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            w, c = inner(x)
            self.chosen[li] = c
            return w, c

        moe.route = route  # type: ignore[method-assign]

    def clear(self) -> None:
        self.rows.clear()
        self.calls.clear()


@pytest.fixture
def counted(qwen_moe: Path, monkeypatch: pytest.MonkeyPatch
            ) -> Iterator[tuple[ServedModule, _Calls]]:
    """The model with its PyTorch MoE form counted (the native form runs in C++)."""
    monkeypatch.setattr(SparseMoE, "native", False)
    model = _served(qwen_moe)
    yield model, _Calls(model)


def test_a_step_runs_only_the_chosen_experts_once_each(
        counted: tuple[ServedModule, _Calls]) -> None:
    """The eager step (the native one's reference, and the step without the kernels).
    Batch 1: top-k experts run per MoE layer, no other. Batch 4: every chosen expert runs
    once, on all the rows that chose it (grouped by expert)."""
    model, calls = counted
    step = model.module.step_eager
    gen = torch.Generator().manual_seed(1)
    _, state = model.prefill(torch.randint(0, VOCAB, (1, 9), generator=gen))
    calls.clear()
    step(torch.tensor([5]), state)
    top_k = 2
    layers = {li for li, _ in calls.calls}
    assert layers and all(sum(n for (li, _), n in calls.calls.items() if li == layer) == top_k
                          for layer in layers)
    rows = [model.prefill(torch.randint(0, VOCAB, (1, n), generator=gen))[1]
            for n in (3, 17, 40, 8)]
    batch = State.cat(rows)
    calls.clear()
    step(torch.tensor([1, 2, 3, 4]), batch)
    for li, chosen in calls.chosen.items():
        used = Counter(chosen.flatten().tolist())
        assert {e: calls.calls[li, e] for e in used} == dict.fromkeys(used, 1)
        assert {e: calls.rows[li, e] for e in used} == dict(used)
        assert sum(n for (layer, _), n in calls.calls.items() if layer == li) == len(used)


def test_rows_choosing_different_experts_are_bit_equal_alone(
        counted: tuple[ServedModule, _Calls]) -> None:
    """Both steps, eager (whose routes show the rows chose differently) and native."""
    model, calls = counted
    gen = torch.Generator().manual_seed(2)
    rows = [model.prefill(torch.randint(0, VOCAB, (1, n), generator=gen))[1]
            for n in (5, 31, 64, 12)]
    nxt = torch.randint(0, VOCAB, (4, 6), generator=gen)
    assert model.info.decode_step.startswith("fused")
    differed = False
    for step in (model.module.step_eager, model.module.step):
        alone = [r.copy() for r in rows]
        batch = State.cat([r.copy() for r in rows])
        for t in range(6):
            calls.chosen.clear()
            together = step(nxt[:, t], batch)
            routes = {li: c.sort(-1).values for li, c in calls.chosen.items()}
            differed |= any(len({tuple(r.tolist()) for r in c}) > 1 for c in routes.values())
            for i, row in enumerate(alone):
                assert torch.equal(together[i], step(nxt[i : i + 1, t], row)[0])
    assert differed  # the rows did choose different experts (the eager step's routes)


def test_ties_go_to_the_experts_transformers_chooses() -> None:
    """Two router rows equal (an exact tie between two experts in every token's scores):
    the same experts chosen, and the same output, as transformers' block."""
    t = pytest.importorskip("transformers")
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as ref_mod

    cfg = t.Qwen3_5MoeTextConfig(hidden_size=32, num_experts=6, num_experts_per_tok=2,
                                 moe_intermediate_size=24, shared_expert_intermediate_size=16)
    torch.manual_seed(3)
    ref = ref_mod.Qwen3_5MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
        ref.gate.weight[4] = ref.gate.weight[1]  # experts 1 and 4 tie for every token
    ours = SparseMoE(32, 24, RouterSpec(6, 2), shared=16, shared_gate=True).eval()
    state = {"gate.weight": ref.gate.weight, "shared_expert_gate.weight":
             ref.shared_expert_gate.weight,
             **{f"shared_expert.{n}": p for n, p in ref.shared_expert.state_dict().items()}}
    gu, down = ref.experts.gate_up_proj, ref.experts.down_proj
    for e in range(6):
        state[f"experts.{e}.gate_proj.weight"] = gu[e, :24]
        state[f"experts.{e}.up_proj.weight"] = gu[e, 24:]
        state[f"experts.{e}.down_proj.weight"] = down[e]
    ours.load_state_dict({k: v.detach().clone() for k, v in state.items()})
    x = torch.randn(1, 40, 32)
    with torch.no_grad():
        want = ref(x)
        _, _, ref_chosen = ref.gate(x.view(-1, 32))
    got = ours(x)
    _, chosen = ours.route(x.view(-1, 32))
    decided = (ref_chosen == 1).any(-1) ^ (ref_chosen == 4).any(-1)
    assert decided.any()  # tokens where the tie decided which of the two was chosen
    assert torch.equal(chosen, ref_chosen)
    assert (got - want).abs().max().item() <= 1e-5


NATIVE_FORMS = {
    "qwen": dict(spec=RouterSpec(6, 2), shared=16, shared_gate=True),
    "lfm2": dict(spec=RouterSpec(7, 3, "sigmoid", norm_eps=1e-6, scaling=1.5,
                                 expert_bias=True)),
    "granite": dict(spec=RouterSpec(5, 2, "softmax_topk"), shared=20),
    "nemotron-groups": dict(spec=RouterSpec(8, 2, "sigmoid", groups=4, topk_groups=2,
                                            expert_bias=True), shared=12,
                            form=ExpertsSpec("relu2")),
    "nemotron-latent": dict(spec=RouterSpec(6, 3, "sigmoid", norm_topk=False, scaling=2.5),
                            form=ExpertsSpec("relu2", latent=16)),
}


@pytest.mark.skipif(not kernels.load(), reason="needs the native kernels")
@pytest.mark.parametrize("form", sorted(NATIVE_FORMS))
def test_the_native_moe_computes_the_pytorch_form(form: str) -> None:
    """Every router and expert form through ``moe_forward`` (moe.h, the prefill's path)
    against the PyTorch form (the reference): one token and a 37-token prompt within fp32
    rounding; each token's output bit-equal to the token alone (batch-invariant); bf16
    weights within bf16's error of the fp32 reference, but for a token whose near-tied
    experts swap in bf16 (1 in 37 for the grouped router, as in the PyTorch form)."""
    torch.manual_seed(5)
    ours = SparseMoE(32, 24, **NATIVE_FORMS[form]).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.4)
        for b in ours.buffers():
            b.normal_(0, 0.4)
    x = torch.randn(37, 32)
    assert ours.native_args() is not None
    with torch.inference_mode():
        native = ours(x)
        ours.native = False
        eager = ours(x)
        ours.native = True
        assert (native - eager).abs().max().item() <= 1e-5 * eager.abs().max().item()
        alone = torch.cat([ours(x[i : i + 1]) for i in range(x.shape[0])])
        assert torch.equal(alone, native)
        ours.to(torch.bfloat16)
        low = ours(x.bfloat16()).float()
    err = (low - eager).abs().amax(-1) / eager.abs().amax(-1)  # per token
    assert err.median().item() <= 0.01
    assert (err > 0.05).float().mean().item() <= 0.05


@pytest.mark.parametrize("family, shape, stacks, count", [
    ("lfm2_moe", "e6k2-tied", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)},
     "num_experts"),
    ("nemotron_h", "moe-e6k3-latent", {"up_proj": ("up_proj",), "down_proj": ("down_proj",)},
     "n_routed_experts")])
def test_stacked_experts_load_like_one_by_one(tmp_path: Path, family: str, shape: str,
                                              stacks: dict[str, tuple[str, ...]],
                                              count: str) -> None:
    """The same weights with experts one by one (``experts.{e}.w1``; Nemotron-H's published
    ``experts.{e}.up_proj``) and stacked (``experts.gate_up_proj [E, 2I, d]`` or
    ``experts.up_proj [E, I, d]``, and ``experts.down_proj [E, d, I]``): the same logits,
    bit for bit."""
    path = make(tmp_path / "one", family, shape)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (stacked / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(path / "model.safetensors"))
    experts = json.loads((path / "config.json").read_text())[count]
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for prefix in sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k}):
        for name, parts in stacks.items():
            out[f"{prefix}.experts.{name}"] = torch.stack([torch.cat(
                [tensors[f"{prefix}.experts.{e}.{part}.weight"] for part in parts])
                for e in range(experts)])
    save_file(out, str(stacked / "model.safetensors"))
    tokens = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    a, _ = _served(path).prefill(tokens, all_logits=True)
    b, _ = _served(stacked).prefill(tokens, all_logits=True)
    assert torch.equal(a, b)


def test_group_limited_routing_chooses_as_transformers() -> None:
    """Nemotron-H's router (sigmoid, a correction bias, the best 2 of 4 groups of experts):
    the same experts and weights as transformers' for 200 tokens, among which some whose
    ungrouped top k would have differed (so the groups decided)."""
    t = pytest.importorskip("transformers")
    from transformers.models.nemotron_h import modeling_nemotron_h as ref_mod

    cfg = t.NemotronHConfig(hidden_size=32, n_routed_experts=12, num_experts_per_tok=3,
                            n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            layers_block_type=["moe"])
    torch.manual_seed(5)
    ref = ref_mod.NemotronHTopkRouter(cfg).eval()
    with torch.no_grad():
        ref.weight.normal_(0, 0.5)
        ref.e_score_correction_bias.uniform_(-0.3, 0.3)
    spec = RouterSpec(12, 3, scoring="sigmoid", norm_eps=1e-20, scaling=2.5, expert_bias=True,
                      groups=4, topk_groups=2)
    ours = SparseMoE(32, 8, spec, form=ExpertsSpec("relu2")).eval()
    ours.gate.weight.data.copy_(ref.weight)
    ours.gate.get_buffer("expert_bias").copy_(ref.e_score_correction_bias)
    x = torch.randn(200, 32)
    with torch.no_grad():
        _, want_w, want = ref(x)
    got_w, got = ours.route(x)
    order, want_order = got.argsort(-1), want.argsort(-1)
    assert torch.equal(got.gather(1, order), want.gather(1, want_order))
    assert (got_w.gather(1, order) - want_w.gather(1, want_order)).abs().max() <= 1e-6
    ungrouped = torch.topk(torch.sigmoid(x @ ref.weight.T) + ref.e_score_correction_bias, 3)[1]
    assert (ungrouped.sort(-1).values != got.sort(-1).values).any(-1).sum() > 0


def test_the_router_stays_fp32_and_unquantized(qwen_moe: Path) -> None:
    bf16 = _served(qwen_moe, "bfloat16")
    moe = next(m for m in bf16.module.modules() if isinstance(m, SparseMoE))
    assert moe.gate.weight.dtype == torch.float32
    assert next(moe.experts[0].parameters()).dtype == torch.bfloat16
    int8 = _served(qwen_moe, quantization="int8")
    moe = next(m for m in int8.module.modules() if isinstance(m, SparseMoE))
    router = packing.frozen(moe.gate)
    assert router is not None and router.dtype == torch.float32
    expert = packing.frozen(moe.experts[3])  # packed though no warm-up token chose it
    assert expert is not None and expert.dtype != torch.float32
    assert moe.experts[3].gate_proj.weight.untyped_storage().nbytes() <= 4  # released


def test_the_vision_language_wrapper_serves_its_text_model(tmp_path: Path) -> None:
    """``Qwen3_5MoeForConditionalGeneration``: its text model's logits match transformers'
    within 1e-4 (the vision tower is skipped)."""
    t = pytest.importorskip("transformers")
    from tests.model.family_fixtures import SHAPES, TOKENIZER, qwen_moe_fields

    torch.manual_seed(0)
    text = qwen_moe_fields(SHAPES["qwen3_5_moe"]["e8k2-tied"])
    full = t.Qwen3_5MoeConfig(text_config=text, tie_word_embeddings=True,
                              vision_config={"depth": 1, "hidden_size": 32,
                                             "intermediate_size": 64, "num_heads": 2,
                                             "out_hidden_size": text["hidden_size"]})
    ref = t.Qwen3_5MoeForConditionalGeneration(full).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(3.0 if p.dim() > 1 else 1.0)
    ref.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ref(input_ids=tokens).logits[0]
    ours = _served(tmp_path)
    assert ours.info.architecture.startswith("qwen3_5_moe")
    got, _ = ours.prefill(tokens, all_logits=True)
    assert (got[0] - want).abs().max().item() <= 1e-4


def test_loading_shows_its_progress_on_stderr(qwen_moe: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _served(qwen_moe)
    err = capsys.readouterr().err
    assert f"Loading {qwen_moe.name}" in err and "layer" in err


@pytest.mark.parametrize("family, shape", [("lfm2_moe", "e9k3-untied"),
                                           ("granitemoehybrid", "moe-e5k2"),
                                           ("nemotron_h", "moe-e8k2-g4")])
def test_the_native_step_breaks_ties_as_the_eager_step(tmp_path: Path, family: str,
                                                       shape: str) -> None:
    """Two router rows equal in every MoE layer (a tie between experts 1 and 4 in every
    token's scores): the whole-model native step (decoder_step.cpp, moe.h) chooses as the
    eager step does, so their logits agree within fp32 rounding."""
    path = make(tmp_path, family, shape)
    weights = load_file(path / "model.safetensors")
    routers = [n for n in weights if n.endswith(("feed_forward.gate.weight",
                                                 "router.layer.weight", "mixer.gate.weight"))]
    assert routers
    for name in routers:
        weights[name][4] = weights[name][1]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    module = _served(path).module
    assert module.native_plan() is not None
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (7, 19, 11, 30)]
    _, rows = module.prefill_ragged(prompts, [None] * 4)
    native, eager = State.cat(rows), State.cat(rows).copy()
    for t in range(6):
        tokens = torch.randint(0, VOCAB, (4,), generator=torch.Generator().manual_seed(50 + t))
        a, b = module.step(tokens, native), module.step_eager(tokens, eager)
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5
