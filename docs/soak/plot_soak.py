"""Plots a soak run's samples (``shmgrad stress --duration ... --soak-out RUN.json``).

    .venv/bin/python docs/soak/plot_soak.py RUN.json OUT.png

Five panels against the run's time: resident memory of the trainer, the coordinator and
the largest and smallest worker of each sample (workers are replaced after kills: a slot's
line would jump between processes); the same since each kind's warm-up ended, with the
bounds dashed; open file descriptors of each role; the engine's
files in /dev/shm (bytes allocated); the median engine step time of each interval, with
the probe time (a fixed forward and backward in the trainer) and the machine's one-minute
load. A dashed line marks where the engine of the next kind of worker starts, a shaded
span each kind's warm-up (not judged). Needs matplotlib (no other dependency).
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 1024.0  # rss_kib per MiB


def _series(samples, fn):
    xs, ys = [], []
    for s in samples:
        v = fn(s)
        if v is not None:
            xs.append(s["t"] / 60.0)
            ys.append(v)
    return xs, ys


def _workers(s, key, pick):
    vals = [p[key] for r, p in s["procs"].items() if r.startswith("worker")]
    return pick(vals) if vals else None


def plot(run, out):
    samples = run["samples"]
    kinds = list(dict.fromkeys(s["kind"] for s in samples))
    fig, axes = plt.subplots(5, 1, figsize=(9, 13), sharex=True)
    ax_rss, ax_grow, ax_fd, ax_shm, ax_t = axes
    for kind in kinds:
        ks = [s for s in samples if s["kind"] == kind]
        warm = max(1, int(len(ks) * run["bounds"]["warmup_fraction"] + 0.5))
        for ax in axes:
            ax.axvspan(
                ks[0]["t"] / 60.0, ks[min(warm, len(ks) - 1)]["t"] / 60.0, color="0.92", lw=0
            )
        if kind != kinds[0]:
            for ax in axes:
                ax.axvline(ks[0]["t"] / 60.0, color="0.5", ls="--", lw=0.8)
        label = f" ({kind})"
        first = kind == kinds[0]

        def line(ax, fn, color, name, samples=ks, **style):
            """One series of this kind's samples; named in the legend once."""
            ax.plot(
                *_series(samples, fn),
                color=color,
                label=name if first else None,
                **{"marker": ".", **style},
            )

        def worker_mib(pick):
            return lambda s: _workers(s, "rss_kib", pick) and _workers(s, "rss_kib", pick) / MIB

        for role, color in (("trainer", "C0"), ("coordinator", "C1")):
            line(
                ax_rss,
                lambda s: (
                    s["procs"].get(role, {}).get("rss_kib", None)
                    and s["procs"][role]["rss_kib"] / MIB
                ),
                color,
                role,
            )
            line(ax_fd, lambda s: s["procs"].get(role, {}).get("fds"), color, role)
        line(ax_rss, worker_mib(max), "C2", "largest worker")
        line(ax_rss, worker_mib(min), "C2", "smallest worker", ls=":", marker=None)
        # Growth since the warm-up's end, the quantity the bounds are on.
        base = ks[min(warm, len(ks) - 1)]
        for role, color in (("trainer", "C0"), ("coordinator", "C1")):
            b = base["procs"].get(role, {}).get("rss_kib")
            if b is not None:
                line(
                    ax_grow,
                    lambda s: role in s["procs"] and (s["procs"][role]["rss_kib"] - b) / MIB,
                    color,
                    role,
                    samples=ks[warm:],
                )
        bw = _workers(base, "rss_kib", max)
        if bw is not None:
            line(
                ax_grow,
                lambda s: _workers(s, "rss_kib", max) and (_workers(s, "rss_kib", max) - bw) / MIB,
                "C2",
                "largest worker",
                samples=ks[warm:],
            )
        line(ax_fd, lambda s: _workers(s, "fds", max), "C2", "workers (largest)")
        line(
            ax_shm,
            lambda s: s["shm_bytes"] / 2**20,
            "C3",
            "engine's /dev/shm files (MiB allocated)",
        )
        line(
            ax_t,
            lambda s: s["step_median_s"] and s["step_median_s"] * 1e3,
            "C0",
            "median step (ms)",
        )
        line(ax_t, lambda s: s.get("probe_s") and s["probe_s"] * 1e3, "C4", "probe (ms)")
        ax_rss.text(ks[0]["t"] / 60.0, 0.02, label, transform=ax_rss.get_xaxis_transform())
    if any(s.get("load1") is not None for s in samples):
        ax_load = ax_t.twinx()
        ax_load.plot(
            *_series(samples, lambda s: s.get("load1")),
            color="0.6",
            lw=0.8,
            label="1-min load (right)",
        )
        ax_load.set_ylabel("load average")
        ax_load.legend(loc="upper right", fontsize=8)
    for role, bound in run["bounds"]["rss_growth_mib"].items():
        ax_grow.axhline(bound, color="C0" if role == "trainer" else "C1", ls="--", lw=0.8)
    ax_grow.axhline(run["bounds"]["worker_rss_growth_mib"], color="C2", ls="--", lw=0.8)
    ax_grow.set_ylabel("resident MiB since warm-up\n(dashed: bounds)")
    ax_rss.set_ylabel("resident MiB")
    ax_rss.set_yscale("log")
    ax_fd.set_ylabel("open fds")
    ax_shm.set_ylabel("MiB")
    ax_t.set_ylabel("ms")
    ax_t.set_xlabel("minutes since start")
    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in (ax_rss, ax_grow, ax_fd, ax_shm):
        ax.legend(loc="upper left", fontsize=8)
    ax_t.legend(loc="upper left", fontsize=8)
    verdict = run.get("verdict", {})
    title = f"shmgrad stress soak, started {run.get('started_utc', '?')}: " + (
        "no growth beyond the bounds"
        if verdict.get("ok")
        else f"{len(verdict.get('findings', []))} finding(s)"
        if verdict
        else "no verdict (cut short)"
    )
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_soak.py RUN.json OUT.png")
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
