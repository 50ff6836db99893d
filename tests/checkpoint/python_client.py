"""Test driver: PyTorch continues training from a mixprec checkpoint.

Run by tests/checkpoint/python_client_test.cpp. It reads the checkpoint with the reusable
reader python/mixprec_reader.py (the `safetensors` package and torch only) and takes one step
with torch.optim.AdamW, so the C++ test can compare PyTorch's step with Float16Optimizer's:

  python_client.py adamw-step CKPT --grads GRADS --out OUT [--model interleaved]
                   [--impl fused|single_tensor]

The model is the C++ one with every parameter in FP32: a parameter with a master takes the
master's value (what the optimizer steps; the BF16 model value is its rounding), a native FP32
or frozen one its model value; frozen ones stay out of the optimizer. The optimizer state is
loaded with AdamW.load_state_dict, so PyTorch checks it.

GRADS is a safetensors file, FQN -> gradient (any float dtype). OUT (safetensors) receives
"<fqn>" -> the FP32 parameter after the step for every trainable parameter, and
"optimizer.state.<name>.<fqn>" for its new state (step as a 0-dim float tensor). Prints one
JSON line summarising what it did. Errors: one line on stderr naming the file and key, exit
status 1.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import mixprec_reader as mr  # noqa: E402


class Interleaved(torch.nn.Module):
    """Same FQNs and shapes as InterleavedImpl in tests/optim/support_optim.h."""

    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Linear(8, 8, bias=False)
        self.frozen = torch.nn.Linear(8, 8, bias=False)
        self.gate = torch.nn.Parameter(torch.zeros(24))
        self.post = torch.nn.Linear(8, 8, bias=False)


MODELS = {"interleaved": Interleaved}


def build_model(name, ckpt):
    """The PyTorch model, FP32 throughout, with masters where the checkpoint has them."""
    model = MODELS[name]()
    names = dict(model.named_parameters())
    model_keys = set(ckpt.model_keys())
    if model_keys != set(names):
        raise mr.CheckpointError(f"{ckpt.dir}: model keys differ from {name}: only in checkpoint "
                                 f"{sorted(model_keys - set(names))}, "
                                 f"only in model {sorted(set(names) - model_keys)}")
    values = ckpt.fp32_params(names)
    with torch.no_grad():
        for fqn, param in names.items():
            if values[fqn].shape != param.shape:
                raise mr.CheckpointError(f"{ckpt.dir}: key '{fqn}': shape "
                                         f"{list(values[fqn].shape)}, model has {list(param.shape)}")
            param.copy_(values[fqn])
    return model


def build_adamw(model, ckpt, impl):
    """torch.optim.AdamW over the trainable parameters, loaded from the checkpoint."""
    opt_common = ckpt.optimizer()
    if opt_common is None or opt_common[mr.ALGORITHM] != "adamw":
        raise mr.CheckpointError(f"{ckpt.dir}: the saved optimizer is not AdamW")
    frozen = set(opt_common.get(mr.FROZEN, []))
    named = dict(model.named_parameters())
    fqn_groups = []
    for saved in opt_common[mr.PARAM_GROUPS]:
        for fqn in saved[mr.PARAMS]:
            named[fqn].requires_grad_(fqn not in frozen)
        fqn_groups.append([fqn for fqn in saved[mr.PARAMS] if fqn not in frozen])
    extra = {"fused": True} if impl == "fused" else {"foreach": False}
    opt = torch.optim.AdamW([{"params": [named[f] for f in fqns]} for fqns in fqn_groups],
                            **extra)
    # Hyper-parameters come from the checkpoint; the implementation flags from this run.
    opt.load_state_dict(ckpt.torch_optimizer_state_dict(fqn_groups, like=opt))
    return opt, [fqn for fqns in fqn_groups for fqn in fqns]


def adamw_step(args):
    ckpt = mr.Checkpoint(args.checkpoint)
    model = build_model(args.model, ckpt)
    opt, fqns = build_adamw(model, ckpt, args.impl)

    grads = load_file(args.grads)
    named = dict(model.named_parameters())
    for fqn in fqns:
        if fqn not in grads:
            raise mr.CheckpointError(f"{args.grads}: no gradient for '{fqn}'")
        named[fqn].grad = grads[fqn].to(torch.float32).reshape(named[fqn].shape)
    opt.step()

    out = {}
    for fqn in fqns:
        param = named[fqn]
        out[fqn] = param.detach().clone()
        for name, value in opt.state[param].items():
            out[mr.optimizer_state_key(name, fqn)] = value.detach().to(torch.float32).clone()
    save_file(out, args.out, metadata={"impl": args.impl, "torch": torch.__version__})
    print(json.dumps({"checkpoint": ckpt.dir, "params": len(fqns), "impl": args.impl,
                      "step": int(opt.state[named[fqns[0]]]["step"].item()) if fqns else 0}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    step = sub.add_parser("adamw-step", help="one AdamW step from a checkpoint")
    step.add_argument("checkpoint")
    step.add_argument("--grads", required=True)
    step.add_argument("--out", required=True)
    step.add_argument("--model", choices=sorted(MODELS), default="interleaved")
    step.add_argument("--impl", choices=["fused", "single_tensor"], default="fused")
    args = parser.parse_args()
    try:
        adamw_step(args)
    except mr.CheckpointError as e:
        print(f"python_client.py: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyError as e:  # a field the format requires is absent
        print(f"python_client.py: {args.checkpoint}: missing field or key {e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # OSError, safetensors' own errors...: one line, no traceback
        print(f"python_client.py: {args.checkpoint}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
