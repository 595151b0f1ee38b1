"""One GPU, bf16: a plain PyTorch training loop and `modelpar train` at t = p = d = 1, side by side.

Both train the same Llama-style model (about 355 M parameters: h = 1024, 32 layers, 16 query and 4
key/value heads, SwiGLU, sequence 1024, byte tokens of the shipped corpus) for the same steps on the
same batches: bf16 autocast compute, fp32 master weights and AdamW (fused), fp32 cross entropy,
4 micro-batches of 8 sequences accumulated per step, clipping at 1.0. The plain loop is what one
writes by hand; modelpar runs its whole trainer (pipeline runner with one stage, flat gradient
buckets, the step's loss and norm agreed like on many ranks) in this process, a world of one.
Printed: tokens/s of each (the median step after the first ones), the ratio (aim: modelpar ≥ 0.95
of the plain loop) and the MFU of each against the GPU's dense bf16 peak (aim ≥ 40% on an H200,
989 TFLOP/s).

    python benchmarks/gpu_single.py                  # a GPU: the 355 M model
    python benchmarks/gpu_single.py --smoke          # any machine: a tiny model, a few steps (checks the script)
    python benchmarks/gpu_single.py --layers 24 --steps 40 --peak-tflops 989
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from modelpar.corpus import load_corpus
from modelpar.distributed import free_port
from modelpar.distributed.devices import require_gpus
from modelpar.model import LMLoss, ModelConfig, build_stage
from modelpar.training import TrainConfig, lr_at, param_groups, train

H200_BF16_TFLOPS = 989.0  # dense, no sparsity


def plain_loop(cfg: TrainConfig, device: torch.device, warmup: int) -> float:
    """tokens/s of a hand-written loop: autocast bf16, fp32 AdamW and loss, micro-batches accumulated."""
    torch.manual_seed(cfg.seed)
    model = build_stage(cfg.model, seed=cfg.seed, dtype=torch.float32, device=device)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(param_groups(list(model.parameters()), cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95),
                            eps=1e-8, **fused)
    loss_fn, corpus, m = LMLoss(cfg.model.vocab_size), load_corpus(), cfg.microbatches
    times = []
    for step in range(cfg.steps):
        _sync(device)
        t0 = time.perf_counter()
        x, y = corpus.batch("train", step, cfg.batch_size, cfg.model.seq_len, cfg.seed)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(xm)
            loss = loss_fn(logits, ym) / m  # fp32: the loss upcasts bf16 logits
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        total.item()  # the loss of every step, as a training loop logs it
        _sync(device)
        times.append(time.perf_counter() - t0)
    return cfg.tokens_per_step / statistics.median(times[warmup:])


def modelpar_train(cfg: TrainConfig, device: torch.device, warmup: int) -> float:
    """tokens/s of `modelpar train`'s loop at t = p = d = 1, in this process (a world of one)."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                device_id=device if device.type == "cuda" else None)
    return cfg.tokens_per_step / statistics.median(train(cfg).step_times[warmup:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny model on this machine's CPU (or GPU), 6 steps")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    ap.add_argument("--peak-tflops", type=float, default=None, help=f"default: {H200_BF16_TFLOPS:g} (H200 dense bf16)")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = ModelConfig(arch="llama", hidden=args.hidden, heads=16, kv_heads=4, layers=args.layers, seq_len=1024)
    cfg = TrainConfig(model=model, tp=1, pp=1, dp=1, microbatches=args.microbatches, batch_size=args.batch_size,
                      steps=args.steps, warmup=5, precision="bf16", eval_every=0, eval_batches=1)
    if args.smoke:
        cfg = replace(cfg, model=replace(model, hidden=64, heads=4, kv_heads=2, layers=2, seq_len=64), steps=6,
                      batch_size=8, microbatches=2)
    else:
        try:
            require_gpus(1, "gpu_single.py")
        except ValueError as err:
            raise SystemExit(f"{err}; run with --smoke to check the script on this machine") from None
    warmup = 2 if args.smoke else 5
    plain = plain_loop(cfg, device, warmup)
    ours = modelpar_train(cfg, device, warmup)
    peak = args.peak_tflops or H200_BF16_TFLOPS
    flops = cfg.model.flops_per_token()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{name}: Llama {cfg.model.num_parameters():,} parameters (h={cfg.model.hidden}, "
          f"L={cfg.model.layers}, s={cfg.model.seq_len}), bf16, batch {cfg.batch_size} x {cfg.microbatches} "
          f"micro-batches, {cfg.steps} steps (median after {warmup}), peak {peak:g} TFLOP/s\n")
    print(f"{'':>16} {'tokens/s':>12} {'MFU':>7}")
    for label, rate in (("plain PyTorch", plain), ("modelpar train", ours)):
        print(f"{label:>16} {rate:>12,.0f} {100 * flops * rate / (peak * 1e12):>6.1f}%")
    print(f"\nmodelpar / plain = {ours / plain:.3f}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
