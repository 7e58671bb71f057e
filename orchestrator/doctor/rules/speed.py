"""Doctor's rules on the training's pace: where a step's time and the device's memory go. Training
waiting on data (`data_pipeline`), free device memory (`memory_headroom`), a ddp model state too
large for a worker (`model_state`), fp32 on a bf16 GPU (`precision`), small kernels
(`compile_small_kernels`), the gradient all-reduce (`gradient_sync`) and one worker at another pace
than the rest (`uneven_workers`)."""

from __future__ import annotations

import math
import statistics

from orchestrator.doctor.record import (
    HIGH,
    LOW,
    MEDIUM,
    Finding,
    RunRecord,
    _elastic,
    _int_param,
    _world,
    batch_split,
    training_share,
)
from orchestrator.doctor.rules.autopilot import MEASURES, measured
from orchestrator.run.memory_plan import GIB


def data_pipeline(run: RunRecord) -> Finding | None:
    """Training waits on data: more prefetch, more read parallelism, the cache."""
    share = run.mean("time/data_wait_frac", "summary/time/data_wait_frac", "data_wait_frac")
    if share is None or share < 0.15:
        return None
    prefetch = int(run.param("data.prefetch_batches", "2") or 2)
    changes = [f"data.prefetch_batches={max(4, 2 * prefetch)}"]
    parallelism = run.param("data.read_parallelism")
    remote = str(run.param("data.train", "")).startswith(("s3://", "gs://"))
    if parallelism:
        changes.append(f"data.read_parallelism={2 * int(parallelism)}")
    # null reads as many shards at once as Ray has CPUs: object storage waits on the network instead
    elif remote:
        cpus = float(run.param("scaling.cpus_per_worker", "1") or 1) * _world(run)
        changes.append(f"data.read_parallelism={max(8, 4 * math.ceil(cpus))} (reads from "
                       "object storage wait on the network: four at once per CPU of the run)")
    cache = run.param("data.cache", "auto")
    if cache in ("none", "auto"):
        changes.append("data.cache=~/.cache/orchestrator/shards (each node keeps the remote "
                       "shards on its disk: later epochs read them from there)"
                       if remote else "data.cache=memory")
    if run.param("data.transforms") not in (None, "[]"):
        changes.append("data.transforms: cheaper or fewer per-batch "
                       "transforms (they run in the read path)")
    return Finding("data pipeline", HIGH if share >= 0.3 else MEDIUM, share,
                   f"training waited on data {share:.0%} of the time", tuple(changes))


def memory_headroom(run: RunRecord) -> Finding | None:
    """Device memory mostly free: a larger micro-batch runs the same samples in fewer, larger
    kernels."""
    peak, total = run.values("memory/peak_allocated_gb"), run.last("device/memory_total_gb")
    if not peak or not total:
        return None
    used = max(peak) / total
    if used >= 0.5:
        return None
    micro, batch = (int(run.last("micro_batch_size") or 0),
                    _int_param(run, "train.global_batch_size"))
    # auto probes memory outside the step: fsdp and replica groups refuse it; it derives the
    # accumulation itself.
    probes = run.param("train.parallel") != "fsdp" and run.param("failure.mode") != "replicas"
    changes = ["train.micro_batch_size=auto --set train.grad_accum_steps=null (the largest "
               "micro-batch that fits, measured on the device)"] if probes else []
    # global = micro x accumulation x workers: a doubled micro-batch halves an even accumulation,
    # else it needs a doubled global batch (the config refuses a micro-batch that does not divide
    # it).
    accum = batch // (micro * _world(run)) if micro and batch else 0
    if accum > 1 and measured(run, "micro_batch_size"):
        # the autopilot measured larger micro-batches at this global batch and kept the fastest
        return None
    doubled = None
    if accum and accum % 2 == 0:
        doubled, why = batch_split(run, micro=2 * micro), "half the accumulation steps"
    elif micro and batch:
        doubled = batch_split(run, 2 * batch, 2 * micro)
        why = ("no accumulation left to trade: twice the samples per step changes the "
               "optimisation, so retune optim.lr and compare the loss")
    if doubled:
        changes.append(f"{doubled} ({why})")
    if accum > 1:  # an accumulation to trade: the split is the autopilot's to measure
        changes.append(f"{MEASURES}: the micro-batch split at "
                       "this global batch, on the run's own steps")
    return Finding("memory headroom", MEDIUM if used < 0.3 else LOW, 1 - used,
                   f"device memory peaked at {max(peak):.1f} of "
                   f"{total:.0f} GiB ({used:.0%})", tuple(changes))


def model_state(run: RunRecord) -> Finding | None:
    """Under ddp every worker holds the whole model state (parameters, their gradients and the
    optimizer state, from the worker's facts): when it takes over half a worker's memory
    (train.memory_budget_gb, else the device's) or a worker ran out of memory, and fsdp's shards
    over the run's workers would take at most half, shard it."""
    if (run.param("train.parallel") or "ddp") != "ddp":
        return None
    params, optimizer = run.last("param_bytes_per_rank"), run.last("optimizer_bytes_per_rank")
    budget = run.param("train.memory_budget_gb")
    memory_gb = float(budget) if budget else run.last("device/memory_total_gb")
    world = _world(run)
    if params is None or optimizer is None or not memory_gb or world < 2:
        return None
    # the gradients are as large as the parameters (fp32 master copies)
    state = 2 * params + optimizer
    share, sharded = state / (memory_gb * GIB), state / world
    failures = " ".join(v for k, v in run.tags.items()
                        if k.startswith("orchestrator.failure.")).lower()
    oom = bool(run.last("oom_retries")) or "out of memory" in failures
    if sharded > memory_gb * GIB / 2 or (share <= 0.5 and not oom):
        return None
    title = (f"under ddp each worker holds {state / GIB:.1f} GiB of model state (parameters, "
             f"gradients, optimizer state), {share:.0%} of its {memory_gb:g} GiB"
             + (" and ran out of memory" if oom else "")
             + f"; fsdp over {world} workers would hold {sharded / GIB:.1f} GiB")
    # What fsdp refuses goes with it: local SGD, compile, the auto micro-batch, replica groups.
    extra = [*(["train.sync=ddp"] if run.param("train.sync") == "local_sgd" else []),
             *(["train.compile=false"] if run.param("train.compile") in ("True", "true") else []),
             *([f"train.micro_batch_size={int(micro)}"]
               if run.param("train.micro_batch_size") == "auto"
               and (micro := run.last("micro_batch_size")) else []),
             *(["failure.mode=restart"] if run.param("failure.mode") == "replicas" else [])]
    return Finding("model state", HIGH if oom or share >= 1 else MEDIUM, share, title,
                   (" --set ".join(["train.parallel=fsdp", *extra]),))


def precision(run: RunRecord) -> Finding | None:
    """fp32 on a GPU with bf16 support: about twice the math throughput and half the activation
    memory."""
    used = run.tags.get("orchestrator.precision") or run.param("train.precision")
    if used != "fp32" or not run.last("device/cuda") or not run.last("device/bf16_supported"):
        return None
    if measured(run, "precision"):
        return None  # the autopilot measured bf16 against fp32 on this run: fp32 was the faster
    return Finding("precision", HIGH, 1.0, "trained in fp32 on a GPU that supports bf16",
                   ("train.precision=bf16", f"{MEASURES} (bf16 against fp32 on this "
                                            "device) when train.precision is left auto"))


def compile_small_kernels(run: RunRecord) -> Finding | None:
    """Low MFU with little work per micro-batch: launch overhead dominates, which torch.compile
    fuses away."""
    mfu, flops, micro = run.mean("mfu"), run.last("flops_per_sample"), run.last("micro_batch_size")
    compiled = run.param("train.compile") in ("True", "true")
    if mfu is None or mfu >= 0.2 or compiled or measured(run, "compile"):
        # compiled already, or the autopilot measured compile on this run and kept the faster
        return None
    if run.param("train.parallel") == "fsdp":
        return None  # fsdp does not compile yet (the config refuses both)
    if flops and micro and flops * micro >= 5e10:
        return None  # big kernels: compiling will not lift this MFU much; the other findings will
    work = f", {flops * micro / 1e9:.2g} GFLOP per micro-batch" if flops and micro else ""
    return Finding("compile", MEDIUM, 0.2 - mfu, f"MFU {mfu:.1%}{work}: small kernels",
                   ("train.compile=true", f"{MEASURES}: compiled against "
                                          "eager, its compile time counted"))


# gradients per step below which an all-reduce is latency-bound, not bandwidth-bound
SMALL_MODEL_BYTES = 100e6
LOCAL_SGD_EVERY = 8  # train.sync_every's null


def gradient_sync(run: RunRecord) -> Finding | None:
    """Workers spent a large share of the training in the gradient all-reduce (the exposed part,
    beyond compute). A small model gains little from more workers: the all-reduce's fixed latency is
    paid every step while each worker's compute shrinks, so fewer workers or local SGD (averaging
    every few steps) train faster."""
    share, world = training_share(run, "sync"), _world(run)
    if share is None or share < 0.1 or world < 2:
        return None
    per_sample, batch = (run.values("comm_bytes_per_sample"),
                         _int_param(run, "train.global_batch_size"))
    grad_bytes = statistics.median(per_sample) * batch if per_sample and batch else None
    size = f", {grad_bytes / 1e6:.2g} MB of gradients per step" if grad_bytes else ""
    title = f"gradient sync took {share:.0%} of the training time ({world} workers{size})"
    doubled = batch_split(run, 2 * batch) if batch else None
    halve = [f"{doubled} (half the all-reduces per sample; twice the samples per step changes the "
             "optimisation, so retune optim.lr and compare the loss)"] if doubled else []
    # Local SGD averages whole replicas every few steps: fsdp's shards and replica groups' per-step
    # quorum refuse it.
    refused = run.param("train.parallel") == "fsdp" or run.param("failure.mode") == "replicas"
    local_sgd = [] if refused else [
        "train.sync=local_sgd (each worker steps alone and the workers average their "
        f"parameters every {LOCAL_SGD_EVERY} steps, not their gradients every step: this "
        "changes the optimisation, so compare the validation loss as well as samples/s)"]
    if run.param("train.parallel") == "fsdp":
        accumulates = (_int_param(run, "train.grad_accum_steps", 1) or 1) > 1
        deferred = run.param("train.fsdp.defer_sync") == "True"
        changes = [*(["train.fsdp.defer_sync=true (one reduce-scatter per optimizer step, not "
                      "one per micro-batch; each worker then holds unsharded gradients)"]
                     if accumulates and not deferred else []), *halve]
    elif run.param("train.sync") == "local_sgd":
        every = _int_param(run, "train.sync_every", LOCAL_SGD_EVERY) or LOCAL_SGD_EVERY
        changes = [f"train.sync_every={2 * every} (average the parameters "
                   "half as often: this changes the optimisation further, "
                   "so compare the validation loss as well as samples/s)"]
    elif grad_bytes is not None and grad_bytes < SMALL_MODEL_BYTES:
        smallest = 2 if run.param("failure.mode") == "replicas" else 1  # a group the mode allows
        fewer = (batch_split(run, workers=world // 2)
                 if world // 2 >= smallest and not _elastic(run) else None)
        changes = [*([f"{fewer} (a model this small is latency-bound: compare samples/s)"]
                     if fewer else []), *local_sgd]
    else:
        changes = [*local_sgd, *halve]
    if not changes:
        return None
    return Finding("gradient sync", HIGH if share >= 0.25 else MEDIUM, share, title, tuple(changes))


# Each rank's own pace: its samples over its own compute and data-wait seconds (waits on other ranks
# left out). The loop does not report it yet (see docs/doctor.md); the rule reads it when it is
# there.
WORKER_RATE = "worker/{rank}/samples_per_s"


def uneven_workers(run: RunRecord) -> Finding | None:
    """One worker much faster or slower than the others: under DDP every rank waits for the slowest
    each step, so the run goes at its pace. A lone fast worker means the others are slow (sharing a
    node's cores, say)."""
    rates = {rank: statistics.median(values) for rank in range(_world(run))
             if (values := run.values(WORKER_RATE.format(rank=rank)))}
    if len(rates) < 2:
        return None

    def ratio(rank: int) -> float:
        return rates[rank] / max(statistics.median(r for k, r in rates.items() if k != rank), 1e-9)

    odd = max(rates, key=lambda rank: abs(math.log(max(ratio(rank), 1e-9))))
    factor = ratio(odd)
    if 1 / 1.5 < factor < 1.5:
        return None
    others = sorted(r for k, r in rates.items() if k != odd)
    spread = f"{others[0]:,.0f}" if len(others) == 1 else f"{others[0]:,.0f}-{others[-1]:,.0f}"
    title = (f"worker {odd} ran at {rates[odd]:,.0f} samples/s, {factor:.1f}x "
             f"the others ({spread}); every step waits for the slowest")
    cpus = run.param("scaling.cpus_per_worker", "1")
    slow = "the other workers' nodes" if factor > 1 else f"worker {odd}'s node"
    changes = (f"check {slow}: other load, fewer free cores, "
               "a slower device (`ray status`, the dashboard)",
               f"check scaling.cpus_per_worker (now {cpus}) against a node's cores over its "
               "workers: Ray places workers by it and each worker runs that many torch threads")
    severity = HIGH if max(factor, 1 / factor) >= 2 else MEDIUM
    return Finding("uneven workers", severity, abs(math.log(factor)), title, changes)
