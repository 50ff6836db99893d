"""Oracle for python_interop_test.cpp: the reference `safetensors` package reads what mixprec
writes, and writes what mixprec must read.

  safetensors_interop.py read PATH    prints JSON {"metadata": {...}, "tensors": {name:
                                      {"dtype": "BF16", "shape": [...], "hex": "<raw bytes>"}}}
  safetensors_interop.py write PATH   writes a file with safetensors.torch.save_file and
                                      prints the same JSON for what it wrote
"""
import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def describe(tensors, metadata):
    out = {}
    for name, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        out[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "hex": bytes(raw.tolist()).hex()}
    return {"metadata": metadata or {}, "tensors": out}


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "read":
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata()
    else:
        g = torch.Generator().manual_seed(0)
        tensors = {
            "model.embed.weight": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "optimizer.state.step": torch.tensor(42, dtype=torch.int64),
            "optimizer.state.exp_avg.w": torch.randn(4, generator=g),
            "fp8": torch.randn(2, 2, generator=g).to(torch.float8_e5m2),
            "mask": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 4, dtype=torch.float16),
            "f64": torch.randn(3, generator=g, dtype=torch.float64),
        }
        metadata = {"format": "pt", "written_by": "python"}
        save_file(tensors, path, metadata=metadata)
    print(json.dumps(describe(tensors, metadata)))


if __name__ == "__main__":
    main()
