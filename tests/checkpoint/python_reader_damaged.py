"""Damaged copies of a good checkpoint, read with python/mixprec_reader.py: each one must end in
a CheckpointError that names the file at fault (and for a manifest, the key and field) — never
a hang, a foreign exception, an allocation of what a manifest merely claims, or a read of what
mixprec's own reader refuses (a manifest or a `latest` it does not accept). And copies changed
in ways mixprec's reader accepts must read without one.

    python_reader_damaged.py CHECKPOINT SCRATCH    (prints "ok <cases>" and exits 0, or fails)

CHECKPOINT must be the checkpoint its root's `latest` names (the root is its parent).
"""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import mixprec_reader as mr  # noqa: E402


def damaged(scratch, good, name, change):
    """A copy of `good` in scratch/name with change(copy) applied."""
    copy = os.path.join(scratch, name)
    shutil.copytree(good, copy, symlinks=True)
    change(copy)
    return copy


def first_data_file(ckpt_dir):
    return os.path.join(ckpt_dir, sorted(f for f in os.listdir(ckpt_dir)
                                         if f.startswith("data-"))[0])


def to_fifo(path):
    os.remove(path)
    os.mkfifo(path)


def truncate(path, keep):
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(raw[:keep])


def edit_manifest(ckpt_dir, edit):
    path = os.path.join(ckpt_dir, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)


def edit_chunk(key, edit):
    """A manifest edit applying edit(chunk) to the first chunk of `key`."""
    return lambda manifest: edit(manifest["keys"][key]["chunks"][0])


def edit_raw_manifest(ckpt_dir, old, new):
    """Replaces the first `old` in manifest.json's text (for what json.dump cannot write)."""
    path = os.path.join(ckpt_dir, "manifest.json")
    with open(path) as f:
        text = f.read()
    assert old in text, old
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))


# A value an edit places where edit_raw_manifest or edit_common then writes JSON that json.dump
# does not write (-0).
LITERAL = "@literal@"


def prefix_bom(path):
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(b"\xef\xbb\xbf" + raw)


def rename_data_files(ckpt_dir, name):
    """Every chunk in one data file called `name` (the checkpoint has one data file)."""
    os.rename(first_data_file(ckpt_dir), os.path.join(ckpt_dir, name))

    def edit(manifest):
        for entry in manifest["keys"].values():
            for chunk in entry["chunks"]:
                chunk["file"] = name
    edit_manifest(ckpt_dir, edit)


def write_latest(root, content):
    with open(os.path.join(root, "latest"), "wb") as f:
        f.write(content)


def claim_huge_shape(manifest):
    key = next(k for k, e in manifest["keys"].items() if e["shape"])
    manifest["keys"][key]["shape"] = [100000, 100000]


def claim_huge_chunk(manifest):
    """Shape, chunk and bytes agree with each other, not with the stored tensor: 2^40 elements.
    As version 1 (no block checksums, which would take 2^22 entries)."""
    manifest["version"] = 1
    manifest.pop("block_bytes")
    for entry in manifest["keys"].values():
        for chunk in entry["chunks"]:
            chunk.pop("block_xxh3")
    key = next(k for k, e in manifest["keys"].items()
               if len(e["chunks"]) == 1 and e["shape"] and e["dtype"] == "F32")
    entry = manifest["keys"][key]
    entry["shape"] = [1 << 40] + [1] * (len(entry["shape"]) - 1)
    entry["chunks"][0]["shape"] = list(entry["shape"])
    entry["chunks"][0]["bytes"] = 4 << 40


def link_data_file(ckpt_dir):
    data = first_data_file(ckpt_dir)
    os.rename(data, data + ".real")
    os.symlink(os.path.basename(data) + ".real", data)


def manifest_cases(exp_avg_gate):
    """Manifests mixprec's parser refuses (manifest.h), each with what the error must name."""
    def pop(field):
        return lambda obj: obj.pop(field)

    def share_gate_chunks(manifest):  # exp_avg of gate would read as gate's values
        manifest["keys"][exp_avg_gate]["chunks"] = manifest["keys"]["gate"]["chunks"]

    def set_field(field, value):
        def edit(obj):
            obj[field] = value
        return edit

    def edited(edit):
        return lambda d: edit_manifest(d, edit)

    def offset_text(text):  # gate's first offset written as `text`
        def change(ckpt_dir):
            edit_manifest(ckpt_dir, edit_chunk(
                "gate", lambda c: c["offset"].__setitem__(0, LITERAL)))
            edit_raw_manifest(ckpt_dir, f'"{LITERAL}"', text)
        return change

    def add_key(name, shape):  # an empty F32 key: nothing to read, only the manifest to check
        return edited(lambda m: m["keys"].__setitem__(name, {"dtype": "F32", "shape": shape,
                                                              "chunks": []}))

    gate = ("manifest.json", "key 'gate'", "chunk 0")
    return [
        ("no common state", ("manifest.json", "exactly one of 'common' and 'common_file'"),
         edited(pop("common_file"))),
        ("common_file without bytes", ("manifest.json", "field 'common_file'",
                                       "missing field 'bytes'"),
         edited(lambda m: m["common_file"].pop("bytes"))),
        ("chunk without offset", gate + ("missing field 'offset'",),
         edited(edit_chunk("gate", pop("offset")))),
        ("offset of strings", gate + ("field 'offset'[0]", "found a string"),
         edited(edit_chunk("gate", set_field("offset", ["0"])))),
        ("chunk file a number", gate + ("field 'file': expected a string",),
         edited(edit_chunk("gate", set_field("file", 5)))),
        ("key entry a list", ("manifest.json", "key 'gate': expected a JSON object"),
         edited(lambda m: m["keys"].__setitem__("gate", [1]))),
        ("two keys share a stored tensor",
         ("manifest.json", f"key '{exp_avg_gate}'", "already used by another chunk"),
         edited(share_gate_chunks)),
        ("version true", ("manifest.json", "field 'version'", "found a boolean"),
         edited(set_field("version", True))),
        ("version 1 with block checksums", ("manifest.json", "unknown field 'block_bytes'"),
         edited(set_field("version", 1))),
        ("unknown chunk field", gate + ("unknown field 'extra'",),
         edited(edit_chunk("gate", set_field("extra", 1)))),
        ("wrong bytes", gate + ("field 'bytes' is 5",),
         edited(edit_chunk("gate", set_field("bytes", 5)))),
        ("file name with a space", ("manifest.json", "field 'file'", "'data 0.safetensors'"),
         lambda d: rename_data_files(d, "data 0.safetensors")),
        ("block checksum missing", gate + ("field 'block_xxh3' has 0 checksums",),
         edited(edit_chunk("gate", set_field("block_xxh3", [])))),
        ("duplicate member", ("manifest.json", "duplicate member 'format'"),
         lambda d: edit_raw_manifest(d, '"format":', '"format": 1, "format":')),
        ("number beyond double", ("manifest.json", "1e400"),
         lambda d: edit_raw_manifest(d, '"sequence": 1', '"sequence": 1e400')),
        # nlohmann holds -0 as a signed integer: not an offset, though Python's 0 would be.
        ("offset -0", gate + ("field 'offset'[0]", "found a negative integer"), offset_text("-0")),
        # mixprec multiplies the element size by each dimension in turn, refusing the count once
        # past 2^63 - 1: 4 * 2^61 is, though the trailing 0 makes the whole product 0.
        ("shape past 2^63 bytes before a 0", ("manifest.json", "key 'empty'", "global shape"),
         add_key("empty", [1 << 61, 0])),
        # json.dump writes the lone surrogate as the escape "\ud800", which nlohmann refuses.
        ("lone surrogate in a key name", ("manifest.json", "lone surrogate U+D800"),
         add_key("empty\ud800", [0])),
    ]


def latest_cases(name):
    """`latest` contents mixprec refuses (latest.cpp: a name and exactly one newline), for the
    checkpoint `name`."""
    cases = [
        ("latest without its newline", f"{name}", "followed by a newline"),
        ("latest with a leading space", f" {name}\n", f"' {name}'"),
        ("latest with two newlines", f"{name}\n\n", f"'{name}\\n'"),
        ("latest with CRLF", f"{name}\r\n", f"'{name}\\r'"),
        ("latest naming the lock", "lock\n", "'lock'"),
    ]
    return [(what, ("latest", fragment), lambda r, c=content: write_latest(r, c.encode()))
            for what, content, fragment in cases]


def edit_common(edit, literal=None):
    """A change applying edit(common) to common.json (with `literal`, the LITERAL it placed is
    then written as that JSON text), the manifest's record of the file's size kept in step."""
    def change(ckpt_dir):
        path = os.path.join(ckpt_dir, "common.json")
        with open(path) as f:
            common = json.load(f)
        edit(common)
        text = json.dumps(common)
        if literal is not None:
            assert f'"{LITERAL}"' in text
            text = text.replace(f'"{LITERAL}"', literal, 1)
        with open(path, "w") as f:
            f.write(text)
        # The manifest records the common file's size (and checksum, which this reader does not
        # verify): the edited state is one a writer could have produced.
        size = os.path.getsize(path)
        edit_manifest(ckpt_dir, lambda manifest: manifest["common_file"].__setitem__("bytes", size))
    return change


def edit_common_optimizer(edit):
    """A change applying edit(optimizer) to common.json's "optimizer" object."""
    return edit_common(lambda common: edit(common[mr.COMMON_OPTIMIZER]))


def set_user(value):
    """A change setting common.json's user data "x" to `value`."""
    return lambda common: common.setdefault(mr.COMMON_USER, {}).__setitem__("x", value)


def common_cases():
    """Common states mixprec's parser refuses (strict_json.h), each with what the error names."""
    return [
        ("lone surrogate in user data", ("common.json", "lone surrogate U+DC00"),
         edit_common(set_user("\udc00"))),
        # An integer beyond int64 or uint64 nlohmann takes as a double: this one overflows it.
        ("integer beyond double in user data", ("common.json", "out of range"),
         edit_common(set_user(10 ** 400))),
    ]


def optimizer_cases():
    """Malformed optimizer fields of the common state: torch_optimizer_state_dict names them."""
    def set_field(field, value):
        return lambda opt: opt.__setitem__(field, value)
    return [
        ("optimizer without param groups", ("common state 'optimizer'", "no field 'param_groups'"),
         edit_common_optimizer(lambda opt: opt.pop(mr.PARAM_GROUPS))),
        ("optimizer step a string", ("field 'step' must be an integer",),
         edit_common_optimizer(set_field(mr.STEP, "3"))),
        ("optimizer step negative", ("field 'step' must be an integer in [0, 2^63)",),
         edit_common_optimizer(set_field(mr.STEP, -1))),
        ("optimizer step past int64", ("field 'step' must be an integer in [0, 2^63)",),
         edit_common_optimizer(set_field(mr.STEP, 2 ** 63))),
        ("optimizer steps negative", ("field 'steps.gate' must be an integer in [0, 2^63)",),
         edit_common_optimizer(set_field(mr.STEPS, {"gate": -2}))),
        ("optimizer group without params", ("param_groups[0] must be an object with 'params'",),
         edit_common_optimizer(lambda opt: opt[mr.PARAM_GROUPS][0].pop(mr.PARAMS))),
        ("optimizer frozen not a list", ("field 'frozen' must be a list of names",),
         edit_common_optimizer(set_field(mr.FROZEN, 5))),
        ("optimizer steps of strings", ("field 'steps.gate' must be an integer",),
         edit_common_optimizer(set_field(mr.STEPS, {"gate": "2"}))),
    ] + [  # hyper-parameters mixprec refuses to load (algorithm_traits.cpp, step_args.cpp)
        (f"optimizer group {field} {value!r}", ("param_groups[0]", fragment),
         edit_common_optimizer(lambda opt, f=field, v=value: (
             opt[mr.PARAM_GROUPS][0].pop(f) if v is None else
             opt[mr.PARAM_GROUPS][0].__setitem__(f, v))))
        for field, value, fragment in [
            ("betas", 0.9, "hyper-parameter 'betas' missing or not two numbers"),
            ("lr", "0.01", "hyper-parameter 'lr' missing or not a number"),
            ("amsgrad", None, "hyper-parameter 'amsgrad' missing or not a boolean"),
            ("eps", True, "hyper-parameter 'eps' missing or not a number"),
            ("maximize", True, "maximize must be false"),
            ("betas", [0.9, 1], "hyper-parameter 'betas[1]' is 1"),
            ("weight_decay", -0.5, "hyper-parameter 'weight_decay' is -0.5"),
        ]
    ]


def accepted_cases(common):
    """Changes mixprec's parser accepts (nlohmann): the reader must read the copy as well."""
    def bom_common(ckpt_dir):
        prefix_bom(os.path.join(ckpt_dir, "common.json"))
        size = os.path.getsize(os.path.join(ckpt_dir, "common.json"))
        edit_manifest(ckpt_dir, lambda manifest: manifest["common_file"].__setitem__("bytes", size))

    cases = [
        ("manifest after a UTF-8 BOM", lambda d: prefix_bom(os.path.join(d, "manifest.json"))),
        # Near the refusals above, on the side mixprec accepts.
        ("shape with a 0 before 2^61", lambda d: edit_manifest(
            d, lambda m: m["keys"].__setitem__("empty", {"dtype": "F32", "shape": [0, 1 << 61],
                                                         "chunks": []}))),
    ]
    if common:
        cases += [
            ("common state after a UTF-8 BOM", bom_common),
            ("-0 in user data", edit_common(set_user(LITERAL), "-0")),
            ("2^64 in user data (a double to nlohmann)", edit_common(set_user(1 << 64))),
            ("escaped surrogate pair in user data", edit_common(set_user("\U0001f600"))),
        ]
    return cases


def main():
    good, scratch = sys.argv[1], sys.argv[2]
    root, name = os.path.split(os.path.normpath(good))
    with open(os.path.join(root, "latest"), "rb") as f:
        assert f.read() == name.encode() + b"\n", f"{root}/latest does not name {name}"
    common = os.path.join(good, "common.json")
    with open(os.path.join(good, "manifest.json")) as f:
        manifest = json.load(f)
    assert "common_file" in manifest and "gate" in manifest["keys"], "not the expected checkpoint"
    exp_avg_gate = mr.optimizer_state_key(mr.EXP_AVG, "gate")
    assert exp_avg_gate in manifest["keys"], "not the expected checkpoint"
    cases = [
        ("data file is a FIFO", "data-", lambda d: to_fifo(first_data_file(d))),
        ("data file is a link", "data-", link_data_file),
        ("data file truncated", "data-", lambda d: truncate(first_data_file(d), 100)),
        ("manifest truncated", "manifest.json",
         lambda d: truncate(os.path.join(d, "manifest.json"), 40)),
        ("manifest is a FIFO", "manifest.json",
         lambda d: to_fifo(os.path.join(d, "manifest.json"))),
        ("manifest claims a huge shape", "manifest.json",
         lambda d: edit_manifest(d, claim_huge_shape)),
        ("manifest claims a huge chunk", "data-",
         lambda d: edit_manifest(d, claim_huge_chunk)),
    ]
    if os.path.exists(common):
        cases.append(("common state is a FIFO", "common.json",
                      lambda d: to_fifo(os.path.join(d, "common.json"))))
    cases += manifest_cases(exp_avg_gate)
    if os.path.exists(common):
        cases += common_cases() + optimizer_cases()
    cases = [(what, (named,) if isinstance(named, str) else named, change, False)
             for what, named, change in cases]
    cases += [(what, named, change, True) for what, named, change in latest_cases(name)]
    # None: the copy must be read without an error.
    cases += [(what, None, change, False)
              for what, change in accepted_cases(os.path.exists(common))]
    for i, (what, named, change, of_root) in enumerate(cases):
        copy = damaged(scratch, root if of_root else good, f"case{i}", change)
        try:
            ckpt = mr.Checkpoint(copy)
            ckpt.tensors()
            ckpt.torch_optimizer_state_dict()  # the common state's optimizer, read as torch's
        except mr.CheckpointError as e:
            message = str(e)
            if named is None:
                sys.exit(f"{what}: refused, though mixprec reads it: {message}")
            missing = [n for n in named if n not in message]
            if copy not in message or missing:
                sys.exit(f"{what}: the error does not name {missing} in {copy}: {message}")
        except Exception as e:  # noqa: BLE001 - the point is that none other escapes
            sys.exit(f"{what}: {type(e).__name__} instead of CheckpointError: {e}")
        else:
            if named is not None:
                sys.exit(f"{what}: read without an error")
    print(f"ok {len(cases)}")


if __name__ == "__main__":
    main()
