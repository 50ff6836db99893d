"""Read a mixprec checkpoint from Python: tensors, common state, and a torch.optim state dict.

A mixprec checkpoint is plain files (docs/checkpoint-format.md): safetensors data files, a JSON
manifest that says how stored chunks form each logical tensor, and a JSON common state. This
module needs only `torch` and the `safetensors` package; it contains none of mixprec.

    import mixprec_reader as mr
    ckpt = mr.Checkpoint("runs/root")                 # a checkpoint, or a root with `latest`
    weights = ckpt.fp32_params()                      # {fqn: FP32 value}: masters where saved
    groups = ckpt.param_group_names()                 # the saved groups' trained FQNs
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [params[n] for n in g]} for g in groups], fused=True)
    opt.load_state_dict(ckpt.torch_optimizer_state_dict(groups, like=opt))

The reserved names below are those of include/mixprec/checkpoint/format/state_keys.h, one for
one (kOptimizerStatePrefix -> OPTIMIZER_STATE_PREFIX); tests/checkpoint/state_keys_test.cpp
checks that they agree.

What this reader does not do, which mixprec's own (C++) reader does: verify checksums, and look
past `latest` for a newer complete checkpoint (a save that ended between its commit and the
`latest` update). Run `mixprec-ckpt verify CKPT` first on files you do not trust; `mixprec-ckpt
inspect ROOT` says which checkpoint mixprec would load. It does check what it assembles: every
file it opens is a regular file (not a link, FIFO or device: no read can hang), every chunk lies
inside its key's shape, chunks neither overlap nor leave gaps (checked by count before anything
is allocated), and every error is a CheckpointError naming the file and the key. Unlike mixprec
it takes BOOL bytes other than 0 and 1 as True.
"""
import contextlib
import json
import math
import os
import stat

import torch
from safetensors import safe_open

# ---- names reserved by the format (state_keys.h) ---------------------------------------------

# Tensor keys: "optimizer.state.<kind>.<fqn>" for optimizer state; RNG states (a data-parallel
# save adds "rng.rank.<r>.cpu", ... per rank; "rng.cpu" is its rank 0's); everything
# else is a model parameter or buffer under its fully qualified name.
OPTIMIZER_PREFIX = "optimizer."
OPTIMIZER_STATE_PREFIX = "optimizer.state."
FP32_PARAM = "fp32_param"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
MAX_EXP_AVG_SQ = "max_exp_avg_sq"
MOMENTUM_BUFFER = "momentum_buffer"
STATE_KINDS = (FP32_PARAM, EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ, MOMENTUM_BUFFER)
RNG_CPU = "rng.cpu"
RNG_CUDA_PREFIX = "rng.cuda."
RNG_RANK_PREFIX = "rng.rank."

# Top-level fields of the common state.
COMMON_OPTIMIZER = "optimizer"
COMMON_PRECISION = "precision"
COMMON_USER = "user"

# common["precision"][fqn]: "mark", "name <fqn>" or "pattern <glob>".
KEPT_BY_MARK = "mark"
KEPT_BY_NAME = "name"
KEPT_BY_PATTERN = "pattern"

# Fields of common["optimizer"].
ALGORITHM = "algorithm"
STEP = "step"
STEPS = "steps"
PARAM_GROUPS = "param_groups"
PARAMS = "params"
FROZEN = "frozen"
WITHOUT_STATE = "without_state"
SCALER = "scaler"

# Manifest dtype names (docs/checkpoint-format.md) as torch dtypes.
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

# State tensors each algorithm keeps per parameter, in torch.optim's names.
ALGORITHM_STATE = {
    "adam": (EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ),
    "adamw": (EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ),
    "sgd": (MOMENTUM_BUFFER,),
}


class CheckpointError(Exception):
    """A checkpoint that does not follow the format; the message names the file and key."""


def optimizer_state_key(kind, fqn):
    """"optimizer.state.<kind>.<fqn>"."""
    return f"{OPTIMIZER_STATE_PREFIX}{kind}.{fqn}"


def is_model_key(key):
    """True for model parameters and buffers (not optimizer state, not RNG state)."""
    return not key.startswith(OPTIMIZER_PREFIX) and key != RNG_CPU and \
        not key.startswith(RNG_CUDA_PREFIX) and not key.startswith(RNG_RANK_PREFIX)


def _is_plain_name(name):
    """A file or directory name inside the checkpoint (root): no path, nothing reserved."""
    return bool(name) and not name.startswith(".") and "/" not in name and os.sep not in name


def _regular_file(path):
    """`path`, if it is a regular file (not a link, FIFO, socket or device: opening a FIFO
    would block forever); else CheckpointError naming it."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: not a regular file")
    return path


def _read_json(path, raw=None):
    """The JSON value of file `path` (or of its bytes `raw`, already read); CheckpointError
    naming the file if it is not valid JSON."""
    try:
        if raw is None:
            with open(_regular_file(path), "rb") as f:
                raw = f.read()
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e


def resolve(path):
    """The checkpoint directory: `path` itself if it holds manifest.json, else the checkpoint
    its `latest` file names (a plain name of a directory in the root; anything else is refused,
    as mixprec refuses it)."""
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    latest = os.path.join(path, "latest")
    if not os.path.isfile(latest):
        raise CheckpointError(f"{path}: neither a checkpoint (no manifest.json) "
                              "nor a root with a 'latest' file")
    with open(_regular_file(latest), encoding="utf-8", errors="replace") as f:
        name = f.read().strip()
    target = os.path.join(path, name)
    if not _is_plain_name(name) or name in ("lock", "latest") or name.startswith("latest.") or \
            os.path.islink(target) or not os.path.isdir(target):
        raise CheckpointError(f"{latest}: names {name!r}, which is not a checkpoint directory "
                              "of this root")
    return target


class Checkpoint:
    """One checkpoint directory: its manifest and common state, read on construction; tensors
    are read on request."""

    def __init__(self, path):
        self.dir = resolve(path)
        manifest_path = os.path.join(self.dir, "manifest.json")
        self.manifest = _read_json(manifest_path)
        # Version 2 only adds per-block checksums ("block_bytes", chunks' "block_xxh3"), which
        # this reader does not need: safetensors reads whole tensors.
        if not isinstance(self.manifest, dict) or \
                self.manifest.get("format") != "mixprec-checkpoint" or \
                self.manifest.get("version") not in (1, 2) or \
                not isinstance(self.manifest.get("keys"), dict):
            raise CheckpointError(
                f"{manifest_path}: not a mixprec-checkpoint version 1 or 2 manifest")
        self.common = self._read_common()

    def _read_common(self):
        if "common" in self.manifest:
            return self.manifest["common"]
        ref = self.manifest["common_file"]
        if not _is_plain_name(ref["file"]):
            raise CheckpointError(f"{self.dir}/manifest.json: common_file {ref['file']!r} is not "
                                  "a file of the checkpoint")
        path = os.path.join(self.dir, ref["file"])
        with open(_regular_file(path), "rb") as f:
            raw = f.read()
        if len(raw) != ref["bytes"]:
            raise CheckpointError(f"{path}: {len(raw)} bytes, the manifest says {ref['bytes']}")
        return _read_json(path, raw)

    # ---- tensors ---------------------------------------------------------------------------

    def keys(self):
        return list(self.manifest["keys"])

    def model_keys(self):
        return [k for k in self.manifest["keys"] if is_model_key(k)]

    def tensors(self, keys=None):
        """{key: tensor} for `keys` (default: every key), each assembled from its chunks in the
        dtype and global shape the manifest gives."""
        keys = self.keys() if keys is None else list(keys)
        out, files = {}, {}
        with contextlib.ExitStack() as stack:
            for key in keys:
                if key not in self.manifest["keys"]:
                    raise CheckpointError(f"{self.dir}: no key '{key}'")
                entry = self.manifest["keys"][key]
                shape = entry["shape"]
                self._check_counts(key, entry)
                # Every chunk's file, place and stored shape and dtype are checked before the
                # key's tensor is allocated: a manifest's sizes are claims until the files
                # agree with them.
                parts = []
                for chunk in entry["chunks"]:
                    if not _is_plain_name(chunk["file"]):
                        raise CheckpointError(f"{self.dir}: key '{key}': chunk file "
                                              f"{chunk['file']!r} is not a file of the checkpoint")
                    path = os.path.join(self.dir, chunk["file"])
                    offset, size = chunk["offset"], chunk["shape"]
                    if len(offset) != len(shape) or len(size) != len(shape) or any(
                            o < 0 or s < 0 or o + s > g for o, s, g in zip(offset, size, shape)):
                        raise CheckpointError(
                            f"{path}: tensor '{chunk['tensor']}' of key '{key}': offset {offset} "
                            f"and shape {size} do not lie inside the key's shape {shape}")
                    try:
                        if path not in files:
                            files[path] = stack.enter_context(
                                safe_open(_regular_file(path), framework="pt"))
                        stored = files[path].get_slice(chunk["tensor"])
                        stored_shape, stored_dtype = list(stored.get_shape()), stored.get_dtype()
                    except CheckpointError:
                        raise
                    except Exception as e:  # safetensors names neither file nor key
                        raise CheckpointError(f"{path}: tensor '{chunk['tensor']}' of key "
                                              f"'{key}': {e}") from e
                    if stored_shape != size or stored_dtype != entry["dtype"]:
                        raise CheckpointError(
                            f"{path}: tensor '{chunk['tensor']}' of key '{key}' is "
                            f"{stored_dtype}{stored_shape}, the manifest says "
                            f"{entry['dtype']}{size}")
                    parts.append((path, chunk, offset, size))
                whole = torch.empty(shape, dtype=DTYPES[entry["dtype"]])
                # Which elements a chunk filled: none twice, all in the end (torch.empty would
                # otherwise hand back whatever memory held).
                covered = torch.zeros(shape, dtype=torch.bool)
                for path, chunk, offset, size in parts:
                    try:
                        part = files[path].get_tensor(chunk["tensor"])
                    except Exception as e:  # safetensors names neither file nor key
                        raise CheckpointError(f"{path}: tensor '{chunk['tensor']}' of key "
                                              f"'{key}': {e}") from e
                    index = tuple(slice(o, o + s) for o, s in zip(offset, size))
                    if covered[index].any():
                        raise CheckpointError(f"{path}: tensor '{chunk['tensor']}' of key "
                                              f"'{key}' overlaps another chunk of the key")
                    covered[index] = True
                    whole[index] = part
                if not bool(covered.all()):
                    raise CheckpointError(f"{self.dir}: key '{key}': its chunks leave "
                                          f"{int((~covered).sum())} of its elements unwritten")
                out[key] = whole
        return out

    def _check_counts(self, key, entry):
        """Before anything is allocated: a known dtype, a shape of non-negative integers, and
        chunks whose element counts add up to the key's (a manifest claiming a huge shape for a
        few stored elements is refused here, not by a failed allocation)."""
        shape, chunks = entry.get("shape"), entry.get("chunks")
        where = f"{self.dir}/manifest.json: key '{key}'"
        if entry.get("dtype") not in DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {entry.get('dtype')!r}")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of sizes")
        if not isinstance(chunks, list) or not all(
                isinstance(c, dict) and isinstance(c.get("shape"), list) and
                all(isinstance(d, int) and d >= 0 for d in c["shape"]) for c in chunks):
            raise CheckpointError(f"{where}: chunks are not a list of chunks with shapes")
        stored = sum(math.prod(c["shape"]) for c in chunks)
        if stored != math.prod(shape):
            raise CheckpointError(f"{where}: chunks hold {stored} of its {math.prod(shape)} "
                                  "elements")

    def tensor(self, key):
        return self.tensors([key])[key]

    # ---- common state ----------------------------------------------------------------------

    def optimizer(self):
        """common["optimizer"] (algorithm, step, param groups...); None if not a training state."""
        return self.common.get(COMMON_OPTIMIZER)

    def precision(self):
        """{fqn: why a conversion kept the tensor FP32} ("mark", "name <fqn>", "pattern <glob>")."""
        return dict(self.common.get(COMMON_PRECISION, {}))

    def user(self):
        return self.common.get(COMMON_USER, {})

    # ---- model and optimizer ---------------------------------------------------------------

    def fp32_params(self, fqns=None):
        """{fqn: FP32 value} of model tensors (default: every model key): the FP32 master where
        the checkpoint has one (the value the optimizer steps; the BF16/FP16 model tensor is its
        rounding), otherwise the model tensor itself, as FP32 if floating."""
        fqns = self.model_keys() if fqns is None else list(fqns)
        wanted = [optimizer_state_key(FP32_PARAM, f) if optimizer_state_key(FP32_PARAM, f)
                  in self.manifest["keys"] else f for f in fqns]
        values = self.tensors(wanted)
        out = {}
        for fqn, key in zip(fqns, wanted):
            value = values[key]
            out[fqn] = value.float() if value.is_floating_point() else value
        return out

    def param_group_names(self):
        """The saved optimizer's param groups as lists of FQNs, frozen parameters left out: the
        groups a torch optimizer built from them takes this checkpoint's state into."""
        opt = self.optimizer()
        if opt is None:
            raise CheckpointError(f"{self.dir}: the common state has no '{COMMON_OPTIMIZER}'")
        frozen = set(opt.get(FROZEN, []))
        return [[f for f in group[PARAMS] if f not in frozen] for group in opt[PARAM_GROUPS]]

    def torch_optimizer_state_dict(self, param_groups=None, like=None):
        """A torch.optim state dict ({"state", "param_groups"}) of this checkpoint's optimizer,
        for a torch optimizer whose param groups hold the parameters named in `param_groups`
        (a list of lists of FQNs, in the torch optimizer's order; default: the saved groups
        without frozen parameters). Ids count through the groups in order, as torch numbers
        them. Each group takes the saved hyper-parameters (torch's names) of the saved group
        holding its parameters; settings the checkpoint does not hold (torch's implementation
        flags: fused, foreach, capturable...) come from the same group of `like`, the torch
        optimizer it is meant for, if given. "step" is a 0-dim float32 tensor, moments FP32.
        Frozen parameters and those never stepped get no state entry."""
        opt = self.optimizer()
        if opt is None:
            raise CheckpointError(f"{self.dir}: the common state has no '{COMMON_OPTIMIZER}'")
        algorithm = opt[ALGORITHM]
        if algorithm not in ALGORITHM_STATE:
            raise CheckpointError(f"{self.dir}: unknown optimizer algorithm '{algorithm}'")
        frozen = set(opt.get(FROZEN, []))
        without_state = set(opt.get(WITHOUT_STATE, []))
        saved_group_of = {fqn: g for g, group in enumerate(opt[PARAM_GROUPS])
                          for fqn in group[PARAMS]}
        if param_groups is None:
            param_groups = self.param_group_names()

        state, groups, pid = {}, [], 0
        for g, fqns in enumerate(param_groups):
            unknown = [f for f in fqns if f not in saved_group_of]
            if unknown:
                raise CheckpointError(f"{self.dir}: group {g}: no saved parameter {unknown}")
            sources = sorted({saved_group_of[f] for f in fqns})
            if len(sources) > 1:
                raise CheckpointError(f"{self.dir}: group {g} mixes parameters of saved groups "
                                      f"{sources}, which may differ in hyper-parameters")
            hyper = dict(opt[PARAM_GROUPS][sources[0]] if sources else {})
            hyper.pop(PARAMS, None)
            if "betas" in hyper:
                hyper["betas"] = tuple(hyper["betas"])
            if like is not None and g < len(like.param_groups):
                for key, value in like.param_groups[g].items():
                    if key != PARAMS and key not in hyper:
                        hyper[key] = value
            groups.append(dict(hyper, params=list(range(pid, pid + len(fqns)))))
            for fqn in fqns:
                if fqn not in frozen and fqn not in without_state:
                    state[pid] = self._param_state(opt, algorithm, fqn)
                pid += 1
        return {"state": state, "param_groups": groups}

    def _param_state(self, opt, algorithm, fqn):
        entry = {}
        if algorithm != "sgd":
            step = opt.get(STEPS, {}).get(fqn, opt[STEP])
            entry["step"] = torch.tensor(float(step), dtype=torch.float32)
        keys = {kind: optimizer_state_key(kind, fqn) for kind in ALGORITHM_STATE[algorithm]}
        present = {kind: key for kind, key in keys.items() if key in self.manifest["keys"]}
        values = self.tensors(list(present.values()))
        for kind, key in present.items():
            entry[kind] = values[key].float()
        required = (EXP_AVG, EXP_AVG_SQ) if algorithm != "sgd" else ()
        missing = [kind for kind in required if kind not in entry]
        if missing:
            raise CheckpointError(f"{self.dir}: parameter '{fqn}' has state but no {missing}")
        return entry


def names():
    """Every reserved name above, by its Python name (checked against state_keys.h)."""
    return {name: value for name, value in globals().items()
            if name.isupper() and isinstance(value, (str, tuple)) and
            all(isinstance(v, str) for v in (value if isinstance(value, tuple) else (value,)))}
