"""A Python client of mixprec checkpoints: from a checkpoint directory to a PyTorch model and a
torch.optim.AdamW that continues training where the C++ run stopped.

It uses only the public format (docs/checkpoint-format.md, include/mixprec/checkpoint/format/
manifest.h) and the `safetensors` package; it implements none of mixprec:

  manifest.json   key -> dtype, global shape, chunks (file, tensor, offset, shape)
  common.json     common["optimizer"] = {algorithm, step, steps, param_groups: [{lr, betas, eps,
                  weight_decay, amsgrad, maximize, params: [fqn...]}], frozen, without_state}
  data files      model tensors under their FQNs; "optimizer.state.<name>.<fqn>" for exp_avg,
                  exp_avg_sq, max_exp_avg_sq and fp32_param (the FP32 master of a BF16/FP16
                  parameter)

Mapping onto PyTorch (the model is the C++ one with every parameter in FP32):
  * a parameter with a master takes the master's value: the master is what the optimizer
    steps; the BF16 model value is just its rounding;
  * a native FP32 parameter takes its model value; a frozen one too, but it stays out of the
    optimizer;
  * the optimizer state is built as a PyTorch state dict (positional ids in param-group order,
    "step" as a float tensor) and loaded with AdamW.load_state_dict, so PyTorch checks it.

  python_client.py adamw-step CKPT --grads GRADS --out OUT [--model interleaved]
                   [--impl fused|single_tensor]

takes one AdamW step with the gradients in GRADS (a safetensors file, FQN -> gradient, any
float dtype) and writes OUT (safetensors): "<fqn>" -> the FP32 parameter after the step for
every trainable parameter, and "optimizer.state.<name>.<fqn>" for its new state (step as a
0-dim float tensor). Prints one JSON line summarising what it did. Errors: one line on stderr
naming the file and key, exit status 1.

CKPT may be a checkpoint directory or a root holding a `latest` file. Checksums are not
verified here (`mixprec-ckpt verify` does that).
"""
import argparse
import contextlib
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
STATE_PREFIX = "optimizer.state."
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class ClientError(Exception):
    pass


class Interleaved(torch.nn.Module):
    """Same FQNs and shapes as InterleavedImpl in tests/optim/support_optim.h."""

    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Linear(8, 8, bias=False)
        self.frozen = torch.nn.Linear(8, 8, bias=False)
        self.gate = torch.nn.Parameter(torch.zeros(24))
        self.post = torch.nn.Linear(8, 8, bias=False)


MODELS = {"interleaved": Interleaved}


def checkpoint_dir(path):
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    latest = os.path.join(path, "latest")
    if not os.path.exists(latest):
        raise ClientError(f"{path}: neither a checkpoint (no manifest.json) "
                          "nor a root with 'latest'")
    with open(latest) as f:
        return os.path.join(path, f.read().strip())


def read_manifest(ckpt):
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    # Version 2 only adds per-block checksums ("block_bytes", chunks' "block_xxh3"), which
    # this reader does not need.
    if manifest.get("format") != "mixprec-checkpoint" or manifest.get("version") not in (1, 2):
        raise ClientError(f"{path}: not a mixprec-checkpoint version 1 or 2 manifest")
    return manifest


def read_common(ckpt, manifest):
    if "common" in manifest:
        return manifest["common"]
    path = os.path.join(ckpt, manifest["common_file"]["file"])
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) != manifest["common_file"]["bytes"]:
        raise ClientError(f"{path}: {len(raw)} bytes, "
                          f"the manifest says {manifest['common_file']['bytes']}")
    return json.loads(raw)


def read_tensors(ckpt, manifest, keys):
    """Each key as one global tensor, assembled from its chunks (a sharded save has several)."""
    out, files = {}, {}
    with contextlib.ExitStack() as stack:
        for key in keys:
            entry = manifest["keys"][key]
            whole = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
            for chunk in entry["chunks"]:
                path = os.path.join(ckpt, chunk["file"])
                if path not in files:
                    files[path] = stack.enter_context(safe_open(path, framework="pt"))
                part = files[path].get_tensor(chunk["tensor"])
                if list(part.shape) != chunk["shape"] or part.dtype != whole.dtype:
                    raise ClientError(f"{path}: tensor '{chunk['tensor']}' of key '{key}' is "
                                      f"{part.dtype}{list(part.shape)}, the manifest says "
                                      f"{entry['dtype']}{chunk['shape']}")
                index = tuple(slice(o, o + s) for o, s in zip(chunk["offset"], chunk["shape"]))
                whole[index] = part
            out[key] = whole
    return out


def build_model(name, ckpt, manifest, tensors):
    """The PyTorch model, FP32 throughout, with masters where the checkpoint has them."""
    model = MODELS[name]()
    model_keys = {k for k in manifest["keys"] if not k.startswith("optimizer.") and k != "rng.cpu"}
    names = dict(model.named_parameters())
    if model_keys != set(names):
        raise ClientError(f"{ckpt}: model keys differ from {name}: only in checkpoint "
                          f"{sorted(model_keys - set(names))}, "
                          f"only in model {sorted(set(names) - model_keys)}")
    with torch.no_grad():
        for fqn, param in names.items():
            value = tensors.get(STATE_PREFIX + "fp32_param." + fqn, tensors[fqn])
            if value.shape != param.shape:
                raise ClientError(f"{ckpt}: key '{fqn}': shape {list(value.shape)}, "
                                  f"model has {list(param.shape)}")
            param.copy_(value.float())
    return model


def build_adamw(model, common, tensors, impl):
    """torch.optim.AdamW over the trainable parameters, loaded from a PyTorch-form state dict."""
    opt_common = common["optimizer"]
    if opt_common["algorithm"] != "adamw":
        raise ClientError(f"common.json: optimizer.algorithm is '{opt_common['algorithm']}', "
                          "expected 'adamw'")
    frozen = set(opt_common.get("frozen", []))
    without_state = set(opt_common.get("without_state", []))
    named = dict(model.named_parameters())
    groups, fqns = [], []
    for g, saved in enumerate(opt_common["param_groups"]):
        trainable = [fqn for fqn in saved["params"] if fqn not in frozen]
        for fqn in saved["params"]:
            named[fqn].requires_grad_(fqn not in frozen)
        hyper = {"lr": saved["lr"], "betas": tuple(saved["betas"]), "eps": saved["eps"],
                 "weight_decay": saved["weight_decay"], "amsgrad": saved["amsgrad"],
                 "maximize": saved["maximize"]}
        groups.append(dict(hyper, params=[named[fqn] for fqn in trainable]))
        fqns.extend(trainable)
    extra = {"fused": True} if impl == "fused" else {"foreach": False}
    opt = torch.optim.AdamW(groups, **extra)

    # PyTorch's state dict is positional: ids count through the groups in order.
    state_dict = opt.state_dict()
    state = {}
    for pid, fqn in enumerate(fqns):
        if fqn in without_state:
            continue
        step = opt_common.get("steps", {}).get(fqn, opt_common["step"])
        entry = {"step": torch.tensor(float(step), dtype=torch.float32)}
        for name in MOMENTS:
            key = f"{STATE_PREFIX}{name}.{fqn}"
            if key in tensors:
                entry[name] = tensors[key].float().clone()
        missing = [n for n in ("exp_avg", "exp_avg_sq") if n not in entry]
        if missing:
            raise ClientError(f"checkpoint: parameter '{fqn}' has state but no {missing}")
        state[pid] = entry
    state_dict["state"] = state
    opt.load_state_dict(state_dict)
    return opt, fqns


def adamw_step(args):
    ckpt = checkpoint_dir(args.checkpoint)
    manifest = read_manifest(ckpt)
    common = read_common(ckpt, manifest)
    tensors = read_tensors(ckpt, manifest, [k for k in manifest["keys"] if k != "rng.cpu"])
    model = build_model(args.model, ckpt, manifest, tensors)
    opt, fqns = build_adamw(model, common, tensors, args.impl)

    grads = load_file(args.grads)
    named = dict(model.named_parameters())
    for fqn in fqns:
        if fqn not in grads:
            raise ClientError(f"{args.grads}: no gradient for '{fqn}'")
        named[fqn].grad = grads[fqn].to(torch.float32).reshape(named[fqn].shape)
    opt.step()

    out = {}
    for fqn in fqns:
        param = named[fqn]
        out[fqn] = param.detach().clone()
        for name, value in opt.state[param].items():
            out[f"{STATE_PREFIX}{name}.{fqn}"] = value.detach().to(torch.float32).clone()
    save_file(out, args.out, metadata={"impl": args.impl, "torch": torch.__version__})
    print(json.dumps({"checkpoint": ckpt, "params": len(fqns), "impl": args.impl,
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
    except ClientError as e:
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
