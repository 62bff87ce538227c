"""The timing every ``shmgrad bench`` system shares: one clock, the step budget, the timing
loop, the statistics of a configuration's step times, and the loopback interface's byte
counter (what the ranks of a one-machine multi-node run send each other)."""

import os
import statistics
import sys
import time

MIN_TIMED_STEPS = 3


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def now():
    # CLOCK_MONOTONIC is system-wide: times taken in different processes are comparable.
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def loopback_bytes():
    """Bytes sent on the loopback interface so far, by every process of the machine (the
    kernel's counter in /proc/net/dev: payload and TCP/IP headers)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])  # transmit bytes
    raise RuntimeError("no loopback interface in /proc/net/dev")


def pin_to_share(rank, ranks):
    """Restricts this process (and what it starts: an engine's coordinator and workers) to
    rank's share of the CPUs it may use, so that ranks on one machine stand for nodes with
    cores of their own. Does nothing when there are fewer CPUs than ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= ranks:
        os.sched_setaffinity(0, cpus[len(cpus) * rank // ranks : len(cpus) * (rank + 1) // ranks])


def summarize(times):
    """median, min, max, quartiles (seconds) of a list of step times."""
    if not times:
        return {}
    s = sorted(times)
    if len(s) >= 2:
        q = statistics.quantiles(s, n=4, method="inclusive")
        q1, q3 = q[0], q[2]
    else:
        q1 = q3 = s[0]
    return {
        "median_s": statistics.median(s),
        "min_s": s[0],
        "max_s": s[-1],
        "q1_s": q1,
        "q3_s": q3,
        "n": len(s),
    }


class Budget:
    """Decides how many timed steps a configuration gets: all --repeats, or fewer (at
    least MIN_TIMED_STEPS) once --budget seconds of timed steps are spent."""

    def __init__(self, repeats, seconds):
        self.repeats = repeats
        self.seconds = seconds
        self.minimum = min(MIN_TIMED_STEPS, repeats)

    def more(self, done, spent):
        if done >= self.repeats:
            return False
        return done < self.minimum or spent < self.seconds


def timed_steps(batches, warmup, budget, deadline, what, step):
    """The timing loop every system shares: ``step(i, x, y, left)`` runs batch ``i`` with
    ``left`` seconds to the deadline and returns the seconds that count as its step time.
    The first ``warmup`` steps are untimed; then steps run while ``budget`` allows.
    Returns the timed steps' times."""
    times, spent = [], 0.0
    for i, (x, y) in enumerate(batches):
        if i >= warmup and not budget.more(len(times), spent):
            break
        left = deadline - now()
        if left <= 0:
            raise TimeoutError(f"{what} run went past --timeout")
        dt = step(i, x, y, left)
        if i >= warmup:
            times.append(dt)
            spent += dt
    return times
