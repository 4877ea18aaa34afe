"""The report's PNG plots: quality against TTFT speedup, and quality and fidelity against the recompute ratio."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .methods import parse_method


def plots(out: Path, slug: str, summary: dict, sweep: dict, ttft: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    # 1. quality vs TTFT speedup
    pts = [(m, 1 / ttft[m]["ratio"], summary[m]) for m in ttft if m in summary and ttft[m]["ratio"]]
    if pts:
        markers = "os^vDP*Xhp<>"
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
        for ax, key, label in ((axes[0], "score", "task score"), (axes[1], "top1", "top-1 agreement with full"),
                               (axes[2], "kl", "KL(full ‖ method), first token")):
            for i, (m, sp, s) in enumerate(pts):
                ax.scatter(sp, s[key], marker=markers[i % len(markers)], s=50, label=m)
            ax.set_xlabel("TTFT speedup vs full (×, same run)")
            ax.set_ylabel(label)
            if key == "kl":
                ax.set_yscale("symlog", linthresh=1e-3)
            ax.grid(alpha=0.3)
        axes[2].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle("quality vs time to first token")
        fig.tight_layout()
        name = f"{slug}_quality_vs_ttft.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)
    # 2./3. quality and fidelity vs recompute ratio (measured share of chunk tokens recomputed)
    data = sweep or summary
    if not data:
        return files
    fams: dict[str, list] = defaultdict(list)
    for m, s in data.items():
        fams[parse_method(m).family].append((s["recompute_frac"], s))
    for key_set, title, fname in (((("score", "task score"),), "task score vs recompute ratio", "score_vs_r"),
                                  ((("kl", "KL(full ‖ method), first token"), ("top1", "top-1 agreement")),
                                   "fidelity to full vs recompute ratio", "fidelity_vs_r")):
        fig, axes = plt.subplots(1, len(key_set), figsize=(5 * len(key_set), 4), squeeze=False)
        for ax, (key, label) in zip(axes[0], key_set):
            for fam, pts_ in sorted(fams.items()):
                pts_ = sorted(pts_, key=lambda p: p[0])
                xs, ys = [p[0] for p in pts_], [p[1][key] for p in pts_]
                if fam in ("full", "reuse"):
                    ax.axhline(ys[0], ls="--", lw=1, color="gray" if fam == "reuse" else "black", label=fam)
                else:
                    ax.plot(xs, ys, marker="o", label=fam)
            ax.set_xlabel("share of chunk tokens recomputed")
            ax.set_ylabel(label)
            if key == "kl":
                ax.set_yscale("symlog", linthresh=1e-3)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(title)
        fig.tight_layout()
        name = f"{slug}_{fname}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files
