"""One-GPU table: strict fp32 vs TF32 vs bf16 throughput of the GPT, MFU in bf16, the auto micro-batch, the
compile gain and peak memory. Needs only torch (no network, no Ray); finishes in a few minutes on one GPU.
Without CUDA it runs the same code at a tiny size on the CPU (a smoke test, not a measurement).

    python bench/gpu.py [--seq 1024 --d-model 1024 --layers 24 --heads 16 --max-batch 64 --steps 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, nothing installed

from orchestrator.models.zoo import GPT  # noqa: E402  (no Ray, MLflow or Arrow needed: the GPU check's torch tier)
from orchestrator.training.memory import GIB, fit_micro_batch_cuda, release_cached_memory  # noqa: E402
from orchestrator.training.timing import count_flops, peak_flops  # noqa: E402


def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int, seq: int, vocab: int,
              device: torch.device, bf16: bool) -> Callable[[], None]:
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()

    def step() -> None:
        with autocast:
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds per step after two warm-up steps (the first of a compiled model compiles it)."""
    for _ in range(2):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def set_fp32_mode(tf32: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--seq", type=int, default=1024 if cuda else 32)
    parser.add_argument("--d-model", type=int, default=1024 if cuda else 32)
    parser.add_argument("--layers", type=int, default=24 if cuda else 1)
    parser.add_argument("--heads", type=int, default=16 if cuda else 2)
    parser.add_argument("--vocab", type=int, default=50304 if cuda else 256)
    parser.add_argument("--max-batch", type=int, default=64 if cuda else 4, help="largest micro-batch probed")
    parser.add_argument("--steps", type=int, default=10 if cuda else 2)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = GPT(args.seq, args.vocab, d_model=args.d_model, n_layer=args.layers, n_head=args.heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"device: {name}; GPT {params / 1e6:.1f}M params, seq {args.seq}, vocab {args.vocab}")

    # Auto micro-batch: the largest that fits a full step in the most memory-hungry mode (strict fp32).
    set_fp32_mode(False)
    if cuda:
        micro = fit_micro_batch_cuda(
            args.max_batch, lambda b: make_step(model, optimizer, b, args.seq, args.vocab, device, False)(), device)
    else:
        micro = args.max_batch
    release_cached_memory(device)
    tokens_per_step = micro * args.seq
    flops = count_flops(make_step(model, optimizer, micro, args.seq, args.vocab, device, True))
    peak = peak_flops(device, None)
    print(f"auto micro-batch: {micro} sequences ({tokens_per_step:,} tokens) per step")

    rows = []
    for label, tf32, bf16, compiled in [("fp32 strict", False, False, False), ("tf32", True, False, False),
                                        ("bf16", False, True, False), ("bf16 + compile", False, True, True)]:
        if compiled and args.no_compile:
            continue
        set_fp32_mode(tf32)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        net = torch.compile(model) if compiled else model
        started = time.perf_counter()
        seconds = timed(make_step(net, optimizer, micro, args.seq, args.vocab, device, bf16), args.steps, device)
        wall = time.perf_counter() - started
        memory = torch.cuda.max_memory_allocated() / GIB if cuda else float("nan")
        # Against the peak of the mode measured: strict fp32 has no tensor cores, TF32 half of bf16's.
        peak = peak_flops(device, None, "bf16" if bf16 else "fp32")
        mfu = flops / seconds / peak if peak else float("nan")
        rows.append((label, tokens_per_step / seconds, mfu, memory, wall))
        release_cached_memory(device)

    base = rows[0][1]
    print(f"{'mode':<16}{'tokens/s':>14}{'vs fp32':>9}{'MFU':>8}{'peak GiB':>10}{'wall s':>8}")
    for label, rate, mfu, memory, wall in rows:
        print(f"{label:<16}{rate:>14,.0f}{rate / base:>8.2f}x{mfu:>8.1%}{memory:>10.1f}{wall:>8.1f}")
    if len(rows) == 4:
        print(f"compile gain (bf16): {rows[3][1] / rows[2][1]:.2f}x")
    if peak is None:
        print("MFU: peak FLOP/s unknown for this device (see orchestrator/training/timing.py PEAK_FLOPS)")


if __name__ == "__main__":
    main()
