#!/usr/bin/env python3
"""Draw mixprec-train's loss curves as a PNG.

    scripts/plot_metrics.py METRICS.jsonl [-o OUT.png]

Reads the JSON-lines metrics file mixprec-train writes (fields documented in
examples/train/metrics.h) and draws training loss (and its moving average), validation loss,
and the loss scale on a second axis (constant 1 for BF16; FP16's dynamic scaler moves it).
Writes METRICS.png next to the input unless -o says otherwise. Needs matplotlib
(scripts/common.sh installs it into the project's venv); run it with that venv's python.
"""
import argparse
import json
import math
import sys
from pathlib import Path


def read_metrics(path):
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"plot_metrics: {path}:{number}: not JSON ({e.msg})")
    if not records:
        sys.exit(f"plot_metrics: {path} holds no metrics")
    for field in ("step", "loss", "val_loss", "loss_scale"):
        if field not in records[0]:
            sys.exit(f"plot_metrics: {path}: lines lack the field '{field}' (not mixprec-train metrics?)")
    return records


def moving_average(values, window):
    out, total, kept = [], 0.0, []
    for v in values:
        kept.append(v)
        total += v
        if len(kept) > window:
            total -= kept.pop(0)
        out.append(total / len(kept))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path)
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    if not args.metrics.is_file():
        sys.exit(f"plot_metrics: {args.metrics} does not exist")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_metrics: matplotlib is missing; run scripts/run-demo once (it installs it "
                 "into .venv) and use .venv/bin/python")

    records = read_metrics(args.metrics)
    finite = [(r["step"], r["loss"]) for r in records if r["loss"] is not None and math.isfinite(r["loss"])]
    steps = [s for s, _ in finite]
    losses = [v for _, v in finite]
    val = [(r["step"], r["val_loss"]) for r in records if r["val_loss"] is not None]
    scale = [(r["step"], r["loss_scale"]) for r in records]
    skipped = [r["step"] for r in records if r.get("skipped")]

    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    ax.plot(steps, losses, color="#9ecae1", linewidth=0.8, label="train loss")
    ax.plot(steps, moving_average(losses, max(1, len(losses) // 30)), color="#3182bd",
            linewidth=1.8, label="train loss (moving average)")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", color="#e6550d", linewidth=1.5,
                markersize=4, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.grid(alpha=0.3)

    right = ax.twinx()
    right.plot([s for s, _ in scale], [v for _, v in scale], color="#756bb1", linewidth=1,
               linestyle="--", label="loss scale")
    if skipped:
        right.plot(skipped, [dict(scale)[s] for s in skipped], "x", color="#756bb1",
                   label="skipped step")
    right.set_yscale("log", base=2)
    right.set_ylabel("loss scale")

    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper right", fontsize=9)
    ax.set_title(f"mixprec-train: {args.metrics.name}, {records[-1]['step']} steps")
    fig.tight_layout()
    output = args.output or args.metrics.with_suffix(".png")
    fig.savefig(output)
    print(output)


if __name__ == "__main__":
    main()
