"""The llama.cpp backend in process, on the tiny synthetic model converted to GGUF: numerics
against the torch fp32 reference per precision, determinism, sampling options, cancel, thread
changes between tokens, the prompt-prefix cache, and clear errors.

llama-cpp-python is part of the project's set-up (tools/llama-wheel.sh): if it does not import,
these tests fail rather than skip.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dsr1d.engine import llama_backend  # noqa: E402
from dsr1d.engine.errors import ModelError  # noqa: E402
from dsr1d.engine.gguf_convert import convert  # noqa: E402
from dsr1d.engine.request import InvalidRequest  # noqa: E402
from dsr1d.engine.synth import synthesize, tokenizer_size  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Why is the sky blue?"
# Logits of the converted model against the torch fp32 forward pass of the same checkpoint, at
# every position of a ~25-token sequence. The checkpoint is bf16, so fp32 and bf16 GGUFs hold the
# very same weights: only summation order and llama.cpp's f16 KV cache differ (measured cosine
# 1.00000, top-1 all equal); the bars leave room for other CPUs' kernels. Q8_0 rounds weights and
# activations to 8-bit blocks of 32 (~0.4 % per value; measured 0.99992, as the torch int8 path's
# 0.99993). Q4_0 rounds weights to 16 levels per block (~7 % per weight; measured 0.990, the
# torch int4 path's 0.989): on a 64-wide model few terms per dot product average the error out,
# and near-tied random logits flip the top-1 at a quarter of the positions (measured 0.75).
COSINE = {"fp32": 0.9999, "bf16": 0.9995, "int8": 0.999, "int4": 0.98}
TOP1 = {"fp32": 0.95, "bf16": 0.95, "int8": 0.9, "int4": 0.6}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize("tiny", tmp_path_factory.mktemp("llama") / "tiny")


@pytest.fixture(scope="module")
def ggufs(tiny: Path) -> dict[str, Path]:
    return {dtype: convert(tiny, tiny / f"model-{dtype}.gguf", dtype)
            for dtype in ("fp32", "bf16", "int8", "int4")}


@pytest.fixture(scope="module")
def engine(ggufs: dict[str, Path]) -> llama_backend.LlamaGenerator:
    return llama_backend.load(ggufs["int8"], threads=2, context=1024)


def test_llama_cpp_is_installed_and_says_what_the_build_uses() -> None:
    assert llama_backend.installed()
    info = llama_backend.system_info()
    assert "AVX" in info or "NEON" in info, info


def test_the_installed_build_is_the_projects_with_its_patches() -> None:
    shipped = sorted(p.stem for p in (REPO / "tools" / "llama-patches").glob("*.patch"))
    assert llama_backend.patches() == shipped
    info = llama_backend.system_info()
    if "amx_int8" in _cpu_flags().split():     # built for this CPU: its AMX kernels, fixed
        assert "AMX_INT8 = 1" in info, info
    assert llama_backend.amx_warning(info, llama_backend.patches()) is None
    assert "patches: amx-tile-config" in llama_backend.build_info()
    # another llama-cpp-python with AMX (llama.cpp #20824: SIGSEGV on the first prompt)
    assert "#20824" in llama_backend.amx_warning("AMX_INT8 = 1 | AVX = 1", [])
    assert llama_backend.amx_warning("AVX = 1", []) is None


# torch's bf16 products take oneDNN's AMX kernels on such a CPU, which release the tiles after
# them: llama.cpp's next product must configure them again (it died of SIGILL when it did not)
AMX_SCRIPT = """
import sys, llama_cpp, torch
a = torch.randn(256, 256, dtype=torch.bfloat16)
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)
for turn in (b"Why is the sky blue? Explain it step by step, please, and then say why it is not violet.",
             b" And sunsets, why red?"):
    (a @ a).sum()
    llm.eval(llm.tokenize(turn))
print(llama_cpp.llama_print_system_info().decode())
"""


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_a_prompt_of_many_tokens_runs_on_this_cpus_kernels(ggufs: dict[str, Path],
                                                              dtype: str) -> None:
    """On an AMX CPU a batch of 2+ tokens takes the AMX int8 kernels, which died of SIGSEGV
    (and, after torch's AMX products, SIGILL) without amx-tile-config.patch, and a BF16 prompt
    of 16+ tokens AMX-BF16 tiles (bf16-packed.patch), their own tile configuration loaded for
    every product; in a child, so that a crash is this test's failure."""
    out = subprocess.run([sys.executable, "-c", AMX_SCRIPT, str(ggufs[dtype])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "AVX" in out.stdout or "NEON" in out.stdout


# Each sequence's next-token logits, decoded in one step with others and alone (its KV cache
# trimmed back in between); the same eight prompts' caches for every batch size
ROWS_SCRIPT = """
import json, sys
import numpy as np
import llama_cpp.llama_cpp as L
L.llama_backend_init()
model = L.llama_model_load_from_file(sys.argv[1].encode(), L.llama_model_default_params())
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
params = L.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_seq_max, params.n_threads = 1024, 64, 8, 2
ctx = L.llama_init_from_model(model, params)
memory, batch = L.llama_get_memory(ctx), L.llama_batch_init(64, 0, 8)
def decode(tokens):
    batch.n_tokens = len(tokens)
    for i, (token, pos, seq) in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, 1
        batch.seq_id[i][0] = seq
    assert L.llama_decode(ctx, batch) == 0
    return [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
            for i in range(len(tokens))]
for seq in range(8):
    decode([(100 + 7 * seq + i, i, seq) for i in range(12)])
alone = []
for seq in range(8):
    alone.append(decode([(300 + seq, 12, seq)])[0])
    L.llama_memory_seq_rm(memory, seq, 12, -1)
out = {}
for rows in (2, 3, 4, 8):
    together = decode([(300 + seq, 12, seq) for seq in range(rows)])
    for seq in range(rows):
        L.llama_memory_seq_rm(memory, seq, 12, -1)
    out[rows] = [[float(np.abs(t - a).max()), float(np.ptp(a)), int(t.argmax() == a.argmax())]
                 for t, a in zip(together, alone)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_a_sequence_gets_the_same_logits_alone_or_in_a_batch(ggufs: dict[str, Path],
                                                             dtype: str) -> None:
    """Decoding sequences together changes nothing in any one of them. Where dsr1d's kernels
    take the rows, every row goes through the same sums in the same order whatever the batch,
    so the bits are equal: on an AMX CPU for Q4_0, Q8_0 and IQ4_NL batches of 2-8
    (amx-vnni-rows.patch), on an AVX512_BF16 CPU for BF16 batches of up to 15
    (bf16-packed.patch). llama.cpp's own kernels order a batch's float sums differently from
    one row's, so elsewhere they agree to within float rounding (BF16 more loosely: a batch and
    one row take different paths through its kernels)."""
    out = subprocess.run([sys.executable, "-c", ROWS_SCRIPT, str(ggufs[dtype])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    flags = _cpu_flags().split()
    exact = "avx512_bf16" in flags if dtype == "bf16" else "amx_int8" in flags
    tolerance = 1e-2 if dtype == "bf16" else 1e-3
    for rows, seqs in json.loads(out.stdout.splitlines()[-1]).items():
        assert len(seqs) == int(rows)
        for diff, spread, same_top in seqs:
            assert same_top and spread > 0, (rows, seqs)
            assert diff == 0.0 if exact else diff <= tolerance * spread, (rows, seqs)


def _wheel_plan(tmp_path: Path, flags: str) -> tuple[str, str]:
    """The folder and CMake arguments tools/llama-wheel.sh would build with on a CPU of
    ``flags`` (its dry run: nothing built)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    env = {**os.environ, "DSR1D_CPUINFO": str(cpuinfo), "DSR1D_WHEEL_DRY_RUN": "1",
           "DSR1D_WHEEL_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([str(REPO / "tools" / "llama-wheel.sh"), sys.executable], env=env,
                         capture_output=True, text=True, check=True)
    folder, args = out.stdout.splitlines()
    return folder, args


def test_each_kind_of_cpu_gets_its_own_native_wheel(tmp_path: Path) -> None:
    sapphire = ("fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512bw avx512vl avx512dq "
                "avx512vbmi avx512_vnni avx512_bf16 avx_vnni amx_tile amx_int8 amx_bf16")
    folder, args = _wheel_plan(tmp_path, sapphire)
    # -march=native: AMX too, its kernels fixed by amx-tile-config.patch
    assert args.split() == ["-DGGML_NATIVE=ON"]
    assert "amx_int8" in folder and "no-amx" not in folder      # not the older build without
    zen4 = sapphire.replace(" amx_tile amx_int8 amx_bf16", "")
    other, args = _wheel_plan(tmp_path, zen4)
    assert args.split() == ["-DGGML_NATIVE=ON"] and "amx" not in other and other != folder


def test_a_changed_llama_patch_gets_a_wheel_of_its_own(tmp_path: Path) -> None:
    import shutil

    tools = tmp_path / "tools"
    shutil.copytree(REPO / "tools" / "llama-patches", tools / "llama-patches")
    shutil.copy(REPO / "tools" / "llama-wheel.sh", tools)
    env = {**os.environ, "DSR1D_WHEEL_DRY_RUN": "1", "DSR1D_WHEEL_CACHE": str(tmp_path / "c")}

    def folder() -> str:
        return subprocess.run([str(tools / "llama-wheel.sh"), sys.executable], env=env,
                              capture_output=True, text=True, check=True).stdout.splitlines()[0]

    shipped = folder()
    assert shipped == _wheel_plan(tmp_path, _cpu_flags())[0].replace(str(tmp_path / "cache"),
                                                                      str(tmp_path / "c"))
    patch = next((tools / "llama-patches").glob("*.patch"))
    patch.write_text(patch.read_text() + "\n")
    assert folder() != shipped      # never the wheel an older patch built


def test_a_subset_of_the_patches_gets_a_wheel_of_its_own(tmp_path: Path) -> None:
    """bench/inference.py builds the release for its stock rows with DSR1D_LLAMA_PATCHES: only
    the named patches, in a folder of their own; a name that is not a patch is an error."""
    env = {**os.environ, "DSR1D_WHEEL_DRY_RUN": "1", "DSR1D_WHEEL_CACHE": str(tmp_path)}

    def plan(patches: str | None) -> subprocess.CompletedProcess[str]:
        extra = {} if patches is None else {"DSR1D_LLAMA_PATCHES": patches}
        return subprocess.run([str(REPO / "tools" / "llama-wheel.sh"), sys.executable],
                              env={**env, **extra}, capture_output=True, text=True)

    folders = [plan(p).stdout.splitlines()[0] for p in (None, "amx-tile-config", "")]
    assert len(set(folders)) == 3, folders
    wrong = plan("amx-tile-config no-such-fix")
    assert wrong.returncode == 2 and "no patch no-such-fix" in wrong.stderr, wrong


def _cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.partition(":")[2].strip()
    return ""


# Each load in a process of its own with the worker's environment, as the worker loads a model:
# dsr1d's served load, or llama.cpp as a user runs it with the weights in memory (its default
# lazy mode). Prints what the process maps of the file and the logits of a fixed sequence.
LAZY_SCRIPT = """
import json, sys
from pathlib import Path
import numpy as np
path, how, ids = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
if how == "served":
    from dsr1d.engine import llama_backend
    gen = llama_backend.load(path, threads=2, context=512)
    logits = np.array(gen.logits(ids))
    out = {"in_file": gen.embedding_in_file, "text": gen.generate("Why is the sky blue?",
           {"max_new_tokens": 8, "greedy": True}).text}
else:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, use_mmap=False, logits_all=True,
                          verbose=False)
    llm.eval(ids)
    logits, out = np.array(llm.scores[: len(ids)]), {}
from dsr1d.engine import pages
out.update(maps_file=pages.maps_file(path), top1=logits.argmax(1).tolist(),
           total=float(np.abs(logits).sum()))
print(json.dumps(out))
"""


def _load_in_child(gguf: Path, how: str, ids: list[int]) -> dict:
    import json

    from dsr1d.edges.engine_host import worker_environment

    out = subprocess.run([sys.executable, "-c", LAZY_SCRIPT, str(gguf), how, json.dumps(ids)],
                         env=worker_environment(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("dtype", ["bf16", "int4"])
def test_the_embedding_table_stays_in_the_file_and_the_model_answers_the_same(
        ggufs: dict[str, Path], engine, dtype: str) -> None:
    """A decoded token reads one row of the embedding table: served, llama.cpp reads it from the
    file as rows are needed instead of loading all of it; the logits are the very same."""
    from dsr1d.engine.gguf_file import inspect_gguf

    info = inspect_gguf(ggufs[dtype])
    ids = engine.encode(PROMPT) + engine.tokenize(" The quick brown fox jumps over the dog.")
    served = _load_in_child(ggufs[dtype], "served", ids)
    stock = _load_in_child(ggufs[dtype], "stock", ids)
    assert served["in_file"] == info.embedding_bytes > 0
    # stock: all of it in memory; served: the file's pages as rows are read (on this tiny
    # table the kernel's fault-around maps all of it; the 1.5B keeps ~2 of 237 MiB: bench/)
    assert served["maps_file"] and not stock["maps_file"]
    assert served["text"]
    assert served["top1"] == stock["top1"]
    assert served["total"] == pytest.approx(stock["total"], rel=1e-6)


def test_a_table_that_is_also_the_output_matrix_is_loaded_whole(tmp_path: Path) -> None:
    """Tied embeddings (no output.weight): every token reads all of it, so it stays in memory."""
    import json

    from dsr1d.engine.gguf_file import inspect_gguf

    tied = synthesize("tiny", tmp_path / "tied")
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    gguf = convert(tied, tmp_path / "tied.gguf", "int8")
    assert inspect_gguf(gguf).tied_output
    served = _load_in_child(gguf, "served", [1, 2, 3])
    assert served["in_file"] == 0 and not served["maps_file"]
    assert served["text"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4"])
def test_logits_match_the_torch_fp32_reference(tiny: Path, ggufs: dict[str, Path],
                                               dtype: str) -> None:
    from dsr1d.engine.model import load

    reference = load(tiny, "fp32")
    gen = llama_backend.load(ggufs[dtype], threads=2, context=256)
    ids = gen.encode(PROMPT) + gen.tokenize(" The quick brown fox jumps over the lazy dog.")
    with torch.inference_mode():
        want = reference.model(input_ids=torch.tensor([ids])).logits[0].float()
    got = torch.tensor(gen.logits(ids))[:, : want.shape[1]]
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=1)
    agree = (got.argmax(1) == want.argmax(1)).float().mean().item()
    print(f"{dtype}: cosine min {cosine.min():.5f} mean {cosine.mean():.5f}, top-1 {agree:.2f}")
    assert cosine.min().item() > COSINE[dtype]
    assert agree >= TOP1[dtype]


def test_greedy_output_is_deterministic_and_survives_the_prefix_cache(engine) -> None:
    opts = {"greedy": True, "ignore_eos": True, "max_new_tokens": 24}
    first = engine.generate(PROMPT, opts)
    other = engine.generate("hi", opts)
    again = engine.generate(PROMPT, opts)  # shares the template's prefix with "hi"
    assert first.text == again.text and first.stats["new_tokens"] == 24
    assert other.text != first.text


def test_the_same_seed_gives_the_same_sample_and_another_seed_another(engine) -> None:
    opts = {"temperature": 1.5, "top_p": 1.0, "ignore_eos": True, "max_new_tokens": 30}
    a = engine.generate(PROMPT, {**opts, "seed": 7}).text
    b = engine.generate(PROMPT, {**opts, "seed": 7}).text
    c = engine.generate(PROMPT, {**opts, "seed": 8}).text
    assert a == b and a != c


def test_padding_rows_past_the_tokenizer_are_never_sampled(engine) -> None:
    ids: list[int] = []
    original = engine.piece

    def recording(token: int, special: bool) -> bytes:
        ids.append(token)
        return original(token, special)

    engine.piece = recording
    try:
        engine.generate(PROMPT, {"temperature": 2.0, "top_p": 1.0, "ignore_eos": True,
                                 "max_new_tokens": 200, "seed": 1})
    finally:
        engine.piece = original
    assert engine.n_vocab > tokenizer_size(), "the tiny model has padding rows"
    assert ids and max(ids) < tokenizer_size()


def test_stream_and_result_agree_and_the_think_split_covers_the_text(engine) -> None:
    pieces: list[str] = []
    result = engine.generate(PROMPT, {"greedy": True, "ignore_eos": True, "max_new_tokens": 40},
                             pieces.append)
    streamed = "".join(pieces)
    assert streamed and result.reasoning + result.answer in (streamed, streamed.replace(
        "</think>", ""))
    stats = result.stats
    assert stats["backend"] == "llamacpp" and stats["dtype"] == "int8"
    assert stats["prompt_tokens"] == len(engine.encode(PROMPT))
    assert stats["finish_reason"] == "length" and stats["decode_tokens_per_s"] > 0
    assert stats["first_token_latency_s"] > 0 and not math.isnan(stats["total_s"])


def test_cancel_stops_after_the_current_token(engine) -> None:
    asked: list[int] = []

    def cancelled() -> bool:  # asked once after each new token
        asked.append(1)
        return len(asked) >= 3

    result = engine.generate(PROMPT, {"ignore_eos": True, "max_new_tokens": 500},
                             cancelled=cancelled)
    assert result.stats["finish_reason"] == "cancelled"
    assert result.stats["new_tokens"] == 3


def test_the_thread_count_changes_between_tokens(engine) -> None:
    wanted = iter([2, 2, 1])
    result = engine.generate(PROMPT, {"greedy": True, "ignore_eos": True, "max_new_tokens": 6},
                             threads=lambda: next(wanted, 1))
    assert result.stats["threads"] == 1
    assert engine.lib.llama_n_threads(engine.llm.ctx) == 1
    engine.generate(PROMPT, {"max_new_tokens": 1}, threads=lambda: 2)
    assert engine.lib.llama_n_threads(engine.llm.ctx) == 2


def test_a_prompt_over_the_context_is_an_invalid_request(ggufs: dict[str, Path]) -> None:
    gen = llama_backend.load(ggufs["int4"], threads=1, context=64)
    with pytest.raises(InvalidRequest, match="exceeds the model's context of 64 tokens"):
        gen.generate(PROMPT, {"max_new_tokens": 60})


def test_a_file_without_vocabulary_is_a_model_error(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "novocab.gguf"), "qwen2")
    for key, value in (("context_length", 128), ("embedding_length", 32), ("block_count", 1),
                       ("feed_forward_length", 64)):
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_uint32("qwen2.attention.head_count", 2)
    writer.add_uint32("qwen2.attention.head_count_kv", 2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError):
        llama_backend.load(tmp_path / "novocab.gguf", threads=1)


def test_a_model_bigger_than_memory_is_refused_before_loading(ggufs: dict[str, Path]) -> None:
    from dsr1d.engine.gguf_file import inspect_gguf

    info = inspect_gguf(ggufs["int4"])
    with pytest.raises(ModelError, match=r"needs about .* GB at a context of .* shorter "
                                         r"engine_context"):
        llama_backend.check_memory(info, context=1 << 40)


def test_continuous_batching_gives_each_sequence_its_own_greedy_text(
        ggufs: dict[str, Path]) -> None:
    from dsr1d.engine.llama_batch import Batcher

    gen = llama_backend.load(ggufs["int8"], threads=2, context=512, parallel=3)
    single = llama_backend.load(ggufs["int8"], threads=2, context=512)
    prompts = ["Why is the sky blue?", "hi", "Tell me a story about a cat", "2+2?"]
    opts = {"greedy": True, "ignore_eos": True, "max_new_tokens": 20}
    alone = [single.generate(p, opts).text for p in prompts]
    batcher = Batcher(gen, 3)
    results: dict[int, object] = {}
    for job, prompt in enumerate(prompts[:3]):
        results.update(batcher.admit(job, prompt, opts, None, lambda: False))
    assert len(batcher.active) == 3 and batcher.free == []
    steps, fourth = 0, False
    while batcher.active:
        results.update(batcher.step())
        steps += 1
        if not fourth and batcher.free:         # the fourth joins when a slot frees
            results.update(batcher.admit(3, prompts[3], opts, None, lambda: False))
            fourth = True
    assert [results[j].text for j in range(4)] == alone
    assert results[0].stats["batch"] == 3 and steps < 3 * 20        # decoded together
    # a finished sequence's slot keeps its tokens, and the batcher its last logits: the same
    # prompt again evaluates nothing (prompt caching), and still gives the same text
    # (slot 0 went to the fourth prompt; slot 1 still holds the second's)
    n = len(gen.encode(prompts[1]))
    first = dict(batcher.admit(9, prompts[1], {**opts, "max_new_tokens": 1}, None,
                               lambda: False))[9]
    assert (first.stats["slot"], first.stats["cached_prompt_tokens"]) == (1, n)
    assert alone[1].startswith(first.text)
    # once newer prompts have pushed those logits out, only its last token is evaluated, as
    # a row of the next step
    batcher._logits.clear()
    assert batcher.admit(10, prompts[1], {**opts, "max_new_tokens": 1}, None,
                         lambda: False) == []
    first = dict(batcher.step())[10]
    assert (first.stats["slot"], first.stats["cached_prompt_tokens"]) == (1, n - 1)
    assert alone[1].startswith(first.text)
    batcher.close()


def test_rows_are_grouped_where_llama_cpp_repacks_the_weights() -> None:
    avx2 = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | LLAMAFILE = 1 | REPACK = 1 |"
    assert llama_backend.repacks("int4", avx2) and llama_backend.repacks("Q4_K_M", avx2)
    assert not llama_backend.repacks("int8", avx2) and not llama_backend.repacks("bf16", avx2)
    assert not llama_backend.repacks("int4", avx2.replace("REPACK = 1", "REPACK = 0"))
    assert not llama_backend.repacks("int4", "CPU : SSE3 = 1 | REPACK = 1 |")   # no AVX2
    assert llama_backend.repacks("int4", "CPU : NEON = 1 | ARM_FMA = 1 | REPACK = 1 |")
    # AMX takes these weights before the repacked kernels, and runs each row count as it comes
    amx = avx2.replace("AVX512 = 1", "AVX512 = 1 | AMX_INT8 = 1")
    assert not llama_backend.repacks("int4", amx)
    # so do amx-vnni-rows.patch's VNNI kernels without AMX, for Q4_0 and IQ4_NL only
    zen4 = avx2.replace("AVX512 = 1", "AVX512 = 1 | AVX512_VNNI = 1")
    assert not llama_backend.repacks("int4", zen4, ["amx-vnni-rows"])
    assert llama_backend.repacks("int4", zen4, []) and llama_backend.repacks("Q4_K_M", zen4,
                                                                             ["amx-vnni-rows"])


def test_rows_padded_to_a_group_of_four_change_no_text_and_no_cache(
        ggufs: dict[str, Path]) -> None:
    """Two running sequences and a group of 4 (as where llama.cpp repacks the weights): each
    step carries two throw-away rows in free slots, which leave no trace in their KV caches."""
    from dsr1d.engine.llama_batch import Batcher

    gen = llama_backend.load(ggufs["int8"], threads=2, context=512, parallel=4)
    single = llama_backend.load(ggufs["int8"], threads=2, context=512)
    prompts = ["Why is the sky blue?", "Tell me a story about a cat", "2+2?"]
    opts = {"greedy": True, "ignore_eos": True, "max_new_tokens": 16}
    alone = [single.generate(p, opts).text for p in prompts]
    batcher = Batcher(gen, 4)
    batcher.group = 4
    results: dict[int, object] = {}
    for job, prompt in enumerate((prompts[0], "hello there", "a third one")):
        results.update(batcher.admit(10 + job, prompt, {**opts, "max_new_tokens": 2}, None,
                                     lambda: False))
    while batcher.active:                   # earlier requests leave their prompts in slots
        results.update(batcher.step())
    for job, prompt in ((1, prompts[1]), (2, prompts[2])):
        results.update(batcher.admit(job, prompt, opts, None, lambda: False))
    free = batcher.free
    assert len(batcher._padding(len(batcher.active), 0)) == 2
    held = {s: len(batcher.cached[s]) for s in free}
    assert max(held.values()) > 0
    while batcher.active:
        results.update(batcher.step())
    assert [results[1].text, results[2].text] == alone[1:]
    for slot, n in held.items():       # the padding rows were taken out again
        assert gen.lib.llama_memory_seq_pos_max(batcher.memory, slot) == n - 1
    assert len(batcher._padding(1, 0)) == 0 and len(batcher._padding(5, 0)) == 0
    batcher.close()


def test_requests_sharing_a_prompt_share_its_kv_cache_and_their_first_step(
        ggufs: dict[str, Path]) -> None:
    from dsr1d.engine.llama_batch import Batcher

    gen = llama_backend.load(ggufs["int8"], threads=2, context=512, parallel=3)
    single = llama_backend.load(ggufs["int8"], threads=2, context=512)
    system = "You are a careful assistant who answers in one short paragraph. "
    prompts = [system + "Why is the sky blue?", system + "Why is the sky blue?",
               system + "What is a prime number?"]
    opts = {"greedy": True, "ignore_eos": True, "max_new_tokens": 12}
    alone = [single.generate(p, opts).text for p in prompts]
    batcher = Batcher(gen, 3)
    results: dict[int, object] = {}
    for job, prompt in enumerate(prompts):    # arriving together, as from three users
        results.update(batcher.admit(job, prompt, opts, None, lambda: False))
    by_job = {seq.job: seq for seq in batcher.active.values()}
    assert by_job[1].first > 0     # the same prompt: its first token from the prefill's logits
    first_step = batcher.step()
    assert all(batcher.active[s].first > 0 for s in batcher.active)   # everyone has a token
    results.update(first_step)
    while batcher.active:
        results.update(batcher.step())
    assert [results[j].text for j in range(3)] == alone
    ids = [gen.encode(p) for p in prompts]
    assert results[0].stats["cached_prompt_tokens"] == 0
    # the same prompt: all of it copied from the running sequence
    assert results[1].stats["cached_prompt_tokens"] == len(ids[1])
    # another question after the same system prompt: the shared part copied
    shared = next(i for i, (a, b) in enumerate(zip(ids[0], ids[2])) if a != b)
    assert results[2].stats["cached_prompt_tokens"] == shared
    # later, the same prompt again: its KV cache and its last logits were kept, so nothing is
    # evaluated before its first token
    assert batcher.admit(7, prompts[0], opts, None, lambda: False) == []
    assert next(iter(batcher.active.values())).first > 0
    again: dict[int, object] = {}
    while batcher.active:
        again.update(batcher.step())
    assert again[7].stats["cached_prompt_tokens"] == len(ids[0])
    assert again[7].text == alone[0]
    batcher.close()


def test_a_prompt_too_long_for_a_slot_is_refused_before_it_takes_one(
        ggufs: dict[str, Path]) -> None:
    from dsr1d.engine.llama_batch import Batcher
    from dsr1d.engine.request import InvalidRequest

    gen = llama_backend.load(ggufs["int8"], threads=2, context=128, parallel=2)
    batcher = Batcher(gen, 2)
    with pytest.raises(InvalidRequest, match="exceeds the model's context"):
        batcher.admit(1, "word " * 200, {"max_new_tokens": 8}, None, lambda: False)
    assert batcher.free == [0, 1]
    batcher.close()
