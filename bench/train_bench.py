"""mixprec-train's model and step in PyTorch: the peer a Python user would pick.

The same GPT with MoE blocks as examples/train (gpt.h, moe.h) — token and position embeddings,
tied head, pre-norm causal attention, top-k router in FP32 with an FP32 expert-bias buffer,
experts padded to bucketed row counts as mixprec-train does — trained with
torch.autocast("cpu", dtype=torch.bfloat16) over FP32 parameters (with exact GELU and the
attention kernel in FP32, as mixprec-train computes them: the fastest choices on CPU) and AdamW(fused=True), with
global-norm clipping. A step's time is the region bench_train times for mixprec-train's
train_step: the batch, zero_grad, forward, backward, clipping, the optimizer step and the
expert-bias update; "optimizer_ms" is all of it but forward and backward. Prints one JSON line
like bench_train's children:

    python bench/train_bench.py [--steps N] [--warmup N] [--threads N] [--layers N --d-model N
        --heads N --experts N --top-k N --seq-len N --batch N]

With --ddp, under torchrun (bench_train --ranks N): data parallel as a PyTorch user writes it —
DistributedDataParallel over gloo (find_unused_parameters: an expert may get no tokens on a
rank) and ZeroRedundancyOptimizer sharding AdamW(fused=True); each rank its share of the global
batch, the experts' token counts summed over ranks before the bias update (as mixprec-train
does); rank 0 prints.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import pydoc_data.topics
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_models  # noqa: E402  (the model, as bench_dist's peer runs it too)

LR, WD, CLIP, AUX_COEF, BIAS_RATE = 3e-3, 0.1, 1.0, 0.01, 1e-3


def main():
    defaults = peer_models.GptConfig()  # mixprec-train's default model; the flags change it
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--ddp", action="store_true")
    # The model flags bench_train passes on (mixprec-train's names).
    for flag, default in (("layers", defaults.layers), ("d-model", defaults.d_model),
                          ("heads", defaults.heads), ("experts", defaults.experts),
                          ("top-k", defaults.top_k), ("seq-len", defaults.seq_len), ("batch", 16)):
        parser.add_argument("--" + flag, type=int, default=default)
    args = parser.parse_args()
    config = peer_models.GptConfig(seq_len=args.seq_len, layers=args.layers, d_model=args.d_model,
                                   heads=args.heads, experts=args.experts, top_k=args.top_k)
    seq, vocab, batch = config.seq_len, config.vocab, args.batch
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(1337)

    text = "\n\n".join(pydoc_data.topics.topics.values()).encode()
    data = torch.frombuffer(bytearray(text[: int(len(text) * 0.9)]), dtype=torch.uint8)

    model = peer_models.Gpt(config)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "router" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "router" not in n)]
    groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
    rank, world = 0, 1
    net = model
    if args.ddp:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        # The expert biases move identically on every rank (loads summed below): no broadcast.
        net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True,
                                                        broadcast_buffers=False)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                            lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=True,
                                            weight_decay=WD)
        optimizer.add_param_group(groups[1])
    else:
        optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=True)
    rows = batch // world

    def status_mib(field):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        return 0.0

    setup_mib = status_mib("VmRSS")
    forward, backward, optim, total = [], [], [], []
    faults_before = 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:  # page faults of the timed steps: pages malloc got from the system
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()  # the batch and zero_grad count, as in mixprec-train's step
        starts = torch.randint(0, data.numel() - seq - 1, (batch,))[rank * rows:(rank + 1) * rows]
        window = data[starts.unsqueeze(1) + torch.arange(seq + 1)].long()
        x, y = window[:, :-1], window[:, 1:]
        optimizer.zero_grad(set_to_none=True)
        tf = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, aux = net(x)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1)) + AUX_COEF * aux
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        if args.ddp:  # every rank's tokens, so the biases stay equal
            loads = torch.stack([block.moe.load for block in model.blocks])
            dist.all_reduce(loads)
            for block, load in zip(model.blocks, loads):
                block.moe.load.copy_(load)
        model.update_expert_biases(BIAS_RATE)
        t3 = time.perf_counter()
        if step >= args.warmup:
            forward.append(t1 - tf), backward.append(t2 - t1), optim.append(t3 - t2 + tf - t0)
            total.append(t3 - t0)

    step_s = statistics.median(total)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    if args.ddp:
        dist.destroy_process_group()
    if rank != 0:
        return
    print(json.dumps({
        "config": (f"pytorch DDP + ZeroRedundancyOptimizer, {world} ranks" if args.ddp
                   else "pytorch autocast bf16 + AdamW(fused)"),
        "tokens_per_s": batch * seq / step_s,
        "step_ms": step_s * 1e3,
        "forward_ms": statistics.median(forward) * 1e3,
        "backward_ms": statistics.median(backward) * 1e3,
        "optimizer_ms": statistics.median(optim) * 1e3,
        "peak_rss_mib": status_mib("VmHWM"),
        "setup_rss_mib": setup_mib,
        "faults_per_step": faults / args.steps,
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
