"""What another local user can reach (docs/DESIGN.md, "What a local attacker can reach"):
the eager job and the files beside it, the names in /dev/shm, and the torch.distributed
store's segment key. Each test acts as uid nobody (setpriv, or setuid in a child) to plant
or read what a stranger could, then checks that the owner's process refuses it, naming
it, and leaves it alone. Root only (to be two users); skipped with the reason otherwise.
"""

import datetime
import os
import pickle
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.distributed as dist

import shmgrad
from conftest import Mlp
from shmgrad import _job
from shmgrad._native import _C

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
TIMEOUT_S = 30  # any one child


@pytest.fixture(autouse=True)
def two_users():
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another uid (CI runs as root)")


def as_nobody(code, *args, check=True):
    """Runs Python ``code`` as uid nobody (Debian's own interpreter: nobody may not
    reach the test's virtual environment)."""
    proc = subprocess.run(
        AS_NOBODY + ["/usr/bin/python3", "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert not check or proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def shared_dir():
    """A world-writable sticky directory (like /tmp): where a stranger can plant files."""
    d = tempfile.mkdtemp(prefix="netns-attacker-")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d)


# -- (a) the eager job and the files a worker loads ------------------------------------------
def _owned_dir(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().decode().split("\0")
    return args[args.index("--owned-dir") + 1], args[args.index("--eager-job") + 1]


def test_the_eager_job_is_private_and_a_stranger_can_neither_read_nor_swap_it():
    model = Mlp(d_in=4, d_out=2)
    with shmgrad.Engine(model=model, workers=1, loss="cross_entropy", mode="eager") as engine:
        directory, job = _owned_dir(engine._server.pid)
        assert os.path.dirname(job) == directory
        d = os.lstat(directory)
        assert stat.S_ISDIR(d.st_mode) and d.st_uid == os.geteuid()
        assert stat.S_IMODE(d.st_mode) == 0o700
        names = sorted(os.listdir(directory))
        assert names == sorted([_job.JOB_FILE, _job.PARAMS_FILE]), names
        for name in names:  # the pickled job and the parameters' file beside it
            st = os.lstat(os.path.join(directory, name))
            assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid(), name
            assert stat.S_IMODE(st.st_mode) == 0o600, (name, oct(st.st_mode))
        out = as_nobody(
            """
            import os, sys
            directory, job = sys.argv[1:]
            for what, act in (
                ("read the job", lambda: open(job, "rb").read()),
                ("list the directory", lambda: os.listdir(directory)),
                ("add a file", lambda: open(os.path.join(directory, "x"), "w")),
                ("replace the job", lambda: os.rename(directory, directory + "-gone")),
            ):
                try:
                    act()
                    print("allowed:", what)
                except PermissionError:
                    print("denied:", what)
            """,
            directory,
            job,
        ).stdout
        assert "allowed" not in out and out.count("denied") == 4, out
        engine.bind(model)
        st = engine.gradient(inputs=torch.randn(2, 4), targets=torch.tensor([0, 1]))
        assert st.num_examples == 2


# A pickle whose loading runs code: it creates MARKER (argv[2]).
PLANT_JOB = """
import os, pickle, subprocess, sys
class Payload:
    def __reduce__(self):
        return (subprocess.call, (["touch", sys.argv[2]],))
os.umask(0)
path = sys.argv[1]
os.makedirs(os.path.dirname(path), mode=int(sys.argv[3], 8), exist_ok=True)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, int(sys.argv[4], 8))
os.write(fd, pickle.dumps({"model": Payload()}))
os.close(fd)
"""


@pytest.mark.parametrize(
    "where,dir_mode,file_mode,why",
    [
        ("shared", "1777", "0644", "has mode 1777"),  # planted in a /tmp-like dir
        ("own-dir", "0700", "0600", "belongs to uid 65534"),  # the stranger's private dir
    ],
)
def test_a_job_a_stranger_planted_is_refused_not_unpickled(
    shared_dir, where, dir_mode, file_mode, why
):
    marker = os.path.join(shared_dir, "payload-ran")
    job = os.path.join(shared_dir, "job.pkl") if where == "shared" else None
    if job is None:
        job = os.path.join(shared_dir, "strangers", "job.pkl")
    as_nobody(PLANT_JOB, job, marker, dir_mode, file_mode)
    assert os.stat(job).st_uid == NOBODY
    with pytest.raises(shmgrad.BusyError, match=why) as info:
        _job.load_job(job)
    assert "refused" in str(info.value)
    assert not os.path.exists(marker), "the stranger's pickle ran as root"


def test_a_job_of_ours_that_others_could_change_or_a_link_is_refused(tmp_path):
    private = tmp_path / "job"
    private.mkdir(mode=0o700)
    good = private / "job.pkl"
    with os.fdopen(os.open(good, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        pickle.dump({"model": "ok"}, f)
    assert _job.load_job(str(good)) == {"model": "ok"}  # as the launcher writes it
    link = private / "link.pkl"
    link.symlink_to(good)
    with pytest.raises(shmgrad.BusyError, match="symbolic link"):
        _job.load_job(str(link))
    os.chmod(good, 0o644)  # readable by others
    with pytest.raises(shmgrad.BusyError, match="has mode 0644"):
        _job.load_job(str(good))
    os.chmod(good, 0o600)
    os.chmod(private, 0o733)  # others may add and rename entries
    with pytest.raises(shmgrad.BusyError, match="has mode 0733"):
        _job.load_job(str(good))
    os.chmod(private, 0o700)
    fifo = private / "fifo.pkl"
    os.mkfifo(fifo)  # would block a plain open()
    with pytest.raises(shmgrad.BusyError, match="not a regular file"):
        _job.load_job(str(fifo))


def test_stop_does_not_follow_a_link_swapped_in_for_the_job_directory(tmp_path):
    """At stop the coordinator empties its --owned-dir. If the directory were swapped for a
    symbolic link (possible where its parent lets others rename entries), following it
    would empty the folder it points to."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    model = Mlp(d_in=4, d_out=2)
    engine = shmgrad.Engine(model=model, workers=1, loss="cross_entropy", mode="eager")
    try:
        directory, _ = _owned_dir(engine._server.pid)
        moved = directory + "-moved"
        os.rename(directory, moved)
        os.symlink(victim, directory)
    finally:
        engine.close()
    try:
        assert (victim / "precious").read_text() == "keep me"
        assert os.path.islink(directory)
    finally:
        os.unlink(directory)
        shutil.rmtree(moved)


# -- (b) names in /dev/shm ---------------------------------------------------------------
PLANT_SEGMENT = """
import os, sys
os.umask(0)
kind, path, target = sys.argv[1:]
if kind == "symlink":
    os.symlink(target, path)
else:  # a file the owner could read and write: only the owner check refuses it
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    os.truncate(path, 1 << 20)
"""


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_name_a_stranger_planted_in_dev_shm_is_refused(tmp_path, kind):
    name = f"netns-planted-{kind}-{os.getpid()}"
    path = _C.segment_path(name)
    target = tmp_path / "target"  # a file of ours the link points at
    target.write_bytes(b"\0" * 4096)
    as_nobody(PLANT_SEGMENT, kind, path, str(target))
    try:
        st = os.lstat(path)
        assert st.st_uid == NOBODY
        owned = f"owned by uid {NOBODY}"
        what = "a symbolic link" if kind == "symlink" else "a regular file"
        with pytest.raises(shmgrad.BusyError, match=f"{what} {owned}") as info:
            shmgrad.attach(name, timeout=0.5)
        assert path in str(info.value)
        with pytest.raises(shmgrad.BusyError, match=f"{what} {owned}") as info:
            shmgrad.Engine(model=Mlp(d_in=4, d_out=2), workers=1, loss="cross_entropy", name=name)
        assert path in str(info.value)
        after = os.lstat(path)  # neither removed nor replaced
        assert (after.st_ino, after.st_uid) == (st.st_ino, NOBODY)
        assert target.read_bytes() == b"\0" * 4096
    finally:
        os.unlink(path)


# -- (c) the torch.distributed backend's store key -------------------------------------------
STRANGERS_MEMFD = """
import os, sys
fd = os.memfd_create("shmgrad-pg", 0)  # the name the backend's own segments carry
os.ftruncate(fd, 1 << 20)
os.fchmod(fd, 0o666)
print(f"/proc/{os.getpid()}/fd/{fd}", flush=True)
sys.stdin.read()  # holds it until the test is done
"""


def test_the_store_naming_a_strangers_memory_is_refused():
    """Whoever can write the TCPStore can name any /proc/<pid>/fd/<fd> as the node's
    segment. The store is trusted, as in PyTorch; still, a memory file of another uid is
    never mapped, even one named like the backend's and open to all."""
    stranger = subprocess.Popen(
        AS_NOBODY + ["/usr/bin/python3", "-c", STRANGERS_MEMFD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        name = stranger.stdout.readline().strip()
        assert name.startswith("/proc/"), name
        assert os.readlink(name).startswith("/memfd:shmgrad-pg")  # root can reach it
        store = dist.HashStore()
        store.set("shmgrad/node0/segment", name)  # what rank 0 would publish
        with pytest.raises(Exception, match=f"belongs to uid {NOBODY}") as info:
            # Rank 1 of a group of two on one node reads the key and attaches.
            _C.create_process_group_backend(
                store, 1, 2, datetime.timedelta(seconds=5), "shmgrad/", [0, 0], None, None
            )
        assert name in str(info.value)
    finally:
        stranger.stdin.close()
        stranger.wait(TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
