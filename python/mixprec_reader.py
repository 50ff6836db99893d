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
inspect ROOT` says which checkpoint mixprec would load. It does refuse what mixprec refuses: the
manifest is checked by the rules of mixprec's own parser (include/mixprec/checkpoint/format/
manifest.h: fields, types, file names, sizes, no stored tensor used by two chunks, chunks inside
their key's shape and adding up to it; its JSON, and the common state's, parsed as nlohmann
parses it) and `latest` by mixprec's (a name and one newline); the saved param groups'
hyper-parameters are checked as mixprec checks them before it loads them. Every file it opens
is a regular file (not a link, FIFO or device: no read can hang), chunks neither overlap nor
leave gaps, and every error is a CheckpointError naming the file, the key and the field. Unlike
mixprec it takes BOOL bytes other than 0 and 1 as True.
"""
import contextlib
import json
import math
import os
import re
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


# Hyper-parameters each algorithm's saved param groups hold, in torch.optim's names, with the
# JSON each must be (algorithm_traits.cpp: read_json).
_NUMBER, _TWO_NUMBERS, _BOOLEAN = "a number", "two numbers", "a boolean"
_ADAM_HYPER_PARAMETERS = (("lr", _NUMBER), ("betas", _TWO_NUMBERS), ("eps", _NUMBER),
                          ("weight_decay", _NUMBER), ("amsgrad", _BOOLEAN))
_HYPER_PARAMETERS = {
    "adam": _ADAM_HYPER_PARAMETERS,
    "adamw": _ADAM_HYPER_PARAMETERS,
    "sgd": (("lr", _NUMBER), ("momentum", _NUMBER), ("dampening", _NUMBER),
            ("weight_decay", _NUMBER), ("nesterov", _BOOLEAN)),
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


# ---- the files' own rules, as mixprec's reader applies them -----------------------------------

_MANIFEST_FORMAT = "mixprec-checkpoint"
_MANIFEST_VERSIONS = (1, 2)  # 2 adds per-block checksums ("block_bytes", chunks' "block_xxh3")
_LATEST = "latest"
_LOCK = "lock"
# The bounds of mixprec's reader (latest.cpp, manifest.h: kMaxJsonDepth).
_MAX_LATEST_BYTES = 4096
_MAX_JSON_DEPTH = 256
_HEX16 = re.compile(r"[0-9a-f]{16}")
_FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
_SURROGATE = re.compile("[\ud800-\udfff]")  # in a parsed string: a lone one (_depth)


def _is_valid_file_name(name):
    """A file (or checkpoint directory) name as mixprec allows it (manifest.h:
    is_valid_file_name): 1-200 characters from [A-Za-z0-9._-], not starting with '.'."""
    return isinstance(name, str) and _FILE_NAME.fullmatch(name) is not None and \
        not name.startswith(".")


def _is_reserved_name(name):
    """`latest`, `latest.*` and `lock` are never checkpoint names (root_layout.h)."""
    return name in (_LATEST, _LOCK) or name.startswith(_LATEST + ".")


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


def _refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def _finite(text):
    """A JSON number as a float; json would take 1e400 as infinity, mixprec refuses it."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


class _NegativeZero(int):
    """The JSON integer -0: 0 to Python, but a negative integer to mixprec's parser (nlohmann
    holds an integer written with a minus sign as signed), so not an unsigned integer."""


def _integer(text):
    """A JSON integer as mixprec's parser holds it (nlohmann's lexer): an int if it fits int64
    (written with a minus sign) or uint64 (without), -0 kept apart from 0; else, as nlohmann
    falls back to, the nearest float, refused if it overflows (10**400). So 2**64 reads as a
    float, which no field that wants an integer takes, and json's exact big ints never appear."""
    if len(text.lstrip("-")) <= 20:  # JSON has no leading zeros: more digits are ≥ 10^20
        value = int(text)
        if -(1 << 63) <= value < 1 << 64:
            return _NegativeZero() if text == "-0" else value
    return _finite(text)


def _no_duplicates(pairs):
    """An object's members, refusing a name given twice (json keeps the last one silently; two
    readers could then read one file differently)."""
    out = {}
    for name, value in pairs:
        if name in out:
            raise ValueError(f"duplicate member {name!r}")
        out[name] = value
    return out


def _depth(value):
    """How deeply `value`'s arrays and objects nest (0 for a scalar); ValueError if a string or
    member name in it holds a lone surrogate ("\\ud800": json takes the escape, nlohmann refuses
    it; the input being UTF-8, an escape is the only way one gets in, and json joins an escaped
    pair into one character)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        strings = item if isinstance(item, dict) else (item,) if isinstance(item, str) else ()
        for text in strings:
            lone = _SURROGATE.search(text)
            if lone:
                raise ValueError(f"invalid string: lone surrogate U+{ord(lone.group()):04X} in "
                                 f"{text[:60]!r}")
        children = item.values() if isinstance(item, dict) else \
            item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((c, depth + 1) for c in children)
    return deepest


def _read_json(path, raw=None):
    """The JSON value of file `path` (or of its bytes `raw`, already read), parsed as strictly
    as mixprec parses it (strict_json.h): UTF-8 (after one leading BOM, which nlohmann skips), no
    lone surrogate escapes, no NaN or Infinity, integers and floats as nlohmann holds them
    (_integer, _finite), no duplicate member names, nesting bounded; CheckpointError naming the
    file otherwise."""
    try:
        if raw is None:
            with open(_regular_file(path), "rb") as f:
                raw = f.read()
        if raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        value = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant,
                           parse_float=_finite, parse_int=_integer,
                           object_pairs_hook=_no_duplicates)
        depth = _depth(value)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e
    if depth > _MAX_JSON_DEPTH:
        raise CheckpointError(f"{path}: JSON nested deeper than {_MAX_JSON_DEPTH} levels")
    return value


def _describe(value):
    """A JSON value's type as mixprec's messages name it (strict_json.cpp)."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: True is an int in Python
        return "a boolean"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int):  # within [-2^63, 2^64) (_integer)
        return "a negative integer" if value < 0 or isinstance(value, _NegativeZero) \
            else "an unsigned integer"
    return "a non-integer number"


def _is_uint(value, limit):
    return isinstance(value, int) and not isinstance(value, (bool, _NegativeZero)) and \
        0 <= value < limit


# Each reads one field of a manifest object, checked as mixprec checks it (strict_json.h);
# `where` locates the object ("<manifest>: key 'w': chunk 0") and starts the CheckpointError.

def _members(value, where, required, optional=()):
    """`value`, if it is an object with every `required` member and no other than `optional`."""
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected a JSON object, found {_describe(value)}")
    for name in required:
        if name not in value:
            raise CheckpointError(f"{where}: missing field '{name}'")
    for name in value:
        if name not in required and name not in optional:
            raise CheckpointError(f"{where}: unknown field '{name}'")
    return value


def _field(obj, name, where):
    if name not in obj:
        raise CheckpointError(f"{where}: missing field '{name}'")
    return obj[name]


def _string(obj, name, where):
    value = _field(obj, name, where)
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: field '{name}': expected a string, found "
                              f"{_describe(value)}")
    return value


def _u64(obj, name, where):
    value = _field(obj, name, where)
    if not _is_uint(value, 1 << 64):
        raise CheckpointError(f"{where}: field '{name}': expected an unsigned integer, found "
                              f"{_describe(value)}")
    return value


def _dims(obj, name, where):
    value = _field(obj, name, where)
    if not isinstance(value, list):
        raise CheckpointError(f"{where}: field '{name}': expected an array of integers, found "
                              f"{_describe(value)}")
    for i, d in enumerate(value):
        if not _is_uint(d, 1 << 63):
            found = "a value ≥ 2^63" if _is_uint(d, 1 << 64) else _describe(d)
            raise CheckpointError(f"{where}: field '{name}'[{i}]: expected an integer in "
                                  f"[0, 2^63), found {found}")
    return value


def _checksum(value, where):
    if not isinstance(value, str) or not _HEX16.fullmatch(value):
        raise CheckpointError(f"{where}: expected 16 lowercase hex digits, found {value!r}")


def _check_chunk(chunk, where, block_bytes):
    fields = ("file", "tensor", "offset", "shape", "bytes", "xxh3")
    _members(chunk, where, fields + ("block_xxh3",) if block_bytes else fields)
    _string(chunk, "file", where)
    _string(chunk, "tensor", where)
    _dims(chunk, "offset", where)
    _dims(chunk, "shape", where)
    _u64(chunk, "bytes", where)
    _checksum(chunk["xxh3"], f"{where}: field 'xxh3'")
    if block_bytes:
        blocks = chunk["block_xxh3"]
        if not isinstance(blocks, list):
            raise CheckpointError(f"{where}: field 'block_xxh3': expected an array")
        for i, hex_digits in enumerate(blocks):
            _checksum(hex_digits, f"{where}: field 'block_xxh3': entry {i}")


def _check_key(key, entry, where, block_bytes, used):
    """One key's entry: its fields, then what they must agree on (manifest.cpp: validate_key).
    `used` collects the (file, tensor) pairs of the manifest's chunks: none may serve twice."""
    if not key:
        raise CheckpointError(f"{where}: a key has an empty name")
    where = f"{where}: key '{key}'"
    _members(entry, where, ("dtype", "shape", "chunks"))
    dtype = _string(entry, "dtype", where)
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: field 'dtype': unknown dtype '{dtype}'")
    shape = _dims(entry, "shape", where)
    chunks = entry["chunks"]
    if not isinstance(chunks, list):
        raise CheckpointError(f"{where}: field 'chunks': expected an array")
    size = DTYPES[dtype].itemsize
    # mixprec's count: the element size times each dimension in turn, refused once past
    # 2^63 - 1, so a later 0 does not undo it ([2^61, 0] of F32 is refused, [0, 2^61] is not).
    total = size
    for d in shape:
        total *= d
        if total >= 1 << 63:
            raise CheckpointError(f"{where}: global shape {shape} has more than 2^63 bytes "
                                  "(counted dimension by dimension, as mixprec counts)")
    stored = 0
    for i, chunk in enumerate(chunks):
        at = f"{where}: chunk {i}"
        _check_chunk(chunk, at, block_bytes)
        name, tensor, offset, extent = chunk["file"], chunk["tensor"], chunk["offset"], \
            chunk["shape"]
        if not _is_valid_file_name(name):
            raise CheckpointError(f"{at}: field 'file': {name!r} is not a plain file name in the "
                                  "directory")
        if not tensor:
            raise CheckpointError(f"{at}: field 'tensor' is empty")
        if (name, tensor) in used:
            raise CheckpointError(f"{at}: tensor '{tensor}' in '{name}' is already used by "
                                  "another chunk")
        used.add((name, tensor))
        if len(offset) != len(shape) or len(extent) != len(shape):
            raise CheckpointError(f"{at}: offset and shape must have the key's rank "
                                  f"{len(shape)}, found {len(offset)} and {len(extent)}")
        if any(o + e > g for o, e, g in zip(offset, extent, shape)):
            raise CheckpointError(f"{at}: box {offset}+{extent} lies outside the global shape "
                                  f"{shape}")
        expected = math.prod(extent) * size
        if chunk["bytes"] != expected:
            raise CheckpointError(f"{at}: field 'bytes' is {chunk['bytes']} but shape "
                                  f"{offset}+{extent} of {dtype} needs {expected}")
        blocks = -(-expected // block_bytes) if block_bytes else 0
        if len(chunk.get("block_xxh3", ())) != blocks:
            raise CheckpointError(f"{at}: field 'block_xxh3' has "
                                  f"{len(chunk.get('block_xxh3', ()))} checksums, but "
                                  f"{expected} bytes in blocks of {block_bytes} need {blocks}")
        stored += math.prod(extent)
    # Chunks inside the shape whose elements add up to it: they tile it exactly unless two
    # overlap, which reading the key finds (mixprec checks it here; Python would be slow at it
    # for many chunks, and nothing is allocated before the read).
    if stored != math.prod(shape):
        raise CheckpointError(f"{where}: chunks hold {stored} of its {math.prod(shape)} "
                              "elements")


def _check_manifest(manifest, path):
    """Raises CheckpointError unless `manifest` (the JSON value of file `path`) is one mixprec's
    parser accepts (manifest.cpp: parse_manifest, validate_manifest), refusing the same files
    with the same messages: the same fields and JSON types, exactly one of "common" and
    "common_file", plain file names, chunks of their key's rank inside its shape with the bytes
    their shape needs, no (file, tensor) pair used twice."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: manifest is not a JSON object")
    # Format and version first: a newer writer may have changed anything else.
    if _string(manifest, "format", path) != _MANIFEST_FORMAT:
        raise CheckpointError(f"{path}: field 'format' is '{manifest['format']}', expected "
                              f"'{_MANIFEST_FORMAT}'")
    version = _u64(manifest, "version", path)
    if version > max(_MANIFEST_VERSIONS):
        raise CheckpointError(f"{path}: manifest version {version} is newer than this reader "
                              f"supports ({max(_MANIFEST_VERSIONS)})")
    if version not in _MANIFEST_VERSIONS:
        raise CheckpointError(f"{path}: manifest version {version} is not supported (expected "
                              f"1 or 2)")
    with_blocks = version == 2
    required = ("format", "version", "sequence", "keys")
    _members(manifest, path, required + ("block_bytes",) if with_blocks else required,
             ("common", "common_file"))
    if _u64(manifest, "sequence", path) == 0:
        raise CheckpointError(f"{path}: field 'sequence' must be ≥ 1")
    block_bytes = _u64(manifest, "block_bytes", path) if with_blocks else 0
    if with_blocks and block_bytes == 0:
        raise CheckpointError(f"{path}: field 'block_bytes' must be ≥ 1")
    if ("common" in manifest) == ("common_file" in manifest):
        raise CheckpointError(f"{path}: exactly one of 'common' and 'common_file' must be "
                              "present")
    if "common" in manifest and not isinstance(manifest["common"], dict):
        raise CheckpointError(f"{path}: field 'common' must be a JSON object")
    if "common_file" in manifest:
        where = f"{path}: field 'common_file'"
        ref = _members(manifest["common_file"], where, ("file", "bytes", "xxh3"))
        _string(ref, "file", where)
        _u64(ref, "bytes", where)
        _checksum(ref["xxh3"], f"{where}: field 'xxh3'")
        if not _is_valid_file_name(ref["file"]):
            raise CheckpointError(f"{where}: {ref['file']!r} is not a plain file name in the "
                                  "directory")
    keys = manifest["keys"]
    if not isinstance(keys, dict):
        raise CheckpointError(f"{path}: field 'keys': expected an object")
    used = set()
    for key in sorted(keys):  # mixprec's order, so the first error is the same
        _check_key(key, keys[key], path, block_bytes, used)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_hyper_parameters(algorithm, group, where):
    """Raises CheckpointError at `where` unless saved param group `group` holds the
    hyper-parameters mixprec loads into its optimizer, checked as it checks them: each of the
    algorithm's present with its JSON type, "maximize" absent or false (algorithm_traits.cpp:
    JsonReader, read_json), values in the ranges its step accepts (step_args.cpp:
    check_adam_hyper_params, check_sgd_hyper_params)."""
    if "maximize" in group and group["maximize"] is not False:
        raise CheckpointError(f"{where}: maximize must be false (LibTorch's option types have no "
                              "maximize)")
    fields = _HYPER_PARAMETERS[algorithm]
    for name, kind in fields:
        value = group.get(name)
        if kind == _BOOLEAN:
            ok = isinstance(value, bool)
        elif kind == _NUMBER:
            ok = _is_number(value)
        else:
            ok = isinstance(value, list) and len(value) == 2 and all(map(_is_number, value))
        if not ok:
            raise CheckpointError(f"{where}: hyper-parameter '{name}' missing or not {kind}")
    names = {name for name, _ in fields}
    ranges = [(name, group[name], 0, None) for name in ("lr", "eps", "momentum", "weight_decay")
              if name in names]
    if "betas" in names:
        ranges += [(f"betas[{i}]", beta, 0, 1) for i, beta in enumerate(group["betas"])]
    for name, value, low, high in ranges:
        if value < low or (high is not None and value >= high):
            raise CheckpointError(f"{where}: hyper-parameter '{name}' is {value}, outside "
                                  f"[{low}, {'∞' if high is None else high})")
    if group.get("nesterov") and not (group["momentum"] > 0 and group["dampening"] == 0):
        raise CheckpointError(f"{where}: hyper-parameter 'nesterov' requires 'momentum' > 0 and "
                              "'dampening' == 0")


def resolve(path):
    """The checkpoint directory: `path` itself if it holds manifest.json, else the checkpoint
    its `latest` file names. `latest` must be what mixprec writes and reads (latest.cpp): a
    regular file holding a valid checkpoint name and one newline (no spaces, no "\\r", nothing
    after), naming a real directory of the root; anything else is refused, as mixprec refuses
    it."""
    path = os.fspath(path)
    if os.path.lexists(os.path.join(path, "manifest.json")):
        return path
    latest = os.path.join(path, _LATEST)
    if not os.path.lexists(latest):
        raise CheckpointError(f"{path}: neither a checkpoint (no manifest.json) "
                              "nor a root with a 'latest' file")
    with open(_regular_file(latest), "rb") as f:
        raw = f.read(_MAX_LATEST_BYTES + 1)
    if len(raw) > _MAX_LATEST_BYTES:
        raise CheckpointError(f"{latest}: more than the {_MAX_LATEST_BYTES} bytes allowed")
    if not raw.endswith(b"\n"):
        raise CheckpointError(f"{latest}: expected a checkpoint name followed by a newline")
    name = raw[:-1].decode("utf-8", errors="backslashreplace")
    if not _is_valid_file_name(name) or _is_reserved_name(name):
        raise CheckpointError(f"{latest}: {name!r} is not a valid checkpoint name (no '/', no "
                              "leading '.', not a reserved name)")
    target = os.path.join(path, name)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        raise CheckpointError(f"{latest}: names '{name}' but {target} is not a directory "
                              "(no such entry)") from None
    except OSError as e:
        raise CheckpointError(f"{target}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{latest}: names '{name}' but {target} is not a real directory; "
                              "a checkpoint is read only from real directories")
    return target


class Checkpoint:
    """One checkpoint directory: its manifest and common state, read and checked on
    construction; tensors are read on request."""

    def __init__(self, path):
        self.dir = resolve(path)
        manifest_path = os.path.join(self.dir, "manifest.json")
        self.manifest = _read_json(manifest_path)
        # Version 2 only adds per-block checksums, which this reader does not need
        # (safetensors reads whole tensors), but checks like the rest.
        _check_manifest(self.manifest, manifest_path)
        self.common = self._read_common()

    def _read_common(self):
        if "common" in self.manifest:
            return self.manifest["common"]
        ref = self.manifest["common_file"]
        path = os.path.join(self.dir, ref["file"])
        with open(_regular_file(path), "rb") as f:
            raw = f.read()
        if len(raw) != ref["bytes"]:
            raise CheckpointError(f"{path}: common state is {len(raw)} bytes, the manifest says "
                                  f"{ref['bytes']}")
        common = _read_json(path, raw)
        if not isinstance(common, dict):
            raise CheckpointError(f"{path}: common state is not a JSON object")
        return common

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
                # Every chunk's stored shape and dtype are checked before the key's tensor is
                # allocated: a manifest's sizes are claims until the files agree with them.
                parts = []
                for chunk in entry["chunks"]:
                    path = os.path.join(self.dir, chunk["file"])
                    offset, size = chunk["offset"], chunk["shape"]
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

    def _checked_optimizer(self):
        """common["optimizer"], its fields' presence and types checked: a malformed one is a
        CheckpointError naming the field, not a KeyError or TypeError from deep inside."""
        opt = self.optimizer()
        if opt is None:
            raise CheckpointError(f"{self.dir}: the common state has no '{COMMON_OPTIMIZER}'")
        where = f"{self.dir}: common state '{COMMON_OPTIMIZER}'"

        def names(value, field):
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                raise CheckpointError(f"{where}: field '{field}' must be a list of names")

        def count(value, field):  # a step count, checked as the loader does (step_problem)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2 ** 63:
                raise CheckpointError(f"{where}: field '{field}' must be an integer in [0, 2^63), "
                                      f"found {value!r}")

        if not isinstance(opt, dict):
            raise CheckpointError(f"{where} must be an object")
        for field in (ALGORITHM, STEP, PARAM_GROUPS):
            if field not in opt:
                raise CheckpointError(f"{where}: no field '{field}'")
        if not isinstance(opt[ALGORITHM], str):
            raise CheckpointError(f"{where}: field '{ALGORITHM}' must be a string")
        count(opt[STEP], STEP)
        if not isinstance(opt[PARAM_GROUPS], list):
            raise CheckpointError(f"{where}: field '{PARAM_GROUPS}' must be a list")
        for g, group in enumerate(opt[PARAM_GROUPS]):
            if not isinstance(group, dict) or PARAMS not in group:
                raise CheckpointError(f"{where}: {PARAM_GROUPS}[{g}] must be an object with "
                                      f"'{PARAMS}'")
            names(group[PARAMS], f"{PARAM_GROUPS}[{g}].{PARAMS}")
        for field in (FROZEN, WITHOUT_STATE):
            if field in opt:
                names(opt[field], field)
        if STEPS in opt:
            if not isinstance(opt[STEPS], dict):
                raise CheckpointError(f"{where}: field '{STEPS}' must be an object")
            for fqn, step in opt[STEPS].items():
                count(step, f"{STEPS}.{fqn}")
        return opt

    def param_group_names(self):
        """The saved optimizer's param groups as lists of FQNs, frozen parameters left out: the
        groups a torch optimizer built from them takes this checkpoint's state into."""
        opt = self._checked_optimizer()
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
        Frozen parameters and those never stepped get no state entry. Every saved group's
        hyper-parameters are checked first, as mixprec checks them before it loads them."""
        opt = self._checked_optimizer()
        algorithm = opt[ALGORITHM]
        if algorithm not in ALGORITHM_STATE:
            raise CheckpointError(f"{self.dir}: unknown optimizer algorithm '{algorithm}'")
        for g, group in enumerate(opt[PARAM_GROUPS]):
            _check_hyper_parameters(algorithm, group, f"{self.dir}: common state "
                                    f"'{COMMON_OPTIMIZER}': {PARAM_GROUPS}[{g}]")
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
            if name.isupper() and not name.startswith("_") and isinstance(value, (str, tuple)) and
            all(isinstance(v, str) for v in (value if isinstance(value, tuple) else (value,)))}
