"""§5 Tensor parallelism: Megatron's splits, f and g on real processes, the output layer, SP.

Part 1 (§5.1): both splits of Y = X·A are exact, but GeLU does not distribute over partial sums.
Part 2 (§5.2): the column-then-row MLP on t = 2, 4, 8 simulated ranks, and rank 0 without g.
Part 3 (§5.4): one transformer layer on 2 and 4 real gloo processes vs one process, float64,
with and without sequence parallelism, and the collectives it issued.
Part 4 (§5.5): vocabulary-parallel cross entropy vs F.cross_entropy, and all-gathered logits vs
the fused loss for GPT-2 and LLaMA-3 vocabularies.
Part 5 (§5.6): the communication/computation ratio of GPT-3 on A100s, and Korthikanti's
activation memory per layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import modelpar.tensor_parallel as tp
from modelpar.costmodel import (
    activation_bytes_per_layer,
    fused_cross_entropy_bytes,
    gpu_preset,
    logits_allgather_bytes,
    model_preset,
    tp_comm_compute_ratio,
    tp_layer_comm_bytes,
    tp_layer_flops,
)
from modelpar.distributed import LocalCluster

B, S, H, HEADS, VOCAB = 2, 16, 32, 8, 64


def part1() -> None:
    print("== Part 1: two ways to split Y = X·A (X 2x8, A 8x64, float64, 2 ranks) ==")
    f = tp.matmul_splits()
    print(f"column split [X·A1, X·A2] vs X·A: max error {f['column_error']:.1e}")
    print(f"row split X1·A1 + X2·A2 vs X·A:  max error {f['row_error']:.1e}")
    print(f"GeLU(X1A1 + X2A2) - (GeLU(X1A1) + GeLU(X2A2)): max {f['gelu_gap']:.1f}  -> a row split must "
          "all-reduce before GeLU\n")


def part2() -> None:
    print("== Part 2: MLP Z = GeLU(X·A)·B, A by columns, B by rows (X 2x64, h = 64) ==")
    print(f"{'t':>2} {'max |sum - Z|':>14} {'rank 0 alone':>13} {'weights/rank':>13}")
    for t in (2, 4, 8):
        f = tp.mlp_splits(t)
        print(f"{t:>2} {f['error']:>14.1e} {f['partial_gap']:>13.2f} {f['weight_fraction']:>13.3f}")
    print("one all-reduce (g) per MLP forward; without it rank 0 holds only a partial sum\n")


def _groups() -> dict[int, dist.ProcessGroup | None]:
    me, world = dist.get_rank(), dist.get_world_size()
    out: dict[int, dist.ProcessGroup | None] = {1: None, world: dist.group.WORLD}
    for start in range(0, world, 2):  # t = 2: ranks {0, 1} and {2, 3}
        g = dist.new_group([start, start + 1])
        if start <= me < start + 2:
            out[2] = g
    return out


def _layer_vs_one_process(group, sp: bool) -> tuple[float, float, dict]:
    """Max |difference| of the output and of every gradient (input, weights, LayerNorm), and the comm log."""
    torch.manual_seed(0)
    ref = tp.ParallelTransformerLayer(H, HEADS, dtype=torch.float64)
    par = tp.ParallelTransformerLayer(H, HEADS, group=group, sequence_parallel=sp, dtype=torch.float64)
    tp.set_shape_checks(par, False)  # the inputs are known to agree; tests cover the checks
    tp.load_full_state_dict(par, ref.state_dict())
    x = torch.randn(B, S, H, dtype=torch.float64, requires_grad=True)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cut = (lambda u: tp.shard_tensor(u, 1, rank, world)) if sp else (lambda u: u)
    xp = cut(x.detach()).requires_grad_(True)
    y = ref(x)
    w = torch.randn_like(y)
    (y * w).sum().backward()
    with tp.comm_log() as log:
        yp = par(xp)
        (yp * cut(w)).sum().backward()
    tp.sync_tensor_parallel_grads(par)
    grads = tp.shard_state_dict(par, {n: p.grad for n, p in ref.named_parameters()})
    gdiff = max([(p.grad - grads[n]).abs().max().item() for n, p in par.named_parameters()]
                + [(xp.grad - cut(x.grad)).abs().max().item()])
    return (yp - cut(y)).abs().max().item(), gdiff, log.summary()


def _cross_entropy(group) -> float:
    torch.manual_seed(1)
    logits = torch.randn(B * S, VOCAB, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, VOCAB, (B * S,))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shard = tp.shard_tensor(logits.detach(), 1, rank, world).requires_grad_(True)
    loss = tp.vocab_parallel_cross_entropy(shard, target, group)
    ref = F.cross_entropy(logits, target)
    loss.backward()
    ref.backward()
    return max((loss - ref).abs().item(), (shard.grad - tp.shard_tensor(logits.grad, 1, rank, world)).abs().max().item())


def _on_every_rank() -> dict:
    groups = _groups()
    layers = {(t, sp): _layer_vs_one_process(groups[t], sp) for t, sp in ((2, False), (4, False), (4, True))}
    return {"layers": layers, "ce": _cross_entropy(groups[4])}


def part3_and_4(res: dict) -> None:
    print(f"== Part 3: one pre-LN layer (b={B}, s={S}, h={H}, {HEADS} heads) on real gloo processes vs one process ==")
    print(f"{'t':>2} {'SP':>3} {'output diff':>12} {'grad diff':>10}  {'forward':<32} backward")
    for (t, sp), (out, grad, log) in res["layers"].items():
        comms = [" + ".join(f"{n} {kind.replace('_', '-')}" for (kind, ph), (n, _) in sorted(log.items())
                            if ph == phase and kind != "shape_check") for phase in ("forward", "backward")]
        print(f"{t:>2} {'yes' if sp else 'no':>3} {out:>12.1e} {grad:>10.1e}  {comms[0]:<32} {comms[1]}")
    print(f"each collective moves b·s·h = {B * S * H} elements, independent of t; SP replaces each all-reduce "
          "by reduce-scatter + all-gather of the same volume\n")
    print("== Part 4: the output layer: vocabulary-parallel cross entropy ==")
    print(f"t = 4, {B * S} tokens, V = {VOCAB}: max |ours - F.cross_entropy| over loss and gradient {res['ce']:.1e}")
    tokens, t = 8 * 2048, 8
    fused = fused_cross_entropy_bytes(tokens, t)
    print(f"per-GPU traffic, t = {t}, one micro-batch of 8 x 2048 tokens:")
    print(f"{'vocabulary':<18} {'all-gather logits (BF16)':>25} {'fused CE (3 fp32/token)':>24} {'ratio':>7}")
    for name, vocab in (("GPT-2 (50257)", 50257), ("LLaMA-3 (128256)", 128256)):
        gathered = logits_allgather_bytes(tokens, vocab, t)
        print(f"{name:<18} {gathered / 1e9:>22.2f} GB {fused / 1e6:>21.2f} MB {gathered / fused:>7.0f}x")
    print()


def part5() -> None:
    gpt3, a100 = model_preset("gpt3-175b"), gpu_preset("a100-80gb")
    h, peak = gpt3.hidden, a100.gpu.peak_tflops * 1e12
    print(f"== Part 5: communication / computation per layer, GPT-3 (h = {h}) on A100 ({a100.gpu.peak_tflops:.0f} TFLOP/s) ==")
    print(f"{'t':>2} {'FLOPs/token':>12} {'bytes/token':>12} {'NVLink 300 GB/s':>16} {'IB 25 GB/s':>11}")
    for t in (2, 4, 8, 16):
        ratios = [tp_comm_compute_ratio(h, t, peak, bw * 1e9) for bw in (a100.intra_node_gbps, a100.inter_node_gbps)]
        print(f"{t:>2} {tp_layer_flops(1, 1, h, t):>12.3g} {tp_layer_comm_bytes(1, 1, h, t):>12.0f} "
              f"{ratios[0]:>16.2f} {ratios[1]:>11.2f}")
    print("b and s cancel: a bigger batch does not help; comm > compute (ratio > 1) across machines\n")
    s, b, a = gpt3.seq, 1, gpt3.heads
    print(f"Activation memory per layer (Korthikanti et al. 2022), GPT-3, s = {s}, b = {b}, 16-bit, t = 8:")
    rows = [("no parallelism", dict(t=1)), ("tensor parallel", dict(t=8)),
            ("tensor + sequence parallel", dict(t=8, sequence_parallel=True)),
            ("TP + SP + selective recompute", dict(t=8, sequence_parallel=True, recompute="selective"))]
    formulas = ["sbh(34 + 5as/h)", "sbh(10 + 24/t + 5as/(ht))", "sbh/t (34 + 5as/h)", "sbh/t * 34"]
    for (name, kw), formula in zip(rows, formulas):
        mb = activation_bytes_per_layer(s, b, h, a, **kw) / 2**20
        print(f"  {name:<30} {formula:<26} {mb:>8.0f} MiB")


def main() -> None:
    with LocalCluster(4).start() as cluster:  # the 4 processes start while parts 1-2 run
        part1()
        part2()
        results = cluster.run(_on_every_rank)
    part3_and_4(results[0])
    part5()


if __name__ == "__main__":
    main()
