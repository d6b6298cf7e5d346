"""The hit-ratio curve drawn for a terminal (bars of text) or to a PNG (with matplotlib, if installed)."""

from __future__ import annotations

from collections.abc import Sequence

_FULL, _PARTS = "█", " ▁▂▃▄▅▆▇"


def ascii_bars(labels: Sequence[str], ratios: Sequence[float], height: int = 10) -> str:
    """One bar per point, the y axis in percent from 0 to the highest ratio rounded up to 10 %."""
    top = max(0.1, -(-max(ratios, default=0.0) * 10 // 1) / 10)
    width = max(6, max((len(x) for x in labels), default=0) + 1)
    lines = []
    for row in range(height, 0, -1):
        lo = top * (row - 1) / height
        cells = []
        for r in ratios:
            fill = (r - lo) / (top / height)
            ch = _FULL if fill >= 1 else _PARTS[int(max(0.0, fill) * 8)]
            cells.append((ch * 3).center(width))
        axis = f"{top * row / height * 100:5.0f}% |" if row in (height, height // 2) else "       |"
        lines.append(axis + "".join(cells).rstrip())
    lines.append("       +" + "-" * (width * len(ratios)))
    lines.append("        " + "".join(x.center(width) for x in labels) + "   L1 size")
    return "\n".join(lines)


def write_png(path: str, sizes_bytes: Sequence[int], ratios: Sequence[float], title: str) -> str:
    """Draw the curve to ``path``; '' on success, else why not (matplotlib is not a kvdepot dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--png needs matplotlib, which is not installed (pip install matplotlib); the table has the same curve"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s / (1 << 30) for s in sizes_bytes], [r * 100 for r in ratios], marker="o")
    ax.set_xscale("log")
    ax.set_xlabel("L1 size (GiB)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    finally:
        plt.close(fig)
    return ""
