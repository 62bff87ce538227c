"""Two network namespaces joined by one link whose faults a test sets: delay, loss, and a
full partition. Used by test_partition.py (root only).

The link is a veth pair shaped with ``tc netem`` where the kernel has ``sch_netem``;
otherwise (a container that cannot load the module) it is a pair of TUN devices, one in
each namespace, whose packets a relay process (``python netlab.py relay``, below) carries
across, delaying and dropping them as told. Either way the two namespaces see one
point-to-point IPv4 link, ``10.<n>.0.1`` <-> ``10.<n>.0.2``, and TCP runs over it
unchanged: a partition is every packet dropped, not a closed socket.

Run as a script it is the relay: ``python netlab.py relay NS_A NS_B IFNAME``. It opens a
TUN device named IFNAME in each namespace, prints ``ready``, then forwards packets until
its stdin closes, reading one command a line: ``set DELAY_MS LOSS CUT`` (LOSS a fraction,
CUT 0 or 1), answered with a JSON line of its counters.
"""

import collections
import ctypes
import fcntl
import json
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import time

IFNAME = "sglink0"  # the link's device in each namespace (at most 15 characters)
COMMAND_TIMEOUT_S = 20  # any one ip/tc command
RELAY_READY_TIMEOUT_S = 20
_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_MAX_PACKET = 65536


class Unavailable(Exception):
    """Namespaces, veth/TUN or the link's shaping cannot be set up here: the reason."""


def run(*args, check=True):
    """One ip/tc command, bounded; its stderr in the error."""
    proc = subprocess.run(
        list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
    )
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, args, proc.stdout, proc.stderr)
    return proc


def namespace_pids(ns):
    proc = run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


class Link:
    """Namespaces ``<prefix>-a`` and ``<prefix>-b`` and the link between them.

    ``shape(delay_ms=, loss=, cut=)`` sets the link's faults in both directions (each
    direction gets the delay: a round trip takes twice it). ``close()`` kills every
    process still inside the namespaces, stops the relay and deletes the namespaces; it
    is safe to call after a failed construction, and more than once."""

    def __init__(self, prefix, subnet):
        if os.geteuid() != 0:
            raise Unavailable("not root: creating network namespaces needs CAP_SYS_ADMIN")
        if shutil.which("ip") is None:
            raise Unavailable("'ip' is not installed (iproute2; tools/setup.sh)")
        self.namespaces = [f"{prefix}-a", f"{prefix}-b"]
        self.addresses = [f"10.{subnet}.0.1", f"10.{subnet}.0.2"]
        self.kind = None  # "netem" or "relay"
        self._relay = None
        self._created = []
        try:
            for ns in self.namespaces:
                proc = run("ip", "netns", "add", ns, check=False)
                if proc.returncode != 0:
                    raise Unavailable(f"ip netns add failed: {proc.stderr.strip()}")
                self._created.append(ns)
                run("ip", "-n", ns, "link", "set", "lo", "up")
            if self._netem_works():
                self._veth(prefix)
                self.kind = "netem"
            else:
                self._start_relay()
                self.kind = "relay"
            for ns, mine, peer in zip(self.namespaces, self.addresses, self.addresses[::-1]):
                run("ip", "-n", ns, "addr", "add", mine, "peer", peer, "dev", IFNAME)
                run("ip", "-n", ns, "link", "set", IFNAME, "up")
        except BaseException:
            self.close()
            raise

    # -- set-up --------------------------------------------------------------------------
    def _netem_works(self):
        if shutil.which("tc") is None:  # the relay needs no tc
            self.netem_refusal = "'tc' is not installed"
            return False
        ns = self.namespaces[0]
        qdisc = ["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root"]
        proc = run(*qdisc, "netem", "delay", "0ms", check=False)
        if proc.returncode != 0:
            self.netem_refusal = proc.stderr.strip()
            return False
        run("tc", "-n", ns, "qdisc", "del", "dev", "lo", "root")
        return True

    def _veth(self, prefix):
        # Created in the first namespace, one end moved to the second: no name in the root
        # namespace, so two tests cannot collide on it.
        a, b = self.namespaces
        proc = run(
            "ip", "-n", a, "link", "add", IFNAME, "type", "veth", "peer", "name", IFNAME,
            "netns", b, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise Unavailable(f"cannot create a veth pair: {proc.stderr.strip()}")

    def _start_relay(self):
        if not os.path.exists("/dev/net/tun"):
            raise Unavailable("neither sch_netem nor /dev/net/tun: no way to shape a link")
        self._relay = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "relay", *self.namespaces, IFNAME],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready, _, _ = select.select([self._relay.stdout], [], [], RELAY_READY_TIMEOUT_S)
        line = self._relay.stdout.readline().strip() if ready else ""
        if line != "ready":
            self._relay.kill()
            _, err = self._relay.communicate(timeout=COMMAND_TIMEOUT_S)
            raise Unavailable(f"the TUN relay did not start ({line!r}): {err.strip()[-500:]}")

    # -- faults --------------------------------------------------------------------------
    def shape(self, *, delay_ms=0, loss=0.0, cut=False):
        """Sets the faults (both directions); returns the relay's counters (netem: {})."""
        if self.kind == "relay":
            self._relay.stdin.write(f"set {delay_ms} {loss} {int(cut)}\n")
            self._relay.stdin.flush()
            ready, _, _ = select.select([self._relay.stdout], [], [], COMMAND_TIMEOUT_S)
            assert ready, "the relay did not answer"
            return json.loads(self._relay.stdout.readline())
        for ns in self.namespaces:
            if not (delay_ms or loss or cut):
                run("tc", "-n", ns, "qdisc", "del", "dev", IFNAME, "root", check=False)
                continue
            percent = 100.0 if cut else 100.0 * loss
            run(
                "tc", "-n", ns, "qdisc", "replace", "dev", IFNAME, "root", "netem",
                "delay", f"{delay_ms}ms", "loss", f"{percent}%",
            )  # fmt: skip
        return {}

    def counters(self):
        """The relay's packet counters (forwarded, dropped, delayed); netem: {}."""
        if self.kind != "relay":
            return {}
        self._relay.stdin.write("stats\n")
        self._relay.stdin.flush()
        return json.loads(self._relay.stdout.readline())

    # -- tear-down -----------------------------------------------------------------------
    def close(self):
        for ns in self._created:
            for pid in namespace_pids(ns):  # our own children's children, if any remain
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self._relay is not None:
            if self._relay.poll() is None:
                self._relay.kill()
            self._relay.communicate(timeout=COMMAND_TIMEOUT_S)
            self._relay = None
        for ns in self._created:
            run("ip", "netns", "del", ns, check=False)
        self._created = []


# -- the relay (a separate process: it holds both TUN devices) ------------------------------
def _enter(libc, ns_path):
    fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns_path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _open_tun(libc, ns, name, home):
    """A TUN device named ``name`` in namespace ``ns``: the file stays this process's, the
    device lives (and dies with the file) in ``ns``."""
    _enter(libc, f"/run/netns/{ns}")
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI))
        return fd
    finally:
        _enter(libc, home)


def relay_main(ns_a, ns_b, name):
    libc = ctypes.CDLL(None, use_errno=True)
    home = f"/proc/{os.getpid()}/ns/net"
    home_fd = os.open(home, os.O_RDONLY | os.O_CLOEXEC)  # to come back to
    home = f"/proc/self/fd/{home_fd}"
    a = _open_tun(libc, ns_a, name, home)
    b = _open_tun(libc, ns_b, name, home)
    other = {a: b, b: a}
    delay_s, loss, cut = 0.0, 0.0, False
    counts = {"forwarded": 0, "dropped": 0, "delayed": 0}
    queue = collections.deque()  # (due, fd, packet), due in order while the delay holds
    control = sys.stdin.fileno()
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, fd, packet = queue.popleft()
            try:
                os.write(fd, packet)
                counts["forwarded"] += 1
            except OSError:  # the device is down or full: a lost packet, as on a wire
                counts["dropped"] += 1
        wait = max(0.0, queue[0][0] - now) if queue else None
        ready, _, _ = select.select([a, b, control], [], [], wait)
        for fd in ready:
            if fd == control:
                line = sys.stdin.readline()
                if not line:
                    return  # the test has gone
                words = line.split()
                if words[0] == "set":
                    delay_s, loss, cut = float(words[1]) / 1000, float(words[2]), words[3] == "1"
                print(json.dumps(counts), flush=True)
                continue
            while True:
                try:
                    packet = os.read(fd, _MAX_PACKET)
                except BlockingIOError:
                    break
                if cut or (loss and random.random() < loss):
                    counts["dropped"] += 1
                    continue
                if delay_s:
                    counts["delayed"] += 1
                queue.append((time.monotonic() + delay_s, other[fd], packet))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "relay":
        relay_main(*sys.argv[2:])
    else:
        sys.exit(f"usage: {sys.argv[0]} relay NS_A NS_B IFNAME")
