"""Shared test setup. TRITON_INTERPRET must be set before any kernel module is imported, OMP_NUM_THREADS before
torch is."""

import os
import shutil


def interpreter_default(environ) -> str:
    """TRITON_INTERPRET unless set: the interpreter on CI, the compiled kernels when the tests are pointed at a GPU
    (COMPRESS_TEST_DEVICE=cuda); the interpreter on CUDA tensors fails most kernel tests (seen on an H200)."""
    return "0" if environ.get("COMPRESS_TEST_DEVICE") == "cuda" else "1"


os.environ.setdefault("TRITON_INTERPRET", interpreter_default(os.environ))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread, here and in the commands the tests start: the tiny models make thousands of tiny ops, where a
# second thread's synchronisation costs more than the op (a tiny GPTQ + AWQ run: 22 s with two threads on a busy
# 2-core box, 0.8 s with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

if os.environ.get("COMPRESS_TEST_DEVICE") == "cuda":  # the kernel tests against the compiled kernels on a GPU
    from cuda_shim import install

    install()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama model folder (safetensors + config + fast tokenizer), as `model=<folder>` expects."""
    from helpers import build_tiny_llama, build_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_llama(vocab_size=len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def empty_mlflow_db(tmp_path_factory) -> Path:
    """An MLflow sqlite store with its tables made, to copy where a test needs a store but not its creation: MLflow
    runs its schema migrations (seconds) for every new store. Never written to: copy it."""
    from mlflow import MlflowClient

    database = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{database}").search_experiments()
    return database


@pytest.fixture
def artifacts(tmp_path, monkeypatch) -> Path:
    """Isolated artifacts dir and MLflow store for one test."""
    monkeypatch.setenv("COMPRESS_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "artifacts"


@pytest.fixture
def default_mlflow_store(artifacts, empty_mlflow_db) -> Path:
    """``artifacts`` with its default MLflow store made already, as runs after a machine's first find it (test_cli's
    first run makes one)."""
    artifacts.mkdir(parents=True)
    shutil.copy(empty_mlflow_db, artifacts / "mlflow.db")
    return artifacts / "mlflow.db"
