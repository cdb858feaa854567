"""The engine suite's chart: model states and peak memory per rank (RSS on a CPU, CUDA max allocated on a
GPU), and throughput, by stage and system.

    python bench/run.py --stage 0,1,2,3 --model tiny --plot engine.png
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def plot(record: dict, path: str) -> None:
    stages = record["stages"]
    names = sorted({s["system"].replace(f" stage {st['stage']}", "") for st in stages for s in st["systems"]})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    peak = (("peak_cuda_bytes_per_rank", 2**30, "peak CUDA allocated per rank (GiB)") if record["device"] == "cuda"
            else ("peak_rss_bytes_per_rank", 2**20, "peak RSS per rank (MiB)"))
    panels = [("model_state_bytes_per_rank", 2**20, "model states per rank (MiB)"), peak,
              ("tokens_per_s", 1, "throughput (tokens/s, all ranks)")]
    width = 0.8 / max(1, len(names))
    for ax, (key, scale, title) in zip(axes, panels):
        for i, name in enumerate(names):
            xs, ys = [], []
            for j, st in enumerate(stages):
                for s in st["systems"]:
                    # a figure a system could not be measured on (DeepSpeed's model states) is left out
                    if s["system"].replace(f" stage {st['stage']}", "") == name and s[key] is not None:
                        xs.append(j + i * width)
                        ys.append(s[key] / scale)
            ax.bar(xs, ys, width, label=name, color=f"C{i}")  # one colour per system in every panel
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(stages))])
        ax.set_xticklabels([f"stage {st['stage']}" for st in stages])
        ax.set_title(title)
    # throughput has every system (model states may lack one that cannot be measured); below the panels, where
    # it hides no bar
    handles, labels = axes[2].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(names), frameon=False)
    fig.suptitle(f"zkern engine suite: {record['model']} ({record['num_params'] / 1e6:.2f}M params), world "
                 f"{record['world']}, {record['precision']}, {record['device_name']}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
