"""`train.micro_batch_size: auto` over padded token columns (training/micro_batch.py, step.cut): the probe measures the
driver's sample rows, padded to their own longest row, so a later micro-batch padded longer holds more than the probe
ran. Under DDP an out-of-memory error in a step's synced (last) piece is not retried (step._forward_backward), and a
one-piece run has only that piece: such a batch would end the run. The step cuts it instead, into pieces no wider in
cells than the probe's. In-process, the device emulated by a model that runs out of memory past what the probe ran,
with DDP's `no_sync` so that the step treats its last piece as DDP's synced one."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import torch

from orchestrator.config import Config, load_config
from orchestrator.models.tasks import CausalLM, ModelCall
from orchestrator.training.micro_batch import with_auto_micro_batch
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision
from orchestrator.training.step import cut, train_step
from pipelines.batches import collate_arrow, collate_sample
from pipelines.tensors import Batch

CPU = torch.device("cpu")
VOCAB, ROWS = 32, 8
TOKENS = {"input_ids": "input_ids", "attention_mask": "attention_mask"}


class DeviceOfTheProbe(torch.nn.Module):
    """A tiny language model on a device that holds `cells` token positions per forward (what the probe ran), and
    runs out of memory past them, as a GPU does. `no_sync` as DDP's: the step's last piece is then its synced one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)
        self.cells: int | None = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.cells is not None and input_ids.numel() > self.cells:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return self.head(self.embed(input_ids) * attention_mask[..., None])

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


def _config() -> Config:
    return load_config(None, ["scaling.num_workers=1", f"train.global_batch_size={ROWS}", "train.micro_batch_size=auto",
                              "train.memory_budget_gb=4", "data.features=[input_ids]", "data.label=null",
                              "model.inputs=[input_ids, attention_mask]", "task.name=causal_lm", "optim.warmup_steps=0",
                              "train.max_steps=10"])


def _parts(cfg: Config, model: torch.nn.Module) -> Parts:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU, task=CausalLM(shift=True),
                 call=ModelCall(TOKENS))


def _rows(lengths: list[int], seed: int) -> pa.Table:
    g = torch.Generator().manual_seed(seed)
    return pa.table({"input_ids": [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]})


def _collated(cfg: Config, table: pa.Table) -> Batch:
    return collate_sample(table, cfg.data, named=True)  # as RankBatches collates a fetch: padded to its longest


def test_a_batch_padded_longer_than_the_probes_trains_instead_of_ending_a_one_piece_run() -> None:
    cfg = _config()
    model = DeviceOfTheProbe()
    parts = _parts(cfg, model)
    sample = _collated(cfg, _rows([3, 5, 4, 6, 2, 5, 6, 4], seed=0))  # the driver's first rows: at most 6 tokens
    cfg = with_auto_micro_batch(cfg, parts, None, sample)
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum_steps) == (ROWS, 1)  # one piece: DDP's synced one
    model.cells = ROWS * sample["input_ids"].shape[1]  # the device holds what the probe ran, no more
    reference = copy.deepcopy(model)
    reference.cells = None
    short = _collated(cfg, _rows([2, 6, 5, 1, 3, 6, 4, 2], seed=1))
    assert len(cut(parts, [short])) == 1  # no wider than the probe's: one piece, as measured
    long = collate_arrow(_rows([20, 3, 22, 7, 1, 16, 9, 2], seed=2), ["input_ids"], None, named=True)
    assert long["input_ids"].shape[1] == 22  # 3.7 times the probe's 6: cut in 4 pieces of 2 rows (3 would not fit)
    train_step(parts, [long])  # out of memory in the one, synced, piece: the run would end here
    assert parts.state.oom_retries == 0 and parts.state.split == 1  # cut ahead, not retried; the next steps as measured
    expected = _parts(cfg, reference)
    train_step(expected, [long])
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)  # the same update: same rows, same normaliser
