"""The sections of how the model is trained: train (length, batch arithmetic, precision, cadence,
parallel mode and sync), optim (the optimizer and its learning-rate schedule) and autopilot (the
speed settings measured on the run's first steps)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.config.base import _key_error, _Section

Precision = Literal["auto", "bf16", "fp16", "fp32"]

MAX_SEED = 2**32 - 1  # numpy's global seed (set on every worker) takes no more


class FSDPConfig(_Section):
    """train.parallel=fsdp: how the model is cut into sharded units (training/fsdp.py)."""

    blocks: list[str] | None = Field(None,
                                     description="Class names of the blocks sharded one by "
                                                 "one (e.g. [MyBlock]); null: a Hugging Face "
                                                 "model's _no_split_modules or the built-in "
                                                 "gpt's Block, else the whole model as one "
                                                 "unit (no memory saved in compute).")
    defer_sync: bool = Field(False, description="With grad_accum_steps > 1, reduce-scatter "
                             "gradients once per optimizer step instead of once per micro-batch: "
                             "less communication, but each rank holds unsharded gradients (the "
                             "whole model's size) until the step.")


class TrainConfig(_Section):
    """Length of training, batch arithmetic, precision and cadence of logging/eval."""

    max_steps: int | None = Field(300, ge=1, description="Optimizer steps; or set epochs instead.")
    epochs: float | None = Field(None, gt=0,
                                 description="Passes over the training set (converted to steps).")
    global_batch_size: int = Field(128, ge=1,
                                   description="Samples per optimizer step, "
                                               "summed over all workers.")
    micro_batch_size: int | Literal["auto"] | None = Field(
        None, json_schema_extra={"accepts": "a count, auto, or null to derive it"},
        description="Samples per forward pass per worker; derived, or `auto`: the largest that "
                    "fits memory.",
    )
    grad_accum_steps: int | None = Field(None, ge=1,
                                         description="Micro-batches per optimizer step; derived.")
    precision: Precision = Field("auto",
                                 description="auto picks bf16 where the device supports it.")
    compile: bool = Field(False, description="Wrap the model in torch.compile (falls back to eager "
                                             "on failure).")
    flush_denormal: bool = Field(True,
                                 description="On CPU, treat subnormal floats as zero: late in "
                                             "training tiny gradients and optimizer moments "
                                             "make float math on them several times slower.")
    torch_threads: int | None = Field(None, ge=1,
                                      description="torch's intra-op threads per worker; "
                                                  "null: Ray's default, the worker's "
                                                  "CPUs (scaling.cpus_per_worker).")
    memory_budget_gb: float | None = Field(
        None, gt=0, description="CPU only, with micro_batch_size=auto: memory one worker may use "
        "for the model, its gradients, optimizer state and activations (default: half the node's "
        "RAM over its workers)."
    )
    peak_tflops: float | None = Field(None, gt=0,
                                      description="Peak TFLOP/s of one device in the precision "
                                                  "the run uses, for MFU on devices missing "
                                                  "from the built-in tables (CPUs, new GPUs).")
    tf32: bool = Field(False, description="GPU only: fp32 matrix products and convolutions on TF32 "
                       "tensor cores (Ampere and later: about 8x fp32's peak, a 10-bit mantissa, "
                       "so slightly different math). Off: fp32 stays fp32 (cuDNN's convolutions "
                       "included, which torch otherwise runs in TF32).")
    seed: int = Field(0, ge=0, le=MAX_SEED,
                      description="Seeds the model init, the data order and the workers' RNGs.")
    max_nonfinite_steps: int = Field(10, ge=0,
                                     description="Steps with a NaN/inf loss or gradient "
                                                 "that are skipped (no update) before "
                                                 "training stops with an error.")
    log_every: int = Field(25, ge=1, description="Steps between reports (each report is a barrier; "
                                                 "keep it >= 10).")
    eval_every: int | None = Field(100, ge=1,
                                   description="Steps between validation passes; also at the end.")
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: every worker holds the whole model, its gradients and optimizer "
        "state; fsdp: they are sharded across the workers (FSDP2), for models bigger than one "
        "device.")
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig,  # type: ignore[arg-type]
                             description="With parallel=fsdp: how the model is cut into sharded "
                                         "units.")
    sync: Literal["ddp", "local_sgd"] = Field(
        "ddp", description="ddp: all-reduce gradients every step; local_sgd: each worker takes "
        "sync_every optimizer steps alone, then the workers average their parameters (~sync_every "
        "x less communication)."
    )
    sync_every: int | None = Field(None, ge=1,
                                   description="local_sgd: optimizer steps between parameter "
                                               "averages (null = 8). Only these steps and "
                                               "the last average the replicas: evaluation "
                                               "and checkpoints between two see their "
                                               "average and leave each replica as it was.")
    outer_lr: float | None = Field(None, gt=0,
                                   description="local_sgd: step size on the averaged change "
                                               "since the last sync (null = 1.0, plain "
                                               "averaging; 0.7 with outer_momentum, DiLoCo's).")
    outer_momentum: float | None = Field(None, gt=0, lt=1,
                                         description="local_sgd: Nesterov momentum of the "
                                                     "outer step on the averaged change "
                                                     "(DiLoCo uses 0.9); null = none.")

    @field_validator("micro_batch_size")
    @classmethod
    def _positive_micro_batch(cls, value: int | str | None) -> int | str | None:
        # Checked here, not by Field(ge=1): the bound would apply to the union and report against
        # its members.
        if isinstance(value, int) and value < 1:
            raise ValueError(f"must be at least 1, got {value}: set a positive size, auto, or null "
                             "to derive it")
        return value

    @model_validator(mode="before")
    @classmethod
    def _epochs_replace_steps(cls, data: Any) -> Any:
        # Asking for epochs means "not the default max_steps"; both given explicitly is a
        # contradiction.
        if isinstance(data, dict) and data.get("epochs") is not None and "max_steps" not in data:
            data = {**data, "max_steps": None}
        return data

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of train.max_steps and train.epochs")
        # By value, not by fields_set: a saved full config (nulls included) must load again.
        dead = [k for k in ("sync_every", "outer_lr", "outer_momentum")
                if getattr(self, k) is not None]
        if self.sync == "ddp" and dead:
            raise ValueError(f"train.{dead[0]} has no effect with train.sync=ddp; remove it or set "
                             "train.sync=local_sgd")
        if self.parallel == "fsdp" and self.sync == "local_sgd":
            raise ValueError("train.sync=local_sgd averages whole replicas and cannot run on "
                             "sharded parameters: use train.parallel=ddp with local_sgd, or "
                             "train.sync=ddp with fsdp")
        if self.parallel == "fsdp" and self.compile:
            raise ValueError("train.compile=true does not combine with train.parallel=fsdp yet: "
                             "set train.compile=false (or train.parallel=ddp)")
        if self.parallel == "fsdp" and self.micro_batch_size == "auto":
            raise ValueError("train.micro_batch_size=auto cannot probe memory under "
                             "train.parallel=fsdp: set train.micro_batch_size to a number (or "
                             "train.parallel=ddp)")
        if self.parallel == "ddp" and self.fsdp != FSDPConfig():
            raise ValueError("train.fsdp has no effect with train.parallel=ddp; remove it or set "
                             "train.parallel=fsdp")
        return self

    @property
    def local_sgd(self) -> tuple[int, float, float | None]:
        """(sync_every, outer_lr, outer_momentum) with their defaults."""
        outer_lr = self.outer_lr
        if outer_lr is None:
            outer_lr = 0.7 if self.outer_momentum else 1.0
        return self.sync_every or 8, outer_lr, self.outer_momentum


class OptimConfig(_Section):
    name: Literal["adamw", "sgd"] = Field("adamw", description="adamw, or sgd (Nesterov momentum).")
    lr: float = Field(3.0e-3, gt=0, description="Peak learning rate, reached at the end of the "
                                                "warmup.")
    weight_decay: float = Field(0.01, ge=0,
                                description="Weight decay, given to the optimizer as is.")
    momentum: float | None = Field(None, ge=0, lt=1, description="SGD only (default 0.9).")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup from 0 to lr.")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after the warmup, indexed by optimizer step at a fixed global "
        "batch (i.e. by samples), so a resize or another micro-batch does not bend it.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1,
                                description="Final lr as a fraction of lr (cosine/linear).")
    max_grad_norm: float | None = Field(1.0, gt=0,
                                        description="Clip the global gradient "
                                                    "norm; null = no clip.")

    @model_validator(mode="after")
    def _no_dead_options(self) -> OptimConfig:
        if self.name != "sgd" and self.momentum is not None:
            raise ValueError(f"optim.momentum has no effect with optim.name={self.name}; remove it "
                             "or use sgd")
        if self.schedule == "constant" and self.min_lr_ratio:
            raise ValueError("optim.min_lr_ratio has no effect with optim.schedule=constant; "
                             "remove it")
        return self


class AutopilotConfig(_Section):
    """The autopilot (training/autopilot.py): the run's first steps measure the settings that
    leave the math of training unchanged (micro-batch at the fixed global batch, compile, torch
    threads, flush_denormal, precision when auto), then the rest of the run trains with the
    fastest. Every measured step is a real step of the run."""

    enabled: bool = Field(False, description="Measure the speed checklist (micro-batch, compile, "
                          "threads, flush_denormal, precision when auto) on the run's first steps, "
                          "then train with the fastest; the choice is saved in the checkpoint and "
                          "kept on resume.")
    budget: float = Field(0.05, gt=0, le=0.5,
                          description="Most of the run's expected wall clock (max_steps x the "
                                      "starting config's step time) the search may spend; a "
                                      "run too short to pay for it trains with its config.")
    allow: list[Literal["sync", "tf32"]] = Field(
        default_factory=list, description="Settings that change the math of training, measured too "
        "only when listed here: sync (train.sync local_sgd against ddp, on 2 workers or more; "
        "local_sgd's own settings, or its defaults); tf32 (train.tf32 flipped, on a GPU while the "
        "run trains in fp32: train.precision fp32, or auto once fp32 beat bf16). Their rows show "
        "the loss over the measured steps beside the speed.")

    def check_allowed(self, use_gpu: bool, precision: str) -> None:
        """Refuses an allowed setting the run can never measure: TF32 exists on GPUs only, and
        changes fp32's matrix products only (under bf16 or fp16 autocast they already run in the
        narrower type)."""
        if "tf32" in self.allow and (not use_gpu or precision in ("bf16", "fp16")):
            why = ("needs a GPU (CPUs have no TF32): set scaling.use_gpu=true" if not use_gpu else
                   f"has no effect with train.precision={precision} (TF32 changes fp32's matrix "
                   "products only): set train.precision=fp32 or auto")
            raise _key_error(("autopilot", "allow"), f"autopilot.allow=[tf32] {why}, or remove "
                             "tf32 from autopilot.allow", self.allow)
