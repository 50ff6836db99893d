"""Damaged copies of a good checkpoint, read with python/mixprec_reader.py: each one must end in
a CheckpointError that names the file at fault — never a hang, a foreign exception or an
allocation of what a manifest merely claims.

    python_reader_damaged.py CHECKPOINT SCRATCH    (prints "ok <cases>" and exits 0, or fails)
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
    shutil.copytree(good, copy)
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


def claim_huge_shape(manifest):
    key = next(k for k, e in manifest["keys"].items() if e["shape"])
    manifest["keys"][key]["shape"] = [100000, 100000]


def claim_huge_chunk(manifest):
    """Shape and chunk agree with each other, not with the stored tensor: 2^40 elements."""
    key = next(k for k, e in manifest["keys"].items() if len(e["chunks"]) == 1 and e["shape"])
    entry = manifest["keys"][key]
    entry["shape"] = [1 << 40] + [1] * (len(entry["shape"]) - 1)
    entry["chunks"][0]["shape"] = list(entry["shape"])


def link_data_file(ckpt_dir):
    data = first_data_file(ckpt_dir)
    os.rename(data, data + ".real")
    os.symlink(os.path.basename(data) + ".real", data)


def main():
    good, scratch = sys.argv[1], sys.argv[2]
    common = os.path.join(good, "common.json")
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
    for i, (what, named, change) in enumerate(cases):
        copy = damaged(scratch, good, f"case{i}", change)
        try:
            ckpt = mr.Checkpoint(copy)
            ckpt.tensors()
        except mr.CheckpointError as e:
            message = str(e)
            if copy not in message or named not in message:
                sys.exit(f"{what}: the error does not name {named} in {copy}: {message}")
        except Exception as e:  # noqa: BLE001 - the point is that none other escapes
            sys.exit(f"{what}: {type(e).__name__} instead of CheckpointError: {e}")
        else:
            sys.exit(f"{what}: read without an error")
    print(f"ok {len(cases)}")


if __name__ == "__main__":
    main()
