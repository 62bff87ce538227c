"""What ``shmgrad bench`` reports: the issue's targets checked on the measurements, the
Markdown tables, the plots, and the JSON-safe form of the records."""

import math

from .collectives import ARENA, OPS, fmt_size, systems_of

LABELS = {
    "single-1t": "single process, 1 thread",
    "single": "single process, N threads",
    "shmgrad": "shmgrad, N workers",
    "eager": "shmgrad eager, N workers",
    "auto": 'shmgrad, workers="auto" over N cores',
    "eager-auto": 'shmgrad eager, workers="auto" over N cores',
    "compiled": "shmgrad eager, torch.compile'd, N workers",
    "bf16": "shmgrad eager, bfloat16 autocast, N workers",
    "ddp": "DDP gloo, N processes",
    "ddp-shmgrad": "DDP over the shmgrad backend, N processes",
    "dask": "Dask deep-copy, N threads",
    "shmgrad-paired": "shmgrad, N workers, in turn with DDP",
    "eager-paired": "shmgrad eager, N workers, in turn with DDP",
    "ddp-paired": "DDP gloo, N processes, in turn with shmgrad",
    "ddp-shmgrad-paired": "DDP over the shmgrad backend, N processes, in turn with DDP gloo",
    "single-paired": 'single process, N threads, in turn with workers="auto"',
    "auto-paired": 'shmgrad, workers="auto" over N cores, in turn with the single process',
    "eager-auto-paired": 'shmgrad eager, workers="auto", in turn with the single process',
}


# -- targets (issue 5) ----------------------------------------------------------------
# The paired engine records' targets: (the baseline, what the target says, whether a tie
# meets it).
_AGAINST_DDP = ("ddp", "faster than ddp, paired (median of the per-step ratios)", False)
_AGAINST_SINGLE = (
    "single",
    "at least as fast as one process with N threads, paired (median of the ratios of the "
    "blocks' medians)",
    True,
)
PAIRED_TARGETS = {
    "shmgrad-paired": _AGAINST_DDP,
    "eager-paired": _AGAINST_DDP,
    "auto-paired": _AGAINST_SINGLE,
    "eager-auto-paired": _AGAINST_SINGLE,
}


def evaluate_targets(records, reductions):
    """The issue's targets, checked on what was measured: a list of dicts."""
    out = []
    for r in records:
        if (
            r["system"] == "shmgrad"
            and "overhead_median" in r
            and r["model"] in ("cnn", "wrn")
            and r["batch"] == 128
        ):
            out.append(
                {
                    "target": "shmgrad overhead < 5% (CNN, WRN at batch 128)",
                    "config": f"{r['model']} b{r['batch']} N={r['workers']}",
                    "value": f"{r['overhead_median'] * 100:.1f}%",
                    "met": r["overhead_median"] < 0.05,
                }
            )
    for r in reductions:
        if "ratio" in r:
            out.append(
                {
                    "target": "reduction > 70% of memcpy bandwidth",
                    "config": f"N={r['workers']} P={r['floats']}",
                    "value": f"{r['reduce_gbps_median']:.1f} vs {r['memcpy_gbps_median']:.1f} "
                    f"GB/s = {r['ratio'] * 100:.0f}%",
                    "met": r["ratio"] > 0.70,
                }
            )
    memcpy = {
        (r["workers"], r["floats"]): r["memcpy_gbps_median"]
        for r in reductions
        if "memcpy_gbps_median" in r
    }
    for r in records:
        bw = memcpy.get((r["workers"], r["params"]))
        if r["system"] == "shmgrad" and "reduce_phase_gbps" in r and bw:
            r["reduce_phase_vs_memcpy"] = r["reduce_phase_gbps"] / bw
            out.append(
                {
                    "target": "engine's reduce phase (GradientStats.reduce_seconds) > 70% "
                    "of memcpy bandwidth",
                    "config": f"{r['model']} b{r['batch']} N={r['workers']} P={r['params']}",
                    "value": f"{r['reduce_phase_gbps']:.1f} vs {bw:.1f} GB/s = "
                    f"{r['reduce_phase_vs_memcpy'] * 100:.0f}%",
                    "met": r["reduce_phase_vs_memcpy"] > 0.70,
                }
            )
    for r in records:
        if (
            r["system"] == "eager"
            and "overhead_median" in r
            and r["model"] == "cnn"
            and r["batch"] == 128
        ):
            out.append(
                {
                    "target": "eager workers: engine's share of the step < 5% (CNN, batch 128)",
                    "config": f"{r['model']} b{r['batch']} N={r['workers']}",
                    "value": f"{r['overhead_median'] * 100:.1f}%",
                    "met": r["overhead_median"] < 0.05,
                }
            )
        if (
            r["system"] == "ddp"
            and "ratio_to_eager" in r
            and r["model"] in ("cnn", "wrn")
            and r["batch"] >= 128
            and r["workers"] == 2
        ):
            out.append(
                {
                    "target": "eager workers no slower than DDP-gloo (CNN, WRN, batch >= 128, N=2)",
                    "config": f"{r['model']} b{r['batch']} N={r['workers']}",
                    "value": f"ddp/eager = {r['ratio_to_eager']:.3f}x",
                    "met": r["ratio_to_eager"] >= 1.0,
                }
            )
    for r in records:
        target = PAIRED_TARGETS.get(r["system"])
        if target is not None and "paired_ratio_median" in r:
            bar, words, tie_meets = target
            name, ratio = r["system"][: -len("-paired")], r["paired_ratio_median"]
            out.append(
                {
                    "target": f"{name} {words}",
                    "config": f"{r['model']} b{r['batch']} N={r['workers']}",
                    "value": f"{bar}/{name} = {ratio:.3f}x",
                    "met": ratio >= 1.0 if tie_meets else ratio > 1.0,
                }
            )
    for r in records:
        if r["system"] in ("ddp", "dask") and "ratio_to_shmgrad" in r:
            out.append(
                {
                    "target": f"shmgrad faster than {r['system']}",
                    "config": f"{r['model']} b{r['batch']} N={r['workers']}",
                    "value": f"{r['system']}/shmgrad = {r['ratio_to_shmgrad']:.3f}x",
                    "met": r["ratio_to_shmgrad"] > 1.0,
                }
            )
    return out


def evaluate_node_targets(records):
    """--nodes: shmgrad's nodes (one worker each) no slower than DDP with as many ranks."""
    out = []
    for r in records:
        paired = r["system"] == "ddp-paired"
        for workers, ratio in r.get("ratio_to_nodes", {}).items():
            if workers != "1":
                continue
            out.append(
                {
                    "target": f"{r['nodes']} shmgrad nodes of 1 worker no slower than "
                    f"DDP-gloo with {r['nodes']} ranks",
                    "config": f"{r['model']} b{r['batch']}" + (", paired" if paired else ""),
                    "value": f"ddp/shmgrad-nodes = {ratio:.3f}x"
                    + (
                        f" (per-step ratios: median {r['paired_ratio_median']:.3f}x)"
                        if paired
                        else ""
                    ),
                    "met": ratio >= 1.0,
                }
            )
    return out


# -- reporting ------------------------------------------------------------------------
def fmt_ms(s):
    return "-" if s is None else (f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.1f}")


def table(records, reductions, targets):
    """The results as Markdown tables."""
    lines = [
        "| model | batch | N | system | median ms | min ms | max ms | IQR ms | steps "
        "| vs shmgrad | notes |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    order = {
        "single-1t": 0,
        "single": 1,
        "shmgrad": 2,
        "eager": 3,
        "auto": 3.1,
        "eager-auto": 3.2,
        "compiled": 4,
        "bf16": 5,
        "ddp": 6,
        "ddp-shmgrad": 7,
        "dask": 8,
        "shmgrad-paired": 9,
        "eager-paired": 10,
        "ddp-paired": 11,
        "ddp-shmgrad-paired": 12,
        "single-paired": 13,
        "auto-paired": 14,
        "eager-auto-paired": 15,
    }
    rows = sorted(
        records, key=lambda r: (r["model"], r["batch"], r["workers"], order.get(r["system"], 9))
    )
    seen_1t = set()
    for r in rows:
        key = (r["model"], r["batch"])
        if r["system"] == "single-1t":
            if key in seen_1t:
                continue
            seen_1t.add(key)
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['batch']} | {r['workers']} | {r['system']} | "
                f"FAILED | | | | | | {r['error'][:80]} |"
            )
            continue
        if r["system"] == "single-1t":
            by_n = r.get("ratio_to_shmgrad_by_n", {})
            ratio = ", ".join(f"N={n}: {v:.2f}x" for n, v in by_n.items()) or "-"
        else:
            ratio = f"{r['ratio_to_shmgrad']:.2f}x" if "ratio_to_shmgrad" in r else "-"
        notes = []
        if "placement" in r:
            where, threads = r["placement"].split("x")
            placed = (
                f"in the trainer, {threads}"
                if where == "trainer"
                else f"{where} workers x {threads}"
            )
            notes.append(
                f"placed {placed} threads (probe {r['probe_steps']} steps, {r['probe_s']:.1f} s)"
            )
        if "best_baseline_over_this" in r:
            notes.append(f"{r['best_baseline']} / this {r['best_baseline_over_this']:.2f}x")
        if r["system"] in ("shmgrad", "eager", "auto", "eager-auto", "compiled", "bf16"):
            notes.append(f"overhead {r['overhead_median'] * 100:.1f}%")
            notes.append(f"slowest worker f+b {fmt_ms(r['compute_max_median_s'])} ms")
            gbps = r.get("reduce_phase_gbps")
            notes.append(
                f"reduce phase {fmt_ms(r['reduce_median_s'])} ms "
                + (f"({gbps:.1f} GB/s)" if gbps is not None else "(one worker: no sums)")
            )
        if r["system"] in ("shmgrad-paired", "eager-paired"):
            notes.append(f"overhead {r['overhead_median'] * 100:.1f}%")
            notes.append(f"slowest worker f+b {fmt_ms(r['compute_max_median_s'])} ms")
            notes.append(f"per-step DDP / this: median {r['paired_ratio_median']:.3f}x")
        if r["system"] == "ddp-shmgrad-paired":
            notes.append("in turn with ddp-paired in the same ranks")
            notes.append(f"per-step DDP-gloo / this: median {r['paired_ratio_median']:.3f}x")
        if r["system"] == "ddp-paired":
            notes.append("in turn with the other -paired systems, step by step")
        if r["system"] in ("auto-paired", "eager-auto-paired"):
            notes.append(f"per-step single / this: median {r['paired_ratio_median']:.3f}x")
        if r["system"] == "single-paired":
            notes.append("in turn with the auto engines, step by step")
        if r["system"] in ("single", "single-1t"):
            notes.append(f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}")
        if "ratio_to_ddp" in r:
            notes.append(f"vs ddp {r['ratio_to_ddp']:.2f}x")
        if "ratio_to_eager" in r:
            notes.append(f"vs eager {r['ratio_to_eager']:.2f}x")
        if r.get("grad_rel_err") is not None and r["system"] != "single-1t":
            notes.append(f"grad rel. diff {r['grad_rel_err']:.1e}")
        iqr = r["q3_s"] - r["q1_s"]
        lines.append(
            f"| {r['model']} | {r['batch']} | "
            f"{r['workers'] if r['system'] != 'single-1t' else '-'} "
            f"| {r['system']} | {fmt_ms(r['median_s'])} | {fmt_ms(r['min_s'])} | "
            f"{fmt_ms(r['max_s'])} | {fmt_ms(iqr)} | {r['n']} | {ratio} | {'; '.join(notes)} |"
        )
    if reductions:
        lines += [
            "",
            "| reduce N | floats P | reduce GB/s (median) | min-max | memcpy GB/s "
            "(median) | min-max | reduce/memcpy |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in reductions:
            if "error" in r:
                lines.append(
                    f"| {r['workers']} | {r['floats']} | FAILED | | | | {r['error'][:60]} |"
                )
                continue
            lines.append(
                f"| {r['workers']} | {r['floats']} | {r['reduce_gbps_median']:.2f} | "
                f"{r['reduce_gbps_min']:.1f}-{r['reduce_gbps_max']:.1f} | "
                f"{r['memcpy_gbps_median']:.2f} | {r['memcpy_gbps_min']:.1f}-"
                f"{r['memcpy_gbps_max']:.1f} | {r['ratio'] * 100:.0f}% |"
            )
    return "\n".join(lines + targets_table(targets)) + "\n"


def targets_table(targets):
    """The evaluated targets as Markdown lines (none without targets)."""
    if not targets:
        return []
    lines = ["", "| target | configuration | measured | met |", "|---|---|---|---|"]
    for t in targets:
        lines.append(
            f"| {t['target']} | {t['config']} | {t['value']} | {'yes' if t['met'] else 'NO'} |"
        )
    return lines


def fmt_bytes(b):
    return "-" if b is None else f"{b / 1e3:,.1f} kB"


def nodes_table(records, targets):
    """--nodes: the results as Markdown tables."""
    lines = [
        "| model | batch | system | workers | median ms | min ms | max ms | IQR ms | steps "
        "| DDP / this | all-reduce share | all-reduce ms | sent per node per step "
        "(ring) | loopback per node per step | notes |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    order = {
        "single-1t": 0,
        "shmgrad": 1,
        "shmgrad-nodes": 2,
        "ddp": 3,
        "shmgrad-nodes-paired": 4,
        "ddp-paired": 5,
    }
    ddp = {(r["model"], r["batch"]): r for r in records if r["system"] == "ddp" and "median_s" in r}
    ddp_paired = {
        (r["model"], r["batch"], r["workers"]): r
        for r in records
        if r["system"] == "ddp-paired" and "median_s" in r
    }
    for r in sorted(
        records, key=lambda r: (r["model"], r["batch"], order.get(r["system"], 9), r["workers"])
    ):
        system = r["system"]
        workers = (
            f"{r['workers']} per node x {r['nodes']}"
            if system.startswith("shmgrad-nodes")
            else f"{r['nodes']} ranks"
            if system.startswith("ddp")
            else str(r["workers"])
        )
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['batch']} | {system} | {workers} | FAILED | | | "
                f"| | | | | | | {r['error'][:80]} |"
            )
            continue
        d = (
            ddp_paired.get((r["model"], r["batch"], r["workers"]))
            if system.endswith("-paired")
            else ddp.get((r["model"], r["batch"]))
        )
        ratio = f"{d['median_s'] / r['median_s']:.2f}x" if d is not None else "-"
        notes = []
        if system == "ddp-paired":
            notes.append(f"run in turn with shmgrad-nodes-paired of {r['workers']} per node")
        if system == "shmgrad-nodes-paired" and d is not None:
            notes.append(
                f"run in turn with ddp-paired; per-step DDP / shmgrad: median "
                f"{d['paired_ratio_median']:.3f}x"
            )
        if r.get("grad_rel_err") is not None and system != "single-1t":
            notes.append(f"grad rel. diff {r['grad_rel_err']:.1e}")
        if system.startswith("shmgrad-nodes"):
            notes.append(
                f"slowest worker f+b {fmt_ms(r['compute_max_median_s'])} ms; "
                f"all-reduced {fmt_bytes(r['allreduce_bytes'])} a step"
            )
        share = (
            f"{r['allreduce_share_median'] * 100:.1f}%" if "allreduce_share_median" in r else "-"
        )
        lines.append(
            f"| {r['model']} | {r['batch']} | {system} | {workers} | {fmt_ms(r['median_s'])} "
            f"| {fmt_ms(r['min_s'])} | {fmt_ms(r['max_s'])} | {fmt_ms(r['q3_s'] - r['q1_s'])} "
            f"| {r['n']} | {ratio} | {share} | {fmt_ms(r.get('allreduce_median_s'))} "
            f"| {fmt_bytes(r.get('sent_bytes_per_node_step'))} "
            f"| {fmt_bytes(r.get('loopback_bytes_per_node_step'))} | {'; '.join(notes)} |"
        )
    return "\n".join(lines + targets_table(targets)) + "\n"


def fmt_us(s):
    """Seconds as microseconds, three significant figures below 100 us."""
    us = s * 1e6
    return f"{us:,.0f}" if us >= 100 else f"{us:.3g}"


def collectives_table(records, runs):
    """--collectives: the results as Markdown (bench/collectives.py defines each figure)."""
    lines = [
        "Collectives, float32, SUM, gloo and shmgrad in the same processes, taking turns. "
        "us: the median over samples of k back-to-back calls (first rank's start to last "
        "rank's end, over k). GB/s: the size (the larger per-rank buffer) over that time. "
        "bound: the bytes each rank moves in shmgrad's algorithm (all_reduce (5 + 1/W) n, "
        "all_gather (2 + 2/W) n, reduce_scatter (3 + 1/W) n) at the copy bandwidth per "
        "rank with every rank copying at once (below); under 1x where the data stays in "
        "the caches. arena: all_reduce of a tensor the shmgrad group allocated in its arena "
        "(allocate_tensor, as DDP's buckets), reduced in place; its bound counts "
        "(3 - 1/W) n.",
        "",
    ]
    for run in runs:
        if "error" in run:
            lines.append(f"- {run['ranks']} ranks: FAILED ({run['error'][:200]})")
            continue
        c = run["copy"]
        lines.append(
            f"- {run['ranks']} ranks ({run['seconds']:.0f} s): copy bandwidth per rank, "
            f"every rank copying {fmt_size(c['bytes'])} at once: {c['all_gbps']:.2f} GB/s "
            f"read and written; one process alone: {c['alone_gbps']:.2f} GB/s"
        )
    lines += [
        "",
        "| collective | W | size | gloo us | shmgrad us | gloo GB/s | shmgrad GB/s "
        "| gloo / shmgrad | bound us | shmgrad / bound | arena us | gloo / arena "
        "| shmgrad / arena | arena / its bound | samples x calls (gloo; shmgrad) | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in sorted(records, key=lambda r: (OPS.index(r["collective"]), r["ranks"], r["size"])):
        g, s = r["gloo"], r["shmgrad"]
        wrong = [system for system in systems_of(r["collective"]) if not r[system]["correct"]]
        notes = f"WRONG RESULT: {', '.join(wrong)}" if wrong else ""
        if ARENA in r:
            arena = (
                f"{fmt_us(r[ARENA]['median_s'])} | {r['gloo_over_arena']:.2f}x | "
                f"{r['staged_over_arena']:.2f}x | {r['arena_over_bound']:.2f}x"
            )
        else:
            arena = "- | - | - | -"
        lines.append(
            f"| {r['collective']} | {r['ranks']} | {fmt_size(r['size'])} | "
            f"{fmt_us(g['median_s'])} | {fmt_us(s['median_s'])} | {g['gbps']:.3g} | "
            f"{s['gbps']:.3g} | {r['gloo_over_shmgrad']:.2f}x | {fmt_us(r['bound_s'])} | "
            f"{r['shmgrad_over_bound']:.2f}x | {arena} | "
            f"{g['n']} x {g['calls_per_sample']}; {s['n']} x {s['calls_per_sample']} | "
            f"{notes} |"
        )
    return "\n".join(lines) + "\n"


def plot_collectives(records, path):
    """--collectives: latency against size, one panel per collective; gloo, shmgrad and
    the bound for each rank count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPS), squeeze=False, figsize=(5.0 * len(OPS), 4.6))
    colors = {"gloo": "tab:green", "shmgrad": "tab:red", ARENA: "tab:purple", "bound": "tab:gray"}
    dashes = ["-", "--", ":", "-."]
    ranks = sorted({r["ranks"] for r in records})
    for ax, op in zip(axes[0], OPS):
        for i, w in enumerate(ranks):
            rs = sorted(
                (r for r in records if r["collective"] == op and r["ranks"] == w),
                key=lambda r: r["size"],
            )
            if not rs:
                continue
            xs = [r["size"] for r in rs]
            series = {
                system: [r[system]["median_s"] * 1e6 for r in rs] for system in systems_of(op)
            }
            series["bound"] = [r["bound_s"] * 1e6 for r in rs]
            for name, ys in series.items():
                ax.plot(
                    xs,
                    ys,
                    color=colors[name],
                    ls=dashes[i % len(dashes)],
                    marker="" if name == "bound" else "o",
                    ms=3,
                    label=f"{name}, W={w}",
                )
        ax.set_title(op)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size, bytes (per-rank buffer)")
        ax.set_ylabel("latency, us (median)")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))), fontsize=8)
    rows = math.ceil(len(labels) / 6) if labels else 1
    fig.tight_layout(rect=(0, 0.05 * rows + 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in records))
    batches = sorted(set(r["batch"] for r in records))
    width = max(9.0, 4.2 * len(batches))
    height = 3.4 * len(models) + 0.9
    fig, axes = plt.subplots(len(models), len(batches), squeeze=False, figsize=(width, height))
    styles = {
        "single-1t": ("tab:gray", "--", ""),
        "single": ("tab:blue", "-", "o"),
        "shmgrad": ("tab:red", "-", "s"),
        "eager": ("tab:orange", "-", "v"),
        "auto": ("tab:red", ":", "*"),
        "eager-auto": ("tab:orange", ":", "*"),
        "compiled": ("tab:brown", "-", "^"),
        "bf16": ("tab:pink", "-", "x"),
        "ddp": ("tab:green", "-", "^"),
        "ddp-shmgrad": ("tab:olive", "-", "P"),
        "dask": ("tab:purple", "-", "D"),
    }
    for i, m in enumerate(models):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            rs = [r for r in records if r["model"] == m and r["batch"] == b and "median_s" in r]
            ns = sorted(set(r["workers"] for r in rs if r["system"] != "single-1t"))
            for system, (color, ls, marker) in styles.items():
                pts = sorted((r["workers"], r) for r in rs if r["system"] == system)
                if system == "single-1t" and pts and ns:
                    r = pts[0][1]
                    ax.plot(
                        [ns[0], ns[-1]],
                        [r["median_s"] * 1e3] * 2,
                        color=color,
                        ls=ls,
                        label=LABELS[system],
                    )
                    continue
                if not pts:
                    continue
                xs = [n for n, _ in pts]
                ys = [r["median_s"] * 1e3 for _, r in pts]
                lo = [(r["median_s"] - r["min_s"]) * 1e3 for _, r in pts]
                hi = [(r["max_s"] - r["median_s"]) * 1e3 for _, r in pts]
                ax.errorbar(
                    xs,
                    ys,
                    yerr=[lo, hi],
                    color=color,
                    ls=ls,
                    marker=marker,
                    capsize=3,
                    label=LABELS[system],
                )
            ax.set_title(f"{m}, batch {b}")
            ax.set_xlabel("workers N")
            ax.set_ylabel("step time, ms (median, min-max)")
            ax.set_yscale("log")
            if ns:
                ax.set_xticks(ns)
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.75 / height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


EFFICIENCY_SYSTEMS = ("single", "shmgrad", "eager", "auto", "eager-auto", "ddp", "ddp-shmgrad")


def efficiency(records):
    """Parallel efficiency of each system at each N: one process with one thread's median
    over N times the system's (1: N cores give N times the speed), per model and batch:
    ``{(model, batch): {system: [(N, efficiency), ...]}}``."""
    base = {
        (r["model"], r["batch"]): r["median_s"]
        for r in records
        if r["system"] == "single-1t" and "median_s" in r
    }
    out = {}
    for r in records:
        key = (r["model"], r["batch"])
        if r["system"] in EFFICIENCY_SYSTEMS and key in base and "median_s" in r:
            eff = base[key] / (r["workers"] * r["median_s"])
            out.setdefault(key, {}).setdefault(r["system"], []).append((r["workers"], eff))
    for systems in out.values():
        for points in systems.values():
            points.sort()
    return out


def plot_efficiency(records, path):
    """The efficiency curves (efficiency()) as one panel per model and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = efficiency(records)
    if not curves:
        return False
    models = list(dict.fromkeys(m for m, _ in curves))
    batches = sorted({b for _, b in curves})
    fig, axes = plt.subplots(
        len(models),
        len(batches),
        squeeze=False,
        figsize=(4.2 * len(batches), 3.4 * len(models)),
    )
    for key in curves:
        ax = axes[models.index(key[0])][batches.index(key[1])]
        for system, points in curves[key].items():
            ax.plot(
                [n for n, _ in points],
                [e for _, e in points],
                marker="o",
                ls=":" if system.endswith("auto") else "-",
                label=LABELS.get(system, system),
            )
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{key[0]}, batch {key[1]}")
        ax.set_xlabel("cores N")
        ax.set_ylabel("efficiency: t(1 process, 1 thread) / (N t)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
