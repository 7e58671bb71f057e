"""Fully sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`): each rank keeps
1/world of every parameter, gradient and optimizer slot, all-gathers a block's parameters just
before its forward (and again for its backward) and reduce-scatters its gradients right after.
Checkpoints are sharded (`torch.distributed.checkpoint`: every rank writes its own shards) and
reshard on load when the world size changed.

The step is the DDP step: a per-rank loss of sum / global targets times the world size, because
FSDP's reduce-scatter averages over ranks as DDP's all-reduce does. What differs is gathered here:
how the model is wrapped (`shard_model`), gradient accumulation (`gradient_sync`), clipping
(`clip_grad_norm`), recovery after an exception in forward/backward (`recover`), and state
(`save_sharded`, `load_sharded`, `full_state_dict`)."""

from __future__ import annotations

import io
import sys
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from orchestrator.errors import ConfigError
from orchestrator.training.precision import Mode
from orchestrator.training.unpickle import load_state_file

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

# torch's FSDP, DTensor and DCP modules are imported where they are used: they cost about half a
# second to import, and the driver and a one-process Tune trial never need them (a DDP worker still
# gets FSDP and DTensor, which torch's DistributedDataParallel imports itself, but not DCP).

# Block classes of built-in models that do not name their own (`_no_split_modules`): qualified class
# name -> blocks.
BUILTIN_BLOCKS: dict[str, tuple[str, ...]] = {"orchestrator.models.GPT": ("Block",)}
# the caller's picklable state beside model and optimizer in a sharded checkpoint
EXTRA_KEY = "extra"


def mesh_of_all_ranks(device: torch.device) -> DeviceMesh:
    """The 1-D data-parallel mesh over every rank of the default process group (gloo on CPU, nccl on
    GPU)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def _loaded_class(module: str, name: str) -> type | None:
    """`module.name` if `module` is imported, else None: no instance of a class can exist before its
    module is imported, so "not imported" means "none here" without importing it."""
    found = sys.modules.get(module)
    return getattr(found, name, None) if found is not None else None


def _is_dtensor(t: Any) -> bool:
    dtensor = _loaded_class("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(t, dtensor)


def block_names(model: nn.Module, blocks: Sequence[str] | None = None) -> list[str]:
    """The class names to shard one by one: `blocks` when the user names them (train.fsdp.blocks),
    else a Hugging Face model's `_no_split_modules` (its transformer layer classes), else a built-in
    model's (BUILTIN_BLOCKS)."""
    if blocks is not None:
        return list(blocks)
    own = getattr(model, "_no_split_modules", None)
    if own:
        return list(own)
    return list(BUILTIN_BLOCKS.get(f"{type(model).__module__}.{type(model).__qualname__}", ()))


def find_blocks(model: nn.Module, blocks: Sequence[str] | None = None) -> list[nn.Module]:
    """The submodules (not the model itself) whose class name is one of `block_names`, in
    `modules()` order. ConfigError when the user named a class the model does not have."""
    names = block_names(model, blocks)
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if blocks is not None and missing:
        raise ConfigError("config key 'train.fsdp.blocks': the model has no module "
                          f"of class {missing}; its classes: {sorted(present)}")
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def mixed_precision_policy(precision: Mode) -> MixedPrecisionPolicy:
    """bf16/fp16: blocks compute with parameters gathered in the low dtype (half the all-gather
    bytes), gradients are reduced and kept in fp32 (sums of many ranks' small gradients lose bits in
    16 bits), and the sharded master parameters the optimizer updates stay fp32. fp32: no casts."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if low is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def shard_model(model: nn.Module, *, mesh: DeviceMesh, blocks: Sequence[str] | None = None,
                precision: Mode = "fp32", reshard_after_forward: bool = True) -> nn.Module:
    """`fully_shard` each block (bottom-up: an inner block before the one holding it), then the
    root, which takes every parameter not in a block (embeddings, heads, and weights tied between
    them stay in one unit). Returns the same module, now an FSDPModule whose parameters are DTensor
    shards; its state_dict keys are unchanged.

    Without any block (a plain MLP that names none) the whole model is one unit: every rank then
    all-gathers all parameters at once, so the peak holds the full model as DDP does; only gradients
    and optimizer state at rest are sharded. `reshard_after_forward=False` keeps gathered blocks
    from forward to backward (one all-gather fewer per block, the full model's parameters held
    through the backward).

    fp16 works with the product's GradScaler: DTensor gradients unscale through a handler that
    max-reduces the found-inf flag over the mesh, so every rank skips an overflowing step
    together."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    policy = mixed_precision_policy(precision)
    found = find_blocks(model, blocks)
    if not found:
        warnings.warn(f"FSDP found no block to shard in {type(model).__name__}: "
                      "the whole model is one unit, so each rank gathers all its "
                      "parameters at once (peak memory as with DDP); name the "
                      "repeated layer classes in train.fsdp.blocks", stacklevel=2)
    # modules() is pre-order: reversed, an inner block comes before its holder
    for block in reversed(found):
        if not isinstance(block, FSDPModule):
            fully_shard(block, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def is_sharded(model: nn.Module) -> bool:
    fsdp_module = _loaded_class("torch.distributed.fsdp", "FSDPModule")
    return fsdp_module is not None and isinstance(model, fsdp_module)


@contextmanager
def gradient_sync(model: nn.Module, synced: bool, defer: bool = True) -> Iterator[None]:
    """Around forward and backward of one micro-batch: FSDP's counterpart of DDP's `no_sync` on all
    but the last.

    `defer=True` (and `synced=False`): no reduce-scatter for this micro-batch; each rank accumulates
    the *unsharded* fp32 gradients of the whole model until the last micro-batch reduce-scatters
    their sum once. One gradient exchange per step (as DDP), but the full model's gradients stay on
    every rank between micro-batches. `defer=False`: every micro-batch reduce-scatters and its
    gradients are added into the sharded ones: gradients stay at 1/world of the model, for k times
    the gradient traffic with k micro-batches. Choose `defer=False` when memory, not the network, is
    what made you pick FSDP. Parameters are all-gathered every micro-batch either way."""
    skip = defer and not synced and is_sharded(model)
    if skip:
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        if skip:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to the global norm over every rank's gradient shards; returns that norm as a plain
    tensor (the same on every rank). On DTensor gradients torch's clip_grad_norm_ reduces the shard
    norms over the mesh (a collective: every rank calls it) and returns a DTensor."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if _is_dtensor(norm) else norm


def recover(model: nn.Module) -> None:
    """After an exception in forward or backward (out of memory): FSDP's per-iteration state
    (gathered parameters, pending reductions, the forward-root marker) is undefined until
    `reset_iter_state` on the root, which also drops the step's accumulated gradients: redo every
    micro-batch of the step. Gradient sync is switched back on in case the error struck inside a
    deferred micro-batch.

    Unlike DDP under `no_sync`, every FSDP forward and backward holds collectives (all-gathers): the
    other ranks must raise at the same point too, or they stay blocked in the next all-gather until
    the group times out. So an out-of-memory retry is only safe where all ranks fail together (an
    agreed probe), not for one rank's OOM."""
    if not is_sharded(model):
        return
    from torch.distributed.fsdp import FSDPModule

    model.reset_iter_state()  # type: ignore[operator]
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    # torch 2.13's reset keeps the gradients a deferred micro-batch accumulated on the unsharded
    # parameters (fp32: `.grad` of the unsharded tensor; low precision:
    # `unsharded_accumulated_grad`), and zero_grad reaches only the sharded ones: the redone step
    # would count those micro-batches twice. No public API clears them.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    unsharded = getattr(param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None


# ---- state ---------------------------------------------------------------------------------------


def state_dicts(model: nn.Module,
                optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts of this rank's shards (DTensor values, keyed by parameter
    name, so the same keys at every world size)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer)


def load_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer,
                     model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
    """Load what `state_dicts` gave (or DCP filled in) into the sharded model and its optimizer."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def _to_save(model: nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any] | None) -> dict[str, Any]:
    model_state, optim_state = state_dicts(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    if extra is not None:
        # One pickled blob: DCP keeps non-tensor leaves, but a loader would need their keys in
        # advance.
        buffer = io.BytesIO()
        torch.save(extra, buffer)
        buffer.seek(0)
        state[EXTRA_KEY] = buffer
    return state


def save_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 extra: dict[str, Any] | None = None, *,
                 storage: StorageWriter | None = None) -> None:
    """Write a sharded checkpoint into the directory `path`: every rank its own shards
    (`__<rank>_0.distcp`), the coordinator (rank 0) the `.metadata` file last. A collective: every
    rank calls it. `extra` (scheduler, progress, precision state...) must be the same on every rank:
    one rank's copy is kept. `storage`: the DCP writer for `path` in run storage, local or S3
    (checkpoint.storage_writer); by default a local one."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_to_save(model, optimizer, extra), checkpoint_id=None if storage else str(path),
             storage_writer=storage)


def checkpoint_group() -> dist.ProcessGroup:
    """A gloo group for `async_save_sharded`'s own collectives (a collective to create: every rank,
    once). Its background thread must not share the training group, whose collectives would
    interleave with its own."""
    return dist.new_group(backend="gloo")


def async_save_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                       extra: dict[str, Any] | None = None, *,
                       group: dist.ProcessGroup | None = None,
                       storage: StorageWriter | None = None) -> Future:
    """`save_sharded` in a background thread. The state is first copied to CPU memory (before this
    returns), so training may go on changing the parameters; `.result()` on the returned future
    waits for the files. Pass a `checkpoint_group()`; call `.result()` before the next save and
    before the process ends."""
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(_to_save(model, optimizer, extra),  # type: ignore[return-value]
                          checkpoint_id=None if storage else str(path), storage_writer=storage,
                          process_group=group)


def load_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 storage: StorageReader | None = None) -> dict[str, Any] | None:
    """Load a checkpoint written by `save_sharded` into an already sharded model and its fresh
    optimizer (no step needed first: `get_state_dict` creates the optimizer's slots to load into).
    The saved shards are cut again for this world size, so a checkpoint from 2 ranks loads into 1 or
    3. A collective. Returns the `extra` saved with it (None if none). `storage`: the DCP reader of
    `path` in run storage (checkpoint.storage_reader)."""
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = state_dicts(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    reader = storage or dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata()
    if EXTRA_KEY in metadata.state_dict_metadata:
        state[EXTRA_KEY] = io.BytesIO()
    dcp.load(state, storage_reader=reader)
    load_state_dicts(model, optimizer, state["model"], state["optimizer"])
    if EXTRA_KEY not in state:
        return None
    state[EXTRA_KEY].seek(0)
    return load_state_file(state[EXTRA_KEY],
                           f"{path}/{stored_in(metadata, EXTRA_KEY).relative_path}")


def stored_in(metadata: Any, key: str) -> Any:
    """Where DCP stored the item `key` of a checkpoint (its metadata's storage data: file, offset,
    length)."""
    found = next((info for index, info in metadata.storage_data.items() if index.fqn == key), None)
    if found is None:
        raise ValueError(f"the checkpoint has no {key!r} beside "
                         "its shards: not written by this product")
    return found


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's parameters and buffers on CPU, gathered on rank 0 (an empty dict on the
    others): the final model to log or save_pretrained. A collective: every rank calls it. Always a
    copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return _unaliased(get_model_state_dict(model, options=whole), _live(model))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state keyed by parameter name, on CPU on rank 0 (empty elsewhere). A
    collective. Always a copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return _unaliased(get_optimizer_state_dict(model, optimizer, options=whole),
                      _live(model, optimizer))


def _live(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> set[int]:
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
    return {local_tensor(t).data_ptr() for t in tensors if local_tensor(t).numel()}


def _unaliased(tree: Any, live: set[int]) -> Any:
    """`tree` with every tensor that shares memory with the training state copied. torch 2.13's full
    state dict hands back plain tensors as they are (the optimizer's step counters at any world
    size; every tensor on one CPU rank, where the gather and the CPU offload are no-ops): later
    steps would change the "copy"."""
    if isinstance(tree, torch.Tensor):
        return tree.clone() if tree.numel() and tree.data_ptr() in live else tree
    if isinstance(tree, dict):
        return {k: _unaliased(v, live) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_unaliased(v, live) for v in tree]
    return tree


# ---- memory --------------------------------------------------------------------------------------


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no collective); any other tensor as it is."""
    return t.to_local() if _is_dtensor(t) else t


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds now for parameters, gradients and optimizer state (its shards under
    FSDP, everything under DDP), each tensor counted once (tied weights too). Transient gathered
    parameters are not included."""
    seen: set[int] = set()

    def size(tensors: Any) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            local = local_tensor(t)
            # By address and size, not storage: FSDP's sharded gradients of one block are views of
            # one buffer.
            key = (local.data_ptr(), local.numel()) if local.numel() else (id(local), 0)
            if key in seen:
                continue
            seen.add(key)
            total += local.numel() * local.element_size()
        return total

    params = list(model.parameters())
    figures = {
        "params": size(params),
        "grads": size(p.grad for p in params if p.grad is not None),
        "optimizer": size(v for state in optimizer.state.values() for v in state.values()),
    }
    return figures | {"total": sum(figures.values())}
