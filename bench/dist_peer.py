"""bench_dist's peer: PyTorch DDP (gloo) + ZeroRedundancyOptimizer, as a PyTorch user runs them.

Run by bench_dist under torchrun, one process per rank:

    torchrun --standalone --nproc-per-node N bench/dist_peer.py --model mlp|gpt [--steps N]

The same models as bench_dist (bench/peer_models.py), FP32 parameters trained under
torch.autocast("cpu", dtype=torch.bfloat16) (what BF16 training is in PyTorch), wrapped in
DistributedDataParallel on Gloo (gradients all-reduced in FP32 buckets during backward), and
ZeroRedundancyOptimizer over AdamW(fused=True), as bench_train's peer: ZeRO-1, each rank steps
its share of the parameters and broadcasts them. One thread per rank, as bench_dist's workers.
A step's data is made before its clock starts, as bench_dist makes its own. Rank 0 prints one
JSON line: the median over steps of the slowest rank's step time (zero_grad, forward, backward,
optimizer step), and the largest per-rank growth of resident memory from just before the model
is built to the end (VmHWM - VmRSS then).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_models  # noqa: E402


def status_mib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("mlp", "gpt"), required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=0, help="global batch (default: the model's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline_mib = status_mib("VmRSS")

    torch.manual_seed(3)
    if args.model == "mlp":
        model = peer_models.Mlp()
        batch = args.batch or 64 * world  # bench_dist's MLP: 64 rows per rank
    else:
        config = peer_models.GptConfig()
        model = peer_models.Gpt(config)
        batch = args.batch or 16
    ddp = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                        lr=1e-3, weight_decay=0.01, fused=True)
    rows = batch // world
    times = []
    for step in range(args.warmup + args.steps):
        torch.manual_seed(100 + step + 1000 * rank)
        if args.model == "mlp":
            x = torch.randn(rows, peer_models.Mlp.WIDTH)
        else:
            tokens = torch.randint(0, config.vocab, (rows, config.seq_len + 1))
        dist.barrier()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if args.model == "mlp":
                loss = ddp(x)
            else:
                logits, aux = ddp(tokens[:, :-1])
        if args.model == "gpt":
            loss = F.cross_entropy(logits.float().reshape(-1, config.vocab),
                                   tokens[:, 1:].reshape(-1)) + 0.01 * aux
        loss.backward()
        optimizer.step()
        seconds = time.perf_counter() - t0
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            times.append(slowest.item())
    growth = torch.tensor([status_mib("VmHWM") - baseline_mib], dtype=torch.float64)
    dist.all_reduce(growth, op=dist.ReduceOp.MAX)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({
            "impl": "pytorch DDP(gloo) + ZeroRedundancyOptimizer(AdamW(fused=True)), autocast bf16",
            "model": args.model, "n": world, "params": params,
            "step_ms": statistics.median(times) * 1e3,
            "peak_growth_mib": growth.item(),
            # DDP all-reduces FP32 gradients (ring: 2(N-1)/N), ZeroRedundancyOptimizer
            # broadcasts each rank's FP32 parameters (binomial trees: (N-1)/N in all).
            "modeled_sent_bytes": 3.0 * (world - 1) / world * 4 * params,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
