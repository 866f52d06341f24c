"""Shared test fixtures.

Real tokenizers ship in this repository under `tests/fixtures/tokenizers/` (their `tokenizer.json` xz-compressed,
each with its licence) and are unpacked once per session; the real GSM8K rows are the package's own sample
(`logitless/data/gsm8k_sample.jsonl`). No test needs anything outside the repository.
"""

from __future__ import annotations

import contextlib
import logging
import lzma
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python with the repository first on its path; packages installed
    onto PYTHONPATH (optional extras on a GPU machine) stay importable there."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return env


def reward_module(tmp_path: Path, monkeypatch, name: str, source: str) -> None:
    """Writes `source` (dedented) as module `name` in `tmp_path` and makes it importable, freshly, for this test."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def start_with_sigint(args: list[str], **popen) -> subprocess.Popen:
    """Popen whose child starts with SIGINT's default action however this test process was started: a background
    job of a non-interactive shell (`pytest ... &`) and some runners start it with SIGINT ignored, which a child
    inherits (and then, by design, keeps ignoring). Handled signals, unlike ignored ones, go back to their default
    action at exec, so SIGINT is handled here while the child starts."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, **popen)
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def sigint_handler(handler) -> Iterator[None]:
    """SIGINT handled by `handler` (e.g. signal.default_int_handler, or signal.SIG_IGN) in this process for the
    block, whatever it was when the test run started."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# On CPU, `torch.compile` with inductor's default backend compiles with "aot_eager" instead: dynamo's capture and
# AOTAutograd's forward/backward graphs (graph breaks, guards, recompiles, checkpointing, FSDP2 hooks, collectives
# inside the graph) run as on a GPU, but not inductor's C++ code generation (3.4 of the suite's 20 minutes of CPU on
# two cores). The C++ kernels are not what a GPU runs, and CPU tests cannot speak for inductor's numerics anyway: the GPU
# suite holds every compiled path to the eager model with inductor's Triton code. Torchrun ranks and workers that
# import this module compile the same way; LOGITLESS_TEST_INDUCTOR=1 keeps inductor (`INDUCTOR_COMPILE` is the real
# torch.compile, for the test of the options themselves).
INDUCTOR_COMPILE = torch.compile
if not torch.cuda.is_available() and os.environ.get("LOGITLESS_TEST_INDUCTOR") != "1":
    def _compile_without_codegen(model=None, *, backend="inductor", mode=None, options=None, **kwargs):
        if backend == "inductor":
            backend, mode, options = "aot_eager", None, None
        return INDUCTOR_COMPILE(model, backend=backend, mode=mode, options=options, **kwargs)

    torch.compile = _compile_without_codegen


# Two xdist workers on a 2-core machine (the README's command on CI): one intra-op thread per worker, and per child
# process it starts (torchrun ranks, CLI runs, bench scripts), instead of torch's default of one per core in each.
# With more threads than cores, OpenMP's workers spin a while after every parallel region before they sleep, on CPU
# that the other worker's tests need.
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-shape tests: more threads only add OpenMP sync cost (10x
    slower on a loaded 2-core runner)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_make_record = logging.getLogRecordFactory()


def _record_with_exceptions_as_text(*args, **kwargs) -> logging.LogRecord:
    """Every log record of the test process with its exception arguments as their text. pytest's log capture keeps
    each record of a test until it ends, and an exception among a record's arguments keeps its traceback's frames
    alive: Liger logs each kernel backend it cannot import with the ImportError, at a run's first use of the op, so
    that run's frames (its model and optimizer: 0.71 GiB in the one-GPU FSDP-offload peak test, H100) stayed on the
    GPU through the next run."""
    record = _make_record(*args, **kwargs)
    if isinstance(record.args, tuple) and any(isinstance(a, BaseException) for a in record.args):
        record.args = tuple(str(a) if isinstance(a, BaseException) else a for a in record.args)
    return record


logging.setLogRecordFactory(_record_with_exceptions_as_text)


@pytest.fixture(autouse=True)
def release_hung_agent_calls():
    """After each test: the agent calls a test left hanging on `agent_fixtures.HANG` (abandoned at their timeout)
    are released and have ended, so that no later test finds them stuck (`agents.runner.check_abandoned`)."""
    yield
    runner, fixtures = sys.modules.get("logitless.agents.runner"), sys.modules.get("tests.agent_fixtures")
    if runner is None or fixtures is None:
        return
    fixtures.HANG.set()
    try:
        for stuck in list(runner._abandoned):
            stuck.thread.join(timeout=10)
        runner.check_abandoned()  # forgets the ended ones; raises for one that ignores HANG
    finally:
        fixtures.HANG.clear()


@pytest.fixture(autouse=True)
def fresh_gpu_state(request):
    """Before each GPU test: the process's CUDA and compile state as a fresh process would have it. Earlier tests'
    garbage (a compiled model keeps itself in a reference cycle), dynamo's code caches (one code object of
    transformers serves every model, so an earlier family's compiled variants count against a later one's
    recompile limit) and CUDA-graph trees would otherwise make a test's compiles and memory peaks depend on which
    tests ran before it in the same process (`pytest -m gpu tests/` runs them all in one)."""
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        import gc

        gc.collect()
        torch._dynamo.reset()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield


def unpack_tokenizer(name: str, dest: Path) -> Path:
    """The tokenizer folder `tests/fixtures/tokenizers/<name>` as `AutoTokenizer.from_pretrained` reads it: its
    files copied into `dest`, `tokenizer.json.xz` decompressed to `tokenizer.json`."""
    src = FIXTURES / "tokenizers" / name
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name == "tokenizer.json.xz":
            (dest / "tokenizer.json").write_bytes(lzma.decompress(f.read_bytes()))
        elif f.name != "LICENSE":
            shutil.copyfile(f, dest / f.name)
    return dest


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    """Folder of the Qwen2.5 tokenizer (151,643 byte-level BPE ranks + 22 specials, a ChatML template)."""
    return unpack_tokenizer("qwen2.5", tmp_path_factory.mktemp("tokenizers") / "qwen2.5")


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir(tmp_path_factory) -> Path:
    """Folder of the GPT-2 tokenizer (50,257 tokens)."""
    return unpack_tokenizer("gpt2", tmp_path_factory.mktemp("tokenizers") / "gpt2")


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))


@pytest.fixture(scope="session")
def gpt2_tokenizer(gpt2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gpt2_tokenizer_dir))


@pytest.fixture(scope="session")
def gsm8k_test_rows() -> Path:
    """A JSONL file of real GSM8K rows: the first 50 of the test split, unchanged (the package's sample)."""
    from logitless.data.tasks import GSM8K_SAMPLE

    return GSM8K_SAMPLE


# config overrides of the tiny training runs: small LoRA adapters, no TensorBoard, progress bar, tables or plot
TINY_LORA_QUIET = (
    "model.lora_r=4", "model.lora_alpha=8", "logging.tensorboard=false", "logging.progress=false",
    "logging.log_completions=false", "logging.plot=false",
)


def tiny_qwen2(vocab_size: int = 151_665, hidden: int = 64, layers: int = 2, tie: bool = True, seed: int = 0):
    """A random-init 2-layer Qwen2 causal LM of real vocabulary size (fp32, eval mode)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture
def tiny_qwen2_model():
    return tiny_qwen2()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """With CUDA, one process runs the tests (no xdist workers, whatever addopts asks): GPU tests measure memory
    peaks and compiles, which two workers on one GPU would share."""
    if torch.cuda.is_available() and getattr(config.option, "dist", "no") != "no":
        config.option.dist, config.option.numprocesses, config.option.tx = "no", 0, []


# The files whose module-scoped runs start torchrun launches or long subprocesses (docs/testing.md's slowest), the
# longest first: run first, in this order (addopts' --no-loadscope-reorder keeps it; xdist would otherwise hand out
# the files with the most tests first), so that on two workers the many short files fill the other worker meanwhile
# instead of trailing them.
SLOW_FIRST = ("test_parallel.py", "test_tensor_parallel.py", "test_shared_rollout.py", "test_bench_e2e.py",
              "test_vlm_cli.py", "test_vlm_model.py", "test_bench_plan.py", "test_vlm_rollout.py",
              "test_vlm_episodes.py", "test_triton.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: each file's own order is kept
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
