"""The benchmarks' models in PyTorch, written as a PyTorch user would: the peers' side.

gpt(config): mixprec-train's GPT with MoE blocks (examples/train gpt.h, moe.h) — token and
position embeddings, tied head, pre-norm causal attention, a top-k router in FP32 with an FP32
expert-bias buffer, experts run on their tokens padded to bucketed row counts exactly as
mixprec-train pads them (64 rows, or an eighth of the next lower power of two), gathered into
one buffer and back as mixprec-train dispatches them — tricks a PyTorch user can copy. Meant to run under torch.autocast("cpu", dtype=torch.bfloat16)
over FP32 parameters; norms, router and attention compute in FP32 as mixprec-train's do.

mlp(): bench_dist's synthetic model: 4 x (Linear 384 -> 384, tanh, times an FP32 gate).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GptConfig:
    vocab: int = 256
    seq_len: int = 128
    layers: int = 2
    d_model: int = 128
    heads: int = 4
    experts: int = 4
    top_k: int = 2


def bucketed_rows(rows):
    bucket = max(64, (1 << (rows.bit_length() - 1)) // 8)
    return -(-rows // bucket) * bucket


class Expert(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc = nn.Linear(c.d_model, 4 * c.d_model, bias=False)
        self.proj = nn.Linear(4 * c.d_model, c.d_model, bias=False)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.router = nn.Linear(c.d_model, c.experts, bias=False)
        self.experts = nn.ModuleList(Expert(c) for _ in range(c.experts))
        self.register_buffer("expert_bias", torch.zeros(c.experts))
        self.load = torch.zeros(c.experts, dtype=torch.long)

    def forward(self, x):
        c = self.c
        with torch.autocast("cpu", enabled=False):  # the router stays FP32
            probs = F.softmax(self.router(x.float()), dim=-1)
        with torch.no_grad():
            chosen = torch.topk(probs + self.expert_bias, c.top_k, dim=-1).indices
        gates = probs.gather(-1, chosen)
        gates = gates / gates.sum(-1, keepdim=True)
        # Dispatch as mixprec-train does (moe.cpp): the routing slots sorted by expert (stable),
        # each expert's run of rows padded to its bucket in one buffer, one gather in and one out;
        # an expert without tokens is not run (no gradient).
        flat = chosen.reshape(-1)
        counts = torch.bincount(flat, minlength=c.experts)
        with torch.no_grad():
            order = torch.sort(flat, stable=True).indices
            padded = [bucketed_rows(n) if n else 0 for n in counts.tolist()]
            starts = torch.tensor([sum(padded[:e]) for e in range(c.experts)])
            expert_of_sorted = flat[order]
            rank = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[expert_of_sorted]
            row = starts[expert_of_sorted] + rank
            of_slot = torch.empty_like(flat)
            of_slot[order] = row
            source = torch.full((sum(padded),), x.shape[0], dtype=torch.long)
            source[row] = order // c.top_k
        inputs = F.pad(x, (0, 0, 0, 1)).index_select(0, source).split(padded)
        outs = [expert(i) for expert, i, n in zip(self.experts, inputs, padded) if n]
        picked = torch.cat(outs).index_select(0, of_slot).view(x.shape[0], c.top_k, -1)
        y = (picked * gates.unsqueeze(-1).to(picked.dtype)).sum(1)
        aux = c.experts * ((counts.float() / flat.numel()) * probs.mean(0)).sum()
        if self.training:
            self.load += counts
        return y, aux

    @torch.no_grad()
    def update_expert_bias(self, rate):
        load = self.load.float()
        self.expert_bias.add_(torch.sign(load.mean() - load) * rate)
        self.load.zero_()


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.attn_norm = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.mlp_norm = nn.LayerNorm(c.d_model)
        self.moe = MoE(c)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.c.heads, C // self.c.heads).permute(2, 0, 3, 1, 4)
        with torch.autocast("cpu", enabled=False):  # FP32 attention, as mixprec-train computes it
            a = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(q.dtype)
        h = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        y, aux = self.moe(self.mlp_norm(h).flatten(0, 1))
        return h + y.view_as(h), aux


class Gpt(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.tok_emb = nn.Embedding(c.vocab, c.d_model)
        self.pos_emb = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.final_norm = nn.LayerNorm(c.d_model)
        for name, p in self.named_parameters():
            if "norm" not in name:
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * c.layers) if name.endswith("proj.weight") else 0.02)

    def forward(self, tokens):
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1]))
        aux = 0.0
        for block in self.blocks:
            x, block_aux = block(x)
            aux = aux + block_aux
        logits = F.linear(self.final_norm(x), self.tok_emb.weight)  # tied head
        return logits, aux / self.c.layers

    def update_expert_biases(self, rate):
        for block in self.blocks:
            block.moe.update_expert_bias(rate)


class Mlp(nn.Module):
    WIDTH, LAYERS = 384, 4

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(self.WIDTH, self.WIDTH) for _ in range(self.LAYERS))
        self.gates = nn.ParameterList(nn.Parameter(torch.ones(self.WIDTH)) for _ in range(self.LAYERS))

    def forward(self, x):
        h = x
        for layer, gate in zip(self.layers, self.gates):
            h = torch.tanh(layer(h)).float() * gate
        return h.float().pow(2).mean()
