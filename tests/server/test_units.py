"""Unit tests of small server pieces: session transcripts, CPU quota, kernel CPU levels,
chat stream trimming, and the engine's exact-session replays on a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linserve.model import kernels
from linserve.model.sampling import BatchParams, SamplingParams, sample
from linserve.model.tokenizer import Tokenizer
from linserve.server.api.formatting import StripStream
from linserve.server.sessions.transcript import chat_turn_text, common_prefix, session_tokens
from linserve.server.system.cpus import available_cpus, cgroup_cpu_limit


def test_session_tokens_keep_the_generated_prefix_and_retokenise_the_rest(tok: Tokenizer
                                                                           ) -> None:
    generated = tok.encode(" Good morrow, sir.\nUser: more")
    text = " Good morrow, sir."  # what the client got: the stop string "\nUser:" cut
    held = session_tokens(tok, generated, text)
    assert tok.decode(held) == text
    assert held == generated[: len(held)]  # here the cut falls on a token boundary
    assert session_tokens(tok, generated, tok.decode(generated)) == generated
    assert session_tokens(tok, generated, "") == []


def test_session_tokens_when_the_cut_falls_inside_a_token(tok: Tokenizer) -> None:
    generated = tok.encode(" Farewell")
    for cut in range(1, len(" Farewell")):
        held = session_tokens(tok, generated, " Farewell"[:cut])
        assert tok.decode(held) == " Farewell"[:cut]


def test_session_tokens_never_split_a_character(tok: Tokenizer) -> None:
    generated = tok.encode(" café au lait")
    held = session_tokens(tok, generated, " café")
    assert tok.decode(held) == " café"


def test_chat_turn_text_is_what_a_stateless_client_resends() -> None:
    assert chat_turn_text("  Hello there. \n") == " Hello there.\n"
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0


def test_strip_stream_equals_strip() -> None:
    for pieces in (["  ", " Hi", " there", "  ", "\n"], ["\n", "a", " ", "b ", " "], [" "],
                   ["x"]):
        trim = StripStream()
        assert "".join(trim.feed(p) for p in pieces) == "".join(pieces).strip()


def test_cgroup_quota_v2_and_v1(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    assert available_cpus(tmp_path) <= 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_limit(v1) == 1.0
    assert available_cpus(v1) == 1


def test_kernel_level_is_picked_from_cpu_flags(tmp_path: Path) -> None:
    both = ["x86-64", "x86-64-v3"]
    assert kernels.pick_arch(kernels.X86_64_V3_FLAGS | {"sse2"}, both) == "x86-64-v3"
    assert kernels.pick_arch(frozenset({"sse2", "avx"}), both) == "x86-64"
    assert kernels.pick_arch(frozenset(), ["x86-64-v3"]) is None
    three = ["x86-64-v4-bf16", "x86-64-v3", "x86-64"]
    assert kernels.pick_arch(kernels.X86_64_V4_BF16_FLAGS, three) == "x86-64-v4-bf16"
    assert kernels.pick_arch(kernels.X86_64_V4_FLAGS, three) == "x86-64-v3"  # no bf16 dots
    four = ["x86-64-v4-amx", *three]
    assert kernels.pick_arch(kernels.X86_64_V4_AMX_FLAGS, four) == "x86-64-v4-amx"
    assert kernels.pick_arch(kernels.X86_64_V4_BF16_FLAGS, four) == "x86-64-v4-bf16"
    info = tmp_path / "cpuinfo"
    info.write_text("processor: 0\nflags\t\t: fpu sse2 avx2\n")
    assert kernels.cpu_flags(info) == {"fpu", "sse2", "avx2"}


def test_eager_sampler_never_draws_a_masked_token_at_u_zero() -> None:
    """u = 0 used to land on token 0 even when min-p had masked it out."""
    logits = torch.tensor([[-10.0, 5.0, 4.0, -10.0]])
    bp = BatchParams.from_params([SamplingParams(temperature=1.0, min_p=0.5, top_k=3)])
    gen = torch.Generator()
    gen.manual_seed(0)
    orig = torch.rand

    def zero_rand(*args: object, **kw: object) -> torch.Tensor:
        return torch.zeros(1)

    torch.rand = zero_rand  # type: ignore[assignment]
    try:
        token = sample(logits, bp, [gen], native=False)
    finally:
        torch.rand = orig
    assert int(token[0]) == 1


def test_the_first_sampled_token_counts_for_the_repetition_penalty() -> None:
    from linserve.server.engine.pool import SlotPool
    from tests.model.helpers import served, tiny_model

    pool = SlotPool(served(tiny_model("linear")), 2)
    pool.add(pool.model.new_state(1), [3, 4], [7])
    assert bool(pool.seen[0, 7]) and float(pool.counts[0, 7]) == 1.0


@pytest.mark.parametrize("kind", ["softmax", "window"])
def test_a_kv_pool_grows_by_copying_its_live_rows_only(kind: str) -> None:
    """The pool's KV cache grows for every row at once; only the live rows are copied and
    zero-filled (the others are written whole when a sequence joins), and a joining row's
    slots past its own capacity read as zeros, so masked slots never hold garbage."""
    import torch

    from linserve.model.state import KVEntry
    from linserve.server.engine.pool import SlotPool
    from tests.model.helpers import served, tiny_model

    model = tiny_model(kind, max_context=512)
    pool = SlotPool(served(model), 4)
    _, short = model.prefill(torch.randint(0, 97, (1, 10)))
    pool.add(short, [], [1])
    state = pool.state
    kv = state.layers[0]["kv"]
    assert isinstance(kv, KVEntry)
    before = kv.k[0, :, :10].clone()
    state.lengths[0] = kv.capacity  # the live row needs one slot more than there is
    pool.reserve_step()
    assert torch.equal(kv.k[0, :, :10], before)
    assert not kv.k[0, :, kv.capacity // 2:].any()  # new slots: zeros
    kv.k[2].fill_(float("nan"))  # what an unwritten row may hold
    _, other = model.prefill(torch.randint(0, 97, (1, 5)))
    pool.add(other, [], [1])  # goes to slot 1
    pool.add(other, [], [1])  # slot 2, over the NaNs
    small = other.layers[0]["kv"]
    assert isinstance(small, KVEntry)
    assert not torch.isnan(kv.k[2]).any() and not kv.k[2, :, small.capacity:].any()



@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_the_pool_allocates_rows_as_sequences_join_and_gives_them_back(kind: str) -> None:
    """Rows are allocated as sequences join (doubling from 4) and given back when three
    quarters stand empty; live rows, their penalty counts and their next logits survive
    every reallocation."""
    import torch

    from linserve.server.engine.pool import SlotPool
    from tests.model.helpers import served, tiny_model

    model = tiny_model(kind, max_context=512)
    pool = SlotPool(served(model), 16)
    assert pool.rows == 4
    prompts = [torch.randint(0, 97, (1, 5 + i)) for i in range(11)]
    alone = []
    for i, p in enumerate(prompts):
        _, st = model.prefill(p)
        alone.append(model.step(torch.tensor([i]), st.copy()))
        pool.add(st, [], [i])
    assert pool.rows == 16 and pool.n == 11
    for _ in range(7):  # the last row moves into slot 0 each time
        pool.remove(0)
    assert pool.n == 4 and pool.rows == 8  # 4 ≤ 16 // 4: halved, and not again
    left = [4, 1, 2, 3]  # the sequence each slot now holds
    assert all(int(pool.counts[s, i]) == 1 for s, i in enumerate(left))
    logits = model.step(torch.tensor(left), pool.view())
    for slot, i in enumerate(left):
        assert torch.allclose(logits[slot], alone[i][0], atol=1e-5)
    while pool.n:
        pool.remove(0)
    assert pool.rows == 4


def test_the_pool_gives_back_a_long_prompts_kv_slots_when_it_leaves() -> None:
    """A long prompt's row grows every row's KV capacity; when it leaves, the caches are
    cut back to what the rows still there use (an idle pool held a 30k prompt's slots)."""
    import torch

    from linserve.server.engine.pool import SPARE_KV_SLOTS, SlotPool
    from tests.model.helpers import served, tiny_model

    model = tiny_model("softmax", max_context=4 * SPARE_KV_SLOTS)
    pool = SlotPool(served(model), 8)
    _, short = model.prefill(torch.randint(0, 97, (1, 20)))
    _, long = model.prefill(torch.randint(0, 97, (1, 2 * SPARE_KV_SLOTS)))
    pool.add(short, [], [])
    pool.add(long, [], [])
    kv = pool.state.kv_entries[0]
    assert kv.capacity >= 2 * SPARE_KV_SLOTS
    expect = model.step(torch.tensor([3]), short.copy())
    pool.remove(1)
    assert pool.state.kv_entries[0].capacity < 64
    assert torch.allclose(model.step(torch.tensor([3]), pool.view()), expect, atol=1e-6)


def test_loading_the_engine_model_freezes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """The objects the load makes are moved out of the collector's reach (``gc.freeze``),
    and from then on the heap keeps the engine's scratch (``heap.keep_scratch``: recorded
    here, so that this test process keeps glibc's defaults)."""
    import gc

    from linserve.server.engine import loading
    from linserve.server.settings import Settings

    kept: list[bool] = []
    monkeypatch.setattr(loading, "keep_scratch", lambda: kept.append(True) or True)
    gc.unfreeze()
    threads = torch.get_num_threads()  # the load sets the engine's
    try:
        model = loading.load_engine_model(Settings(weights=Path("weights/linear"), threads=1))
        assert model.info.params > 0 and gc.get_freeze_count() > 0 and kept == [True]
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)


def test_a_prelaunched_engine_checks_then_loads_on_the_command_lines_settings(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """``check_early``: the checkpoint checked on ``linserve serve``'s own arguments, quietly,
    its verdict the one line the HTTP process says (and the largest state an import may
    send); settings that do not parse are the HTTP process's to report. ``load_prepared``:
    the model loaded on them, served only where the server's settings agree."""
    from bench.serverproc import ROOT
    from linserve.server.engine import loading, sizing
    from linserve.server.settings import Settings

    linear, ungated = str(ROOT / "weights" / "linear"), str(ROOT / "weights" / "linear-ungated")

    threads = torch.get_num_threads()
    try:
        settings, problem, limit, described = loading.check_early(
            ["--model", linear, "--threads", "1"])
        assert settings is not None and problem is None and limit > 1 << 16
        assert described is not None and described.fingerprint()
        early = loading.load_prepared(settings)
        assert early is not None and early.model.info.params > 0
        assert early.serves(sizing.resolve_checkpoint(
            Settings(model=linear, threads=1, port=9999, max_running=3)))
        assert not early.serves(sizing.resolve_checkpoint(
            Settings(model=linear, threads=1, dtype="bfloat16")))
        assert not early.serves(sizing.resolve_checkpoint(
            Settings(model=ungated, threads=1)))
    finally:
        torch.set_num_threads(threads)
    capfd.readouterr()
    _, problem, _, _ = loading.check_early(["--model", "weights/no-such-model"])
    assert problem is not None and problem.startswith("cannot load weights/no-such-model")
    assert loading.check_early(["--no-such-flag"]) == (None, None, 0, None)
    _, problem, _, _ = loading.check_early(["--model", linear, "--speculative-config",
                                         '{"method": "draft_model", "model": "/nonexistent/x",'
                                         ' "num_speculative_tokens": 2}'])
    assert problem is not None and "/nonexistent/x" in problem
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_torchs_build_paths_are_kept_as_cpp_extension_gives_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' compiler flags need torch's include and library folders; they are
    kept under the cache root (importing ``cpp_extension`` took 1.2 s of every start)
    and read back the same."""
    import importlib

    from torch.utils import cpp_extension

    build = importlib.import_module("linserve.model.kernels.build")
    monkeypatch.setenv("LINSERVE_CACHE_DIR", str(tmp_path))
    want = (cpp_extension.include_paths(), cpp_extension.library_paths())
    assert build.torch_paths() == want
    assert len(list((tmp_path / "kernels").glob("torch-paths-*.json"))) == 1
    assert build.torch_paths() == want


def test_the_engine_takes_every_cpu_for_a_model_of_some_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--threads 0``: every CPU for weights of 64 MB or more (the 0.8B shapes decoded 1.7x
    faster on both of two cores), one left to the HTTP process for a model of a few MB;
    ``--threads N`` as given."""
    from linserve.server.engine import sizing
    from linserve.server.settings import Settings

    monkeypatch.setattr(sizing, "available_cpus", lambda: 4)
    auto = Settings(weights=Path("weights/linear"))
    assert sizing.engine_threads(auto, 600 << 20) == 4
    assert sizing.engine_threads(auto, 20 << 20) == 3
    assert sizing.engine_threads(Settings(weights=Path("weights/linear"), threads=2),
                                 600 << 20) == 2
    monkeypatch.setattr(sizing, "available_cpus", lambda: 1)
    assert sizing.engine_threads(auto, 20 << 20) == 1


def test_a_long_context_holds_no_spare_rows() -> None:
    """Past SPARE_KV_SLOTS a KV cache's spare rows would each hold the longest context: the
    pool keeps at most a quarter of its live rows spare then (one long prompt: one row's KV,
    not the floor's four), grows by a quarter as sequences join, and its rows still step as
    each alone."""
    import torch

    from linserve.server.engine.pool import MIN_ROWS, SPARE_KV_SLOTS, SlotPool
    from tests.model.helpers import served, tiny_model

    model = tiny_model("softmax", max_context=4096)
    pool = SlotPool(served(model), 8)
    _, short = model.prefill(torch.randint(0, 97, (1, 10)))
    pool.add(short, [], [1])
    assert pool.rows == MIN_ROWS
    pool.state.lengths[0] = SPARE_KV_SLOTS + 100  # the row's context grows long
    pool.reserve_step()
    kv = pool.state.kv_entries[0]
    assert pool.rows == 1 and kv.capacity > SPARE_KV_SLOTS
    pool.state.lengths[0] = 10
    _, long = model.prefill(torch.randint(0, 97, (1, SPARE_KV_SLOTS + 50)))
    want = model.step(torch.tensor([3]), long.copy())
    slot = pool.add(long, [], [1])
    assert pool.rows == 2 and slot == 1
    got = model.step(torch.tensor([5, 3]), pool.view())
    assert torch.allclose(got[1], want[0], atol=1e-5)
    for _ in range(3):
        pool.add(long, [], [1])
    assert pool.n == 5 and pool.rows <= 5 + 5 // 4
    while pool.n > 1:
        pool.remove(pool.n - 1)
    assert pool.rows == 1


def test_the_prefix_caches_default_budget_follows_max_memory() -> None:
    """Unset (-1), the budget is a thirty-second of --max-memory within 64 MiB .. 4 GiB;
    one given, or 0 (off), is kept."""
    from linserve.server.engine.sizing import resolve_checkpoint
    from linserve.server.settings import Settings

    def budget(**given: int) -> int:
        return resolve_checkpoint(Settings(**given)).prefix_cache_bytes  # type: ignore[arg-type]

    assert budget(max_memory=16 << 30) == 512 << 20
    assert budget(max_memory=1 << 30) == 64 << 20
    assert budget(max_memory=1 << 40) == 4 << 30
    assert budget(max_memory=16 << 30, prefix_cache_bytes=0) == 0
    assert budget(max_memory=16 << 30, prefix_cache_bytes=123) == 123
