"""Device-memory care: the largest micro-batch that fits, out-of-memory detection, CUDA memory
statistics."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from orchestrator.errors import ConfigError

GIB = 1024**3


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


# Free device memory below this share of the total counts as pressure: after an evaluation the cache
# is handed back.
PRESSURE_SHARE = 0.10


def release_cached_memory(device: torch.device) -> None:
    """Hand cached blocks back to the driver: after an out-of-memory error (the step is retried
    smaller), after probing. Collects garbage first, so blocks that only reference cycles held are
    cached (then freed) too."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def under_pressure(free: int, total: int, share: float = PRESSURE_SHARE) -> bool:
    """Whether a device with `free` of its `total` bytes free (cudaMemGetInfo's figures: other
    processes and memory outside torch's allocator count) is short of memory."""
    return free < share * total


def release_if_pressed(device: torch.device, share: float = PRESSURE_SHARE) -> bool:
    """After an evaluation: hand cached blocks back only when the device is short of memory
    (`under_pressure`), for what allocates outside torch's cache (NCCL, another process). Otherwise
    the cache stays: emptying it waits for the device and makes the next steps cudaMalloc the same
    blocks again, and the collection before it costs tens of milliseconds on a big model's Python
    heap; torch's allocator itself frees cached blocks and retries before it reports out of memory.
    On the CPU there is no cache: nothing. The figures are the driver's (cudaMemGetInfo, a host-side
    query that queues nothing and waits for no kernel). Returns whether it released."""
    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    if not under_pressure(free, total, share):
        return False
    release_cached_memory(device)
    return True


def device_facts(device: torch.device) -> dict[str, float]:
    """Numbers about the device, reported once: is it a GPU, does it run bf16 natively (torch's
    default also counts pre-Ampere GPUs that only emulate it, slower than fp16), how much memory it
    has."""
    if device.type != "cuda":
        return {"device/cuda": 0.0}
    native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    return {"device/cuda": 1.0, "device/bf16_supported": float(native_bf16),
            "device/memory_total_gb": torch.cuda.get_device_properties(device).total_memory / GIB}


# The allocator keeps one peak counter per device, and two windows read it: a report's interval
# (cuda_memory_stats) and an autopilot candidate (restart_peak). A candidate's restart keeps the
# interval's peak so far here.
_interval_peaks: dict[torch.device, int] = {}


def cuda_memory_stats(device: torch.device) -> dict[str, float]:
    """Allocated / reserved GiB now, the interval's peak allocated (since the last report: every
    candidate the autopilot measured in it included), and the reserved-minus-allocated gap (cached
    but unused: fragmentation)."""
    if device.type != "cuda":
        return {}
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    peak = max(torch.cuda.max_memory_allocated(device), _interval_peaks.pop(device, 0))
    stats = {
        "memory/allocated_gb": allocated / GIB,
        "memory/reserved_gb": reserved / GIB,
        "memory/peak_allocated_gb": peak / GIB,
        "memory/reserved_unused_gb": (reserved - allocated) / GIB,
    }
    torch.cuda.reset_peak_memory_stats(device)
    return stats


def restart_peak(device: torch.device) -> None:
    """Start torch.cuda.max_memory_allocated afresh (an autopilot candidate's own peak), the peak so
    far kept for the report's interval."""
    _interval_peaks[device] = max(_interval_peaks.get(device, 0),
                                  torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)


def divisors_descending(n: int) -> list[int]:
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def activation_bytes_per_sample(model: torch.nn.Module, samples: int,
                                loss: Callable[[], torch.Tensor]) -> float:
    """Bytes autograd keeps for backward per sample, measured on a small batch of `samples` rows
    whose forward and loss `loss()` computes (each storage counted once; parameters are not
    activations and are counted in `state_bytes`)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = loss()
    out.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values()) / samples


def state_bytes(model: torch.nn.Module, optimizer_slots: int) -> int:
    """Parameters + gradients + optimizer state (AdamW keeps 2 slots per parameter, SGD with
    momentum 1)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return params * (2 + optimizer_slots)


def fit_micro_batch_cpu(per_worker: int, state: int, per_sample: float, budget_bytes: float) -> int:
    """Largest divisor of the per-worker batch whose estimated footprint fits the budget."""
    for size in divisors_descending(per_worker):
        if state + size * per_sample <= budget_bytes:
            return size
    raise ConfigError(
        f"the model needs {state / GIB:.2f} GiB for weights, gradients and "
        f"optimizer state plus {per_sample / 1024**2:.2f} MiB per sample, "
        f"more than train.memory_budget_gb={budget_bytes / GIB:g} allows "
        "even at micro-batch 1: raise the budget or use a smaller model"
    )


def fit_micro_batch_cuda(per_worker: int, try_step: Callable[[int], None],
                         device: torch.device) -> int:
    """Largest divisor of the per-worker batch for which a real forward+backward+optimizer step does
    not run out of memory. Sizes are tried from small to large (doubling through the divisors),
    stopping at the first OOM."""
    sizes = sorted(divisors_descending(per_worker))

    def fits(size: int) -> bool:
        try:
            try_step(size)
            return True
        except Exception as exc:  # only OOM is expected; anything else is re-raised
            if not is_oom(exc):
                raise
            return False
        finally:
            release_cached_memory(device)

    best, failed, index = 0, None, 0
    while index < len(sizes):
        if not fits(sizes[index]):
            failed = sizes[index]
            break
        best = sizes[index]
        # Next candidate: the smallest divisor at least twice as large (or simply the next one).
        index = next((i for i in range(index + 1, len(sizes)) if sizes[i] >= 2 * best), index + 1)
    if failed is not None:  # between the last fit and the first OOM, take the largest that fits
        best = next((s for s in reversed(sizes) if best < s < failed and fits(s)), best)
    if best == 0:
        raise ConfigError("not even a micro-batch of 1 fits in GPU "
                          "memory: use a smaller model or a larger GPU")
    return best
