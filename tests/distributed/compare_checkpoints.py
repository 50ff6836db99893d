"""Test oracle: two mixprec checkpoints hold the same training state, read with the Python
reader (python/mixprec_reader.py: `safetensors` and torch only).

    compare_checkpoints.py A B

Compares every model and optimizer key (RNG keys aside: per-rank generators differ by
design) as assembled from each checkpoint's chunks, bit for bit with dtype and shape, the
optimizer's common state, and the torch.optim state dicts the reader builds. Run by
tests/distributed/mp/collective_checkpoint_mp.cpp for a ZeRO-1 checkpoint written by N ranks against
a single-process one. Prints one JSON line; exit status 0 when equal, 1 otherwise.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import mixprec_reader as mr  # noqa: E402


def state_keys(ckpt):
    return sorted(k for k in ckpt.keys() if not k.startswith("rng."))


def main():
    a, b = mr.Checkpoint(sys.argv[1]), mr.Checkpoint(sys.argv[2])
    problems = []
    keys_a, keys_b = state_keys(a), state_keys(b)
    if keys_a != keys_b:
        problems.append(f"keys differ: {sorted(set(keys_a) ^ set(keys_b))}")
    common = sorted(set(keys_a) & set(keys_b))
    ta, tb = a.tensors(common), b.tensors(common)
    for key in common:
        x, y = ta[key], tb[key]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            problems.append(f"{key}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
    if a.optimizer() != b.optimizer():
        problems.append("common['optimizer'] differs")
    sa, sb = a.torch_optimizer_state_dict(), b.torch_optimizer_state_dict()
    if sa["param_groups"] != sb["param_groups"] or sa["state"].keys() != sb["state"].keys():
        problems.append("torch optimizer state dicts differ in groups or ids")
    else:
        for pid, entry in sa["state"].items():
            for name, value in entry.items():
                if not torch.equal(value, sb["state"][pid][name]):
                    problems.append(f"torch state {pid}.{name} differs")
    print(json.dumps({"keys": len(common), "tensors_compared": len(common),
                      "torch_state_ids": len(sa["state"]), "problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
