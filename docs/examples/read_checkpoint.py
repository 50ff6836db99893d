import sys

import torch

import mixprec_reader  # python/mixprec_reader.py: needs only torch and safetensors

ckpt = mixprec_reader.Checkpoint(sys.argv[1])   # a checkpoint, or a root with `latest`
print(ckpt.dir, ckpt.optimizer()["step"], ckpt.user())
print(ckpt.precision())                         # {"gate": "mark"}: why gate is FP32

weights = ckpt.fp32_params()                    # FP32 masters where saved, else model values
model = torch.nn.Module()
model.fc = torch.nn.Linear(32, 32)
model.gate = torch.nn.Parameter(torch.ones(32))
model.load_state_dict(weights)

# torch's positional state dict, for this optimizer's parameter order and settings.
opt = torch.optim.AdamW(model.parameters(), fused=True)
names = [name for name, _ in model.named_parameters()]
opt.load_state_dict(ckpt.torch_optimizer_state_dict([names], like=opt))
print(len(opt.state), "parameters with AdamW state, lr", opt.param_groups[0]["lr"])
