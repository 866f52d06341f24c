"""PNG of the training curves of a run (from its metrics.jsonl)."""

from __future__ import annotations

import os
from pathlib import Path

from logitless.trainer.report.metrics import read_metrics

# (title, metric keys drawn on that panel; a key ending in "*" stands for every logged key it begins); panels
# whose keys are all absent are skipped.
PANELS = [
    ("reward", ["reward/mean"]),
    ("accuracy", ["accuracy"]),
    ("held-out eval", ["eval/accuracy", "eval/pass@*"]),
    ("completion length", ["completion/length_mean", "completion/length_max"]),
    ("KL", ["kl"]),
    ("entropy", ["entropy"]),
    ("clip fraction", ["clip/fraction", "clip/low", "clip/high"]),
    ("grad norm", ["grad_norm"]),
    ("learning rate", ["learning_rate"]),
    ("rollout tokens/s", ["tokens_per_s"]),
    ("seconds per stage", ["time/generate", "time/score", "time/logprobs", "time/train"]),
]


def check_plot_output(out: Path, formats: dict[str, str]) -> None:
    """The image `out` can be written: its folder exists and matplotlib writes its format (from the suffix)."""
    folder = out.expanduser().resolve().parent
    if not folder.is_dir():
        raise ValueError(f"--output {str(out)!r}: the folder {folder} does not exist; create it (mkdir -p {folder}) "
                         "or choose another path")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--output {str(out)!r}: the folder {folder} is not writable; choose another path")
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in formats:
        what = f".{suffix} files" if suffix else "a file without a suffix"
        raise ValueError(f"--output {str(out)!r}: matplotlib cannot write {what}; end the name with one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the curves of `<run_dir>/metrics.jsonl` into `out` (default `<run_dir>/curves.png`; its folder and
    format are checked first); return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.backend_bases import FigureCanvasBase

    if out is not None:  # before anything is read or drawn
        check_plot_output(Path(out), FigureCanvasBase.get_supported_filetypes())
    out = Path(out) if out is not None else Path(run_dir) / "curves.png"
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} has no records yet; nothing to plot")
    logged = list(dict.fromkeys(k for r in records for k in r))
    expand = lambda k: [x for x in logged if x.startswith(k[:-1])] if k.endswith("*") else [k]  # noqa: E731
    panels = [(t, [k for key in keys for k in expand(key) if any(r.get(k) is not None for r in records)])
              for t, keys in PANELS]
    panels = [(t, keys) for t, keys in panels if keys]
    if not panels:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} has none of the plotted metrics")
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(10, 2.8 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        for k in keys:
            pts = [(r["step"], r[k]) for r in records if r.get(k) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=k, marker="." if len(pts) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
