"""The soak mode of ``shmgrad stress`` (``--duration``): steps under faults until the time
is up, sampling every ``--sample-every`` seconds what a leak would make grow, then a
growth check over the samples.

A sample records, for each process of the run by its *role*:

* ``trainer``: this process (the stress run's trainer; the child trainers it starts and
  kills live for a second and are not sampled);
* ``coordinator``: the engine's coordinator (``status().coordinator_pid``);
* ``worker<slot>``: the worker in each slot. Workers are killed and replaced all the
  time, so a slot's series runs over several processes: each point carries its pid.

and per role the resident memory (``VmRSS`` of ``/proc/PID/status``) and the open file
descriptors (``/proc/PID/fd``); then the engine's files in /dev/shm (count and bytes
allocated), /dev/shm as a whole (used bytes: other users' files included, so only
shown), and the median time of the engine's gradient calls since the previous sample.

:func:`check_growth` is the verdict, a pure function over the samples (see its
docstring and docs/RELIABILITY.md for the bounds and why).
"""

import dataclasses
import glob
import json
import os
import re
import statistics
import time
from typing import Dict, List, Optional

# -- the bounds (docs/RELIABILITY.md says why these values) -------------------------------
# Resident memory a long-lived process (the trainer, the coordinator) may gain between
# the warm-up's end and the end of a run, compared window to window.
RSS_GROWTH_MIB = {"trainer": 48.0, "coordinator": 16.0}
# A worker slot: its process at the end may hold at most this much more than the largest
# worker of the first window (a replacement starts afresh, so a slot's series only shows
# a leak that outlives the worker, or one fast enough to show within a worker's life).
WORKER_RSS_GROWTH_MIB = 32.0
# File descriptors: none may stay open for good (windowed, so a pipe open for a moment
# while a worker is replaced does not count).
FD_GROWTH = 0
# The median step time of the last window against the first, each divided by the probe's
# median time over its interval (a fixed single-threaded computation in the trainer: what
# the machine's load does to one process's share of a core, as the engine's workers
# compute in one thread each), so that other users' load does not count as drift; a
# doubling is the bound (a leak that slows steps grows without end). The probe is pure
# Python, not torch: torch's intra-op threads spin for their peers, and on an
# oversubscribed machine a forward and backward took 10 times a step, not a core's share.
STEP_TIME_DRIFT = 1.0  # +100 %
# A sample's median step time is judged only over at least this many steps: a median of
# a few steps, some of them re-run after a kill, moves past the bound with no leak (the
# 20-s CI run, samples every 2 s, about 8 steps each: +144 %).
STEP_TIME_MIN_STEPS = 20
PROBE_LOOP = 100_000  # iterations of the probe's loop (about 5 ms on an idle core)
# The probe runs once every PROBE_EVERY_STEPS steps, so that its median over an interval
# sees the same moments of load as the steps' median (one probe at the sample would see
# one moment: on a loaded machine, 88 ms and 697 ms a minute apart).
PROBE_EVERY_STEPS = 5
PROBE_REPEATS = 5  # a sample with no probe in its interval times this many at once
# The share of each run's samples treated as warm-up (caches, allocator pools filling).
WARMUP_FRACTION = 0.2
# Samples per comparison window (each end of the run): the window's minimum at the end
# against its maximum at the start, so a transient peak in either does not decide.
WINDOW_SAMPLES = 3

_DURATION = re.compile(
    r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*$"
)


def parse_duration(text: str) -> float:
    """Seconds from ``"3600"``, ``"90s"``, ``"30m"``, ``"1h"`` or ``"1h30m"``; raises
    ValueError naming the accepted forms."""
    m = _DURATION.match(text)
    if not text.strip() or m is None or not any(m.groups()):
        raise ValueError(
            f"duration {text!r}: give seconds (3600, 90s), minutes (30m), hours (1h) or a "
            "sum (1h30m)"
        )
    h, mins, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mins * 60 + s


# -- reading a process ------------------------------------------------------------------
def rss_kib(pid: int) -> Optional[int]:
    """Resident memory of ``pid`` in KiB (VmRSS), None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None  # a zombie has no VmRSS


def open_fds(pid: int) -> Optional[int]:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def shm_files(name: str):
    """The engine's files in /dev/shm (its segment and any named after it): (count, bytes
    allocated)."""
    uid = os.getuid()
    paths = set(glob.glob(f"/dev/shm/shmgrad-{uid}-{name}")) | set(
        glob.glob(f"/dev/shm/shmgrad-{uid}-{name}-*")
    )
    n, allocated = 0, 0
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        n += 1
        allocated += st.st_blocks * 512
    return n, allocated


def shm_used_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@dataclasses.dataclass
class Sample:
    """One sample: ``t`` seconds since the run's start, the kind of worker, steps so far,
    per role ``{"pid", "rss_kib", "fds"}``, the engine's /dev/shm files, /dev/shm's used
    bytes, and the median engine step time (s) of the calls since the last sample."""

    t: float
    kind: str
    steps: int
    procs: Dict[str, dict]
    shm_files: int
    shm_bytes: int
    shm_used: int
    step_median_s: Optional[float]
    step_count: int
    probe_s: Optional[float] = None
    load1: Optional[float] = None  # /proc/loadavg's one-minute load


class Sampler:
    """Takes a sample every ``every`` seconds (the run asks :meth:`due` after each step)
    and rewrites ``out`` (JSON, or CSV if it ends in .csv) after each, so that a run cut
    short still leaves its samples."""

    def __init__(self, every: float, out: Optional[str] = None, t0: Optional[float] = None):
        self.every = every
        self.out = out
        self.t0 = time.monotonic() if t0 is None else t0
        self.samples: List[Sample] = []
        self.step_times: List[float] = []
        self.probe_times: List[float] = []
        self._steps_since_probe = 0
        self.next_at = None
        self.meta: dict = {}

    def step_done(self, seconds: float):
        self.step_times.append(seconds)

    def maybe_probe(self, probe):
        """Times ``probe`` once every PROBE_EVERY_STEPS calls (after a step)."""
        self._steps_since_probe += 1
        if self._steps_since_probe < PROBE_EVERY_STEPS:
            return
        self._steps_since_probe = 0
        t0 = time.perf_counter()
        probe()
        self.probe_times.append(time.perf_counter() - t0)

    def start_run(self):
        """A new engine (kind of worker): its first sample one interval from now."""
        self.step_times.clear()
        self.probe_times.clear()
        self.next_at = time.monotonic() + self.every

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def sample(self, kind, name, status, steps, probe=None):
        """Samples the run's processes now (``status``: the engine's, for its pids). The
        probe time is the median of the probes timed since the last sample
        (:meth:`maybe_probe`), or, if there were none, of PROBE_REPEATS runs of
        ``probe`` now."""
        self.next_at += self.every
        if self.next_at < time.monotonic():  # a long fault: no burst of catch-up samples
            self.next_at = time.monotonic() + self.every
        roles = {"trainer": os.getpid()}
        if status is not None:
            if status.coordinator_pid > 0:
                roles["coordinator"] = status.coordinator_pid
            for w in status.workers:
                if w.pid > 0 and w.state == "ready":
                    roles[f"worker{w.slot}"] = w.pid
        procs = {}
        for role, pid in roles.items():
            rss, fds = rss_kib(pid), open_fds(pid)
            if rss is not None and fds is not None:
                procs[role] = {"pid": pid, "rss_kib": rss, "fds": fds}
        n, allocated = shm_files(name)
        times = self.step_times
        self.samples.append(
            Sample(
                t=round(time.monotonic() - self.t0, 3),
                kind=kind,
                steps=steps,
                procs=procs,
                shm_files=n,
                shm_bytes=allocated,
                shm_used=shm_used_bytes(),
                step_median_s=statistics.median(times) if times else None,
                step_count=len(times),
                probe_s=(
                    statistics.median(self.probe_times)
                    if self.probe_times
                    else None
                    if probe is None
                    else _time_probe(probe)
                ),
                load1=_load1(),
            )
        )
        self.step_times = []
        self.probe_times = []
        self.write()

    def write(self, verdict=None):
        if not self.out:
            return
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            if self.out.endswith(".csv"):
                _write_csv(f, self.samples)
            else:
                json.dump(
                    dict(
                        self.meta,
                        samples=[dataclasses.asdict(s) for s in self.samples],
                        **({"verdict": verdict} if verdict is not None else {}),
                    ),
                    f,
                    indent=1,
                )
        os.replace(tmp, self.out)


def cpu_probe():
    """The soak's yardstick: a fixed single-threaded computation."""
    total = 0
    for i in range(PROBE_LOOP):
        total += i * i
    return total


def _time_probe(probe):
    times = []
    for _ in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        probe()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _load1() -> Optional[float]:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _write_csv(f, samples):
    f.write(
        "t_s,kind,steps,role,pid,rss_kib,fds,shm_files,shm_bytes,shm_used,step_median_s,"
        "step_count,probe_s,load1\n"
    )
    for s in samples:
        med = "" if s.step_median_s is None else f"{s.step_median_s:.6f}"
        probe = "" if s.probe_s is None else f"{s.probe_s:.6f}"
        load = "" if s.load1 is None else s.load1
        for role, p in sorted(s.procs.items()):
            f.write(
                f"{s.t},{s.kind},{s.steps},{role},{p['pid']},{p['rss_kib']},{p['fds']},"
                f"{s.shm_files},{s.shm_bytes},{s.shm_used},{med},{s.step_count},{probe},"
                f"{load}\n"
            )


# -- the verdict ------------------------------------------------------------------------
def _windows(samples):
    """The samples after warm-up, and its first and last windows (None if too few)."""
    skip = max(1, int(len(samples) * WARMUP_FRACTION + 0.5))
    kept = samples[skip:]
    w = min(WINDOW_SAMPLES, len(kept) // 2)
    if w < 1:
        return kept, None, None
    return kept, kept[:w], kept[-w:]


def check_growth(samples, shm_after: Optional[Dict[str, int]] = None) -> List[str]:
    """What grew beyond its bound, one message per finding (empty: nothing did).

    ``samples`` are :class:`Sample` s (or their dicts); each kind of worker (one engine)
    is judged on its own. After a warm-up (the first WARMUP_FRACTION of its samples, at
    least one), the first WINDOW_SAMPLES samples are compared with the last ones, the
    *largest* value of the first window with the *smallest* of the last (so a leak, which
    keeps what it takes, shows and a passing peak does not):

    * trainer and coordinator: resident memory grown more than RSS_GROWTH_MIB[role];
      open fds grown more than FD_GROWTH;
    * worker slots (several processes over a run: replacements): the largest worker of the
      last window against the largest of the first, plus WORKER_RSS_GROWTH_MIB; fds the
      same way, plus FD_GROWTH;
    * the engine's /dev/shm files: count and bytes not above the first window's;
    * median step time, each sample's divided by its probe time (the raw median where a
      sample has none): the last window's median above the first's by more than
      STEP_TIME_DRIFT (a fraction).

    ``shm_after`` maps a kind to the engine's /dev/shm files left after its engine stopped:
    any is a finding. A run too short for two windows after warm-up is a finding too (the
    check could not be made)."""
    samples = [s if isinstance(s, dict) else dataclasses.asdict(s) for s in samples]
    findings = []
    kinds = list(dict.fromkeys(s["kind"] for s in samples))
    for kind in kinds:
        series = [s for s in samples if s["kind"] == kind]
        _, first, last = _windows(series)
        if first is None:
            findings.append(
                f"{kind}: {len(series)} samples are too few to judge growth (need warm-up "
                f"plus two windows): run longer or sample more often"
            )
            continue
        findings += _check_long_lived(kind, first, last)
        findings += _check_workers(kind, first, last)
        for key, unit in (("shm_files", "files"), ("shm_bytes", "bytes")):
            before = max(s[key] for s in first)
            after = min(s[key] for s in last)
            if after > before:
                findings.append(
                    f"{kind}: the engine's /dev/shm {unit} grew from {before} to {after}"
                )
        findings += _check_step_time(kind, first, last)
    for kind, left in (shm_after or {}).items():
        if left:
            findings.append(
                f"{kind}: {left} file(s) of the engine left in /dev/shm after it stopped"
            )
    return findings


def _role_values(window, role, key):
    return [s["procs"][role][key] for s in window if role in s["procs"]]


def _check_long_lived(kind, first, last):
    out = []
    for role, bound_mib in RSS_GROWTH_MIB.items():
        a, b = _role_values(first, role, "rss_kib"), _role_values(last, role, "rss_kib")
        if a and b and (min(b) - max(a)) / 1024 > bound_mib:
            out.append(
                f"{kind}: {role}'s resident memory grew by {(min(b) - max(a)) / 1024:.1f} MiB "
                f"({max(a) / 1024:.1f} -> {min(b) / 1024:.1f} MiB), bound {bound_mib:g} MiB"
            )
        a, b = _role_values(first, role, "fds"), _role_values(last, role, "fds")
        if a and b and min(b) - max(a) > FD_GROWTH:
            out.append(
                f"{kind}: {role}'s open file descriptors grew from {max(a)} to {min(b)}, "
                f"bound +{FD_GROWTH}"
            )
    return out


def _worker_max(window, key):
    """Per sample, the largest value over its worker slots; then the window's values."""
    vals = []
    for s in window:
        w = [p[key] for r, p in s["procs"].items() if r.startswith("worker")]
        if w:
            vals.append(max(w))
    return vals


def _check_workers(kind, first, last):
    out = []
    a, b = _worker_max(first, "rss_kib"), _worker_max(last, "rss_kib")
    if a and b and (min(b) - max(a)) / 1024 > WORKER_RSS_GROWTH_MIB:
        out.append(
            f"{kind}: the largest worker's resident memory grew by "
            f"{(min(b) - max(a)) / 1024:.1f} MiB ({max(a) / 1024:.1f} -> "
            f"{min(b) / 1024:.1f} MiB), bound {WORKER_RSS_GROWTH_MIB:g} MiB"
        )
    a, b = _worker_max(first, "fds"), _worker_max(last, "fds")
    if a and b and min(b) - max(a) > FD_GROWTH:
        out.append(
            f"{kind}: the workers' open file descriptors grew from {max(a)} to {min(b)}, "
            f"bound +{FD_GROWTH}"
        )
    return out


def normalised_step_time(s) -> Optional[float]:
    """A sample's median step time divided by its probe time (the raw median where the
    sample has no probe time), or None."""
    med = s["step_median_s"]
    if med is None:
        return None
    probe = s.get("probe_s")
    return med / probe if probe else med


def _check_step_time(kind, first, last):
    normalised = all(s.get("probe_s") for s in first + last)
    a = [normalised_step_time(s) for s in first if s.get("step_count", 0) >= STEP_TIME_MIN_STEPS]
    b = [normalised_step_time(s) for s in last if s.get("step_count", 0) >= STEP_TIME_MIN_STEPS]
    a, b = [v for v in a if v is not None], [v for v in b if v is not None]
    if not a or not b:
        return []
    before, after = statistics.median(a), statistics.median(b)
    if before > 0 and after > before * (1 + STEP_TIME_DRIFT):
        what, unit, k = (
            ("step time / probe time", "", 1.0) if normalised else ("step time", " ms", 1e3)
        )
        return [
            f"{kind}: the median {what} drifted from {before * k:.2f}{unit} to "
            f"{after * k:.2f}{unit} (+{(after / before - 1) * 100:.0f} %), bound "
            f"+{STEP_TIME_DRIFT * 100:.0f} %"
        ]
    return []


def machine() -> dict:
    """What the soak ran on, for its record."""
    import platform

    import torch

    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) // 1024  # MemTotal, MiB
    except (OSError, ValueError, IndexError):
        pass
    return dict(
        cpus=os.cpu_count(),
        mem_total_mib=mem,
        kernel=platform.release(),
        python=platform.python_version(),
        torch=torch.__version__,
    )


def bounds() -> dict:
    """The bounds, as the soak output records them."""
    return dict(
        rss_growth_mib=RSS_GROWTH_MIB,
        worker_rss_growth_mib=WORKER_RSS_GROWTH_MIB,
        fd_growth=FD_GROWTH,
        step_time_drift=STEP_TIME_DRIFT,
        warmup_fraction=WARMUP_FRACTION,
        window_samples=WINDOW_SAMPLES,
    )
