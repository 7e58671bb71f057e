"""train.parallel=fsdp end to end on a real local Ray cluster (2 workers, gloo): digits, the built-in GPT and a Hugging
Face GPT-2 train, the MLflow run finishes, and the logged MLflow Model is the whole trained model (its outputs are
those of the final checkpoint's shards, put together here by torch's own DCP consolidation)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from orchestrator import load_config, train
from orchestrator.models.zoo import build_model
from orchestrator.run.result import TrainResult

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

# ---- fixtures shared by this module's tests (one Ray cluster: conftest's module-scoped `ray_cluster`) -----------


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Byte-tokenised text in sequences of 32 (`prepare text`): a random lowercase letter, then its capital."""
    from pipelines.prepare import prepare_text

    out = tmp_path_factory.mktemp("fsdp_text")
    letters = np.random.default_rng(0).integers(0, 16, 8_000)
    text = np.empty(2 * len(letters), np.uint8)
    text[0::2], text[1::2] = ord("a") + letters, ord("A") + letters
    (out / "pairs.txt").write_bytes(text.tobytes())
    prepare_text([str(out / "pairs.txt")], str(out / "text"), seq_len=32)
    return str(out / "text")


@pytest.fixture()
def mlflow_uri(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Points MLflow's process-wide tracking URI (what runs:/ resolves against) at a test's store, and back."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    monkeypatch.setattr(utils, "_tracking_uri", utils._tracking_uri)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return mlflow.set_tracking_uri


def fsdp_run(tmp_path: Path, config: Path | None, *overrides: str) -> TrainResult:
    """A 2-worker FSDP run with MLflow tracking into a SQLite store under `tmp_path`."""
    return train(load_config(config, [
        "scaling.num_workers=2", "train.parallel=fsdp", f"storage.path={tmp_path}/runs",
        f"tracking.uri=sqlite:///{tmp_path}/mlruns.db", "tracking.experiment=fsdp", *overrides]), verbose=False)


def checkpoint_model(result: TrainResult) -> dict[str, torch.Tensor]:
    """The final checkpoint's model, consolidated from the ranks' shards by torch's own DCP tools (not the
    product's reader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert result.checkpoint_path is not None
    assert (Path(result.checkpoint_path) / ".metadata").is_file()  # sharded: DCP's files, no state.pt
    full = Path(result.checkpoint_path).parent / "consolidated.pt"
    dcp_to_torch_save(result.checkpoint_path, full)
    return torch.load(full, weights_only=False)["model"]


def assert_finished_with_the_trained_model(result: TrainResult, mlflow_uri: Callable[[str], None],
                                           reference: torch.nn.Module, call: Callable[[Any], torch.Tensor]) -> None:
    """MLflow run FINISHED; `mlflow.pytorch.load_model` gives a model whose outputs (`call`) are those of
    `reference` holding the final checkpoint's weights."""
    import mlflow
    from mlflow.tracking import MlflowClient

    assert result.run_id is not None and result.tracking_uri is not None
    assert MlflowClient(tracking_uri=result.tracking_uri).get_run(result.run_id).info.status == "FINISHED"
    reference.load_state_dict(checkpoint_model(result))
    reference.eval()
    mlflow_uri(result.tracking_uri)
    loaded = mlflow.pytorch.load_model(f"runs:/{result.run_id}/model")
    with torch.no_grad():
        torch.testing.assert_close(call(loaded), call(reference), atol=1e-5, rtol=1e-5)


def assert_sharded_facts(result: TrainResult, reference: torch.nn.Module) -> None:
    """The first report's facts: the mode and rank 0's bytes, about half the model's (a row of padding more)."""
    first = result.history[0]
    full = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert first["parallel"] == "fsdp"
    assert full / 2 * 0.95 <= first["param_bytes_per_rank"] <= full / 2 * 1.25, (first["param_bytes_per_rank"], full)
    assert first["optimizer_bytes_per_rank"] >= 2 * first["param_bytes_per_rank"]  # AdamW: two moments per shard


# ---- tests -------------------------------------------------------------------------------------------------------


def digits_fsdp(tmp: Path, digits_dir: str, *overrides: str) -> TrainResult:
    """A user's MLP (held_model, 64 -> 32 -> 10; it holds only when asked) sharded per Linear over 2 workers on
    digits: fp32, 40 steps of 64 rows at lr 0.01, a checkpoint every 10, validated at the end, tracked under `tmp`."""
    return fsdp_run(tmp, None, f"data.train={digits_dir}/train", f"data.val={digits_dir}/val",
                    "train.fsdp.blocks=[Linear]", "train.global_batch_size=64", "train.precision=fp32",
                    "train.log_every=5", "train.max_steps=40", "train.eval_every=40", "checkpoint.every=10",
                    "optim.lr=0.01", "optim.warmup_steps=5", "failure.max_failures=2",
                    "model.entrypoint=held_model:build", *overrides)


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, digits_dir: str) -> TrainResult:
    return digits_fsdp(tmp_path_factory.mktemp("uninterrupted"), digits_dir)


def test_digits_mlp_trains_sharded_and_logs_the_whole_model(uninterrupted: TrainResult,
                                                            mlflow_uri: Callable[[str], None]) -> None:
    from held_model import build

    result = uninterrupted
    assert result.metrics["step"] == 40 and result.metrics["world_size"] == 2
    assert result.metrics["val_accuracy"] > 0.7  # 10 classes: chance is 0.1
    assert result.history[-1]["train_loss"] < 0.5 * result.history[0]["train_loss"]
    reference = build(64, 10)
    assert_sharded_facts(result, reference)
    x = torch.rand(5, 64) * 16
    assert_finished_with_the_trained_model(result, mlflow_uri, reference, lambda model: model(x))


def test_builtin_gpt_trains_sharded_per_block(ray_cluster: None, tmp_path: Path, text_dir: str,
                                              mlflow_uri: Callable[[str], None]) -> None:
    result = fsdp_run(tmp_path, ROOT / "examples" / "text-gpt.yaml", f"data.train={text_dir}/train",
                      f"data.val={text_dir}/val", "model.d_model=32", "model.n_layer=2", "model.n_head=2",
                      "train.max_steps=20", "train.log_every=10", "train.eval_every=20", "checkpoint.every=20",
                      "train.global_batch_size=16", "train.micro_batch_size=4", "train.fsdp.defer_sync=true",
                      "optim.warmup_steps=2")
    assert result.config.train.grad_accum_steps == 2
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"] < 6.0  # per token: ln(256) = 5.5
    assert 0 < result.metrics["val_accuracy"] < 1
    context = checkpoint_model(result)["position.weight"].shape[0]  # the data's sequence, less the last token
    reference = build_model("gpt", None, context, 256, result.config.model.kwargs)
    assert_sharded_facts(result, reference)
    tokens = torch.randint(0, 256, (3, context))
    assert_finished_with_the_trained_model(result, mlflow_uri, reference, lambda model: model(tokens))


def test_hugging_face_gpt2_trains_sharded_and_loads_as_its_own_class(
        ray_cluster: None, tmp_path: Path, text_dir: str, mlflow_uri: Callable[[str], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from examples.models import gpt2

    result = fsdp_run(tmp_path, ROOT / "examples" / "text-gpt2.yaml", f"data.train={text_dir}/train",
                      f"data.val={text_dir}/val", "model.context=33", "model.width=16", "train.max_steps=4",
                      "train.log_every=2", "train.eval_every=4", "checkpoint.every=4", "train.global_batch_size=8",
                      "train.micro_batch_size=2", "optim.warmup_steps=1")
    assert result.metrics["step"] == 4 and 0 < result.metrics["val_accuracy"] < 1
    reference = gpt2(256, context=33, width=16)
    assert_sharded_facts(result, reference)
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")  # a Hugging Face model is saved pickled
    import mlflow

    mlflow_uri(result.tracking_uri or "")
    assert type(mlflow.pytorch.load_model(f"runs:/{result.run_id}/model")).__name__ == "GPT2LMHeadModel"
    input_ids = torch.randint(0, 256, (2, 33))
    assert_finished_with_the_trained_model(result, mlflow_uri, reference,
                                           lambda model: model(input_ids=input_ids).logits)


# ---- checkpoints: a worker killed by PID mid-run resumes from the sharded checkpoints in S3 ---------------------


def test_worker_killed_by_pid_resumes_from_its_shards_in_s3_to_the_uninterrupted_weights(
        uninterrupted: TrainResult, tmp_path: Path, digits_dir: str, moto: Any, aws_env: None) -> None:
    """Every rank writes its shards of the checkpoints at steps 10 and 20 straight into run storage on S3; a worker
    killed in step 21 restarts the group from the newest registered checkpoint's shards, and the run ends bitwise
    where the uninterrupted run (local storage) ends: fp32 on CPU, same data order, reduction order and RNG
    streams."""
    import dataclasses
    import os
    import signal
    import threading
    import time
    import uuid

    import boto3
    import pyarrow.fs as pafs
    from ray.util.state import list_actors

    from orchestrator.training.checkpoint import check_complete
    from pipelines.storage import open_storage

    clean = checkpoint_model(uninterrupted)
    bucket = f"fsdp-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1").create_bucket(Bucket=bucket)
    hold, outcome = tmp_path / "hold", {}
    hold.mkdir()

    def target() -> None:
        try:
            outcome["result"] = digits_fsdp(tmp_path, digits_dir, f"storage.path=s3://{bucket}/runs",
                                            f"data.s3.endpoint={moto.url}", "model.hold_call=22",
                                            f"model.marker={hold}")
        except BaseException as exc:  # re-raised in the test thread
            outcome["error"] = exc

    fs = open_storage(f"s3://{bucket}/runs", load_config(None, [f"data.s3.endpoint={moto.url}"]).data.s3).filesystem()

    def complete() -> list[str]:
        infos = fs.get_file_info(pafs.FileSelector(f"{bucket}/runs", recursive=True, allow_not_found=True))
        return [i.path for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_0")
                and check_complete(fs, i.path) is None]

    def wait_for(check: Callable[[], Any], what: str, timeout: float = 240.0) -> Any:
        deadline = time.monotonic() + timeout
        while not (found := check()):
            assert time.monotonic() < deadline, f"{what} not seen within {timeout:.0f} s"
            time.sleep(0.2)
        return found

    thread = threading.Thread(target=target)
    thread.start()
    # Both workers hold in step 21 or 22 (held_model), after the checkpoints of steps 10 and 20 are committed.
    wait_for(lambda: len(complete()) >= 2 and len(list(hold.glob("held-*"))) == 2, "two checkpoints, workers held")
    workers = wait_for(lambda: [a for a in list_actors(filters=[("state", "=", "ALIVE")])
                                if a.class_name == "RayTrainWorker" and a.pid], "the training workers")
    os.kill(workers[-1].pid, signal.SIGKILL)
    (hold / "release").touch()
    thread.join(timeout=240)
    assert "error" not in outcome, outcome.get("error")
    result: TrainResult = outcome["result"]
    starts = [r["step"] for r in result.history if "world_rank" in r]  # the first report of each (re)start
    # Resumed from step 20's shards (or step 10's, if Ray had not registered step 20's yet): first report at 25 or 15.
    assert result.metrics["step"] == 40 and len(starts) == 2 and starts[1] in (15, 25), [r["step"] for r in
                                                                                         result.history]
    assert result.checkpoint_path is not None and result.checkpoint_path.startswith(f"s3://{bucket}/runs/")
    final = result.checkpoint_path.removeprefix("s3://")
    assert check_complete(fs, final) is None
    names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(final))}
    assert names == {".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"}  # each rank's own shards
    local = tmp_path / "final" / final.rsplit("/", 1)[-1]
    local.mkdir(parents=True)
    pafs.copy_files(final, str(local), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    resumed = checkpoint_model(dataclasses.replace(result, checkpoint_path=str(local)))
    assert resumed.keys() == clean.keys()
    for key in clean:
        assert torch.equal(resumed[key], clean[key]), f"{key} differs from the uninterrupted run"


@pytest.mark.timeout(300)
def test_out_of_memory_on_one_rank_ends_the_run_with_one_clear_error(ray_cluster: None, tmp_path: Path,
                                                                     digits_dir: str) -> None:
    import time

    from orchestrator.errors import UserError

    started = time.monotonic()
    # Rank 1's third forward (the second step's first micro-batch) runs out of memory while rank 0 goes on into
    # the step's all-gathers and reduce-scatter: not a hang, one error naming the key to lower. (No restart: each
    # would fail the same way, and cost a worker-group start.)
    with pytest.raises(UserError) as failed:
        fsdp_run(tmp_path, None, f"data.train={digits_dir}/train", "data.val=null", "model.entrypoint=oom_model:build",
                 "train.max_steps=5", "train.micro_batch_size=16", "train.global_batch_size=64",
                 "optim.warmup_steps=1", "failure.max_failures=0")
    assert "train.micro_batch_size" in str(failed.value) and "train.parallel=fsdp" in str(failed.value)
    assert time.monotonic() - started < 200
