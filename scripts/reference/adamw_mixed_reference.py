"""Reference values for the mixed-precision AdamW step, from PyTorch itself.

A BF16 parameter with an FP32 master, BF16 gradients: the master is stepped by
torch.optim.AdamW (both its single-tensor and its fused CPU implementation), and the model
parameter is the master rounded to BF16 after every step, as Megatron's
Float16OptimizerWithFloat16Params does. The C++ test (tests/optim/mixed_reference_test.cpp)
replays the same inputs through mixprec's Float16Optimizer and compares bit patterns.

Values are written as integer bit patterns, so nothing is lost in JSON. Run:
    .venv/bin/python scripts/reference/adamw_mixed_reference.py > tests/optim/data/adamw_mixed_reference.json
"""
import json
import sys

import torch

STEPS = 5
# A multiple of 8: LibTorch's fused kernel runs the last numel % 8 elements through a scalar
# loop whose FMA contraction depends on how LibTorch was compiled (1 ulp apart in exp_avg_sq);
# mixprec's own kernel tests cover odd sizes against that kernel with a stated tolerance.
N = 1032


def bits(t):
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32).tolist()
    if t.dtype == torch.bfloat16:
        return (t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    raise TypeError(t.dtype)


def run(config, implementation, param, grads):
    master = param.float().clone().requires_grad_(True)
    kwargs = dict(lr=config["lr"], betas=tuple(config["betas"]), eps=config["eps"],
                  weight_decay=config["weight_decay"], amsgrad=config["amsgrad"])
    if implementation == "fused":
        opt = torch.optim.AdamW([master], fused=True, **kwargs)
    else:
        opt = torch.optim.AdamW([master], foreach=False, **kwargs)
    for g in grads:
        master.grad = g.float()
        opt.step()
    state = opt.state[master]
    out = {
        "master": bits(master.detach()),
        "model_param": bits(master.detach().to(torch.bfloat16)),
        "exp_avg": bits(state["exp_avg"]),
        "exp_avg_sq": bits(state["exp_avg_sq"]),
    }
    if config["amsgrad"]:
        out["max_exp_avg_sq"] = bits(state["max_exp_avg_sq"])
    return out


def main():
    torch.manual_seed(20261202)
    param = (torch.randn(N) * 0.5).to(torch.bfloat16)
    grads = [(torch.randn(N) * 0.05).to(torch.bfloat16) for _ in range(STEPS)]
    configs = [
        {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
         "amsgrad": False},
        {"name": "adamw_amsgrad", "lr": 3e-3, "betas": [0.8, 0.99], "eps": 1e-6,
         "weight_decay": 0.0, "amsgrad": True},
    ]
    doc = {
        "torch_version": torch.__version__,
        "steps": STEPS,
        "param_bf16": bits(param),
        "grads_bf16": [bits(g) for g in grads],
        "cases": [],
    }
    for config in configs:
        for implementation in ("fused", "single_tensor"):
            case = dict(config)
            case["implementation"] = implementation
            case["expected"] = run(config, implementation, param, grads)
            doc["cases"].append(case)
    json.dump(doc, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
