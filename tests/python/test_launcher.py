"""The launcher's side of `shmgrad serve --status-fd`, against stand-in serve programs:
each way serve can end its start-up gives its own error, and serve is never left running."""

import os
import signal
import time

import pytest

import shmgrad
from shmgrad import _launcher as launcher
from shmgrad._launcher import Launcher, ServeOptions


def fake_serve(tmp_path, monkeypatch, body):
    """Makes SHMGRAD_BINARY a shell script running ``body`` (with ``$fd`` the status fd,
    the last argument) and records its pid in pid.txt."""
    script = tmp_path / "serve.sh"
    script.write_text(f'#!/bin/bash\nfd="${{@: -1}}"\necho $$ > {tmp_path}/pid.txt\n{body}\n')
    script.chmod(0o755)
    monkeypatch.setenv("SHMGRAD_BINARY", str(script))


def options(**kw):
    return ServeOptions(
        **dict(
            dict(
                name="fake",
                model_path="/nonexistent.pt",
                workers=2,
                loss="mse",
                startup_timeout=5.0,
            ),
            **kw,
        )
    )


def serve_pid(tmp_path):
    return int((tmp_path / "pid.txt").read_text())


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_command_line_and_serving_event(tmp_path, monkeypatch):
    fake_serve(
        tmp_path,
        monkeypatch,
        f'echo "$@" > {tmp_path}/args.txt\n'
        'echo \'{"event": "serving", "workers": 2}\' >&$fd\nexec sleep 60',
    )
    lch = Launcher(options(dataset="fashion-mnist", max_workers=4))
    try:
        assert lch.start() == {"event": "serving", "workers": 2}
        args = (tmp_path / "args.txt").read_text().split()
        assert args[:3] == ["serve", "--name", "fake"]
        for opt, value in (
            ("--workers", "2"),
            ("--loss", "mse"),
            ("--max-workers", "4"),
            ("--dataset", "fashion-mnist"),
            ("--startup-timeout", "5.0"),
        ):
            assert args[args.index(opt) + 1] == value, (opt, args)
        assert args[-2] == "--status-fd"
        assert not gone(lch.pid)
    finally:
        lch.stop()
    assert gone(lch.pid)


@pytest.mark.parametrize(
    "kind,cls",
    [
        ("NoSpace", shmgrad.NoSpaceError),
        ("InvalidArgument", shmgrad.InvalidArgumentError),
        ("WorkerFailed", shmgrad.WorkerError),
        ("SomethingNew", shmgrad.Error),
    ],
)
def test_failed_event_raises_its_kind(tmp_path, monkeypatch, kind, cls):
    fake_serve(
        tmp_path,
        monkeypatch,
        f'echo \'{{"event": "failed", "kind": "{kind}", "message": "it broke"}}\' >&$fd\n'
        "exec sleep 60",
    )  # even one that lingers is stopped
    with pytest.raises(cls, match="^it broke$") as info:
        Launcher(options()).start()
    assert type(info.value) is cls
    assert gone(serve_pid(tmp_path))


def test_exit_without_a_line_quotes_the_output(tmp_path, monkeypatch):
    fake_serve(tmp_path, monkeypatch, 'echo "loading the model"\necho "it broke" >&2\nexit 3')
    with pytest.raises(shmgrad.Error, match="without reporting why") as info:
        Launcher(options()).start()
    assert "exit status 3" in str(info.value)
    assert "loading the model\nit broke" in str(info.value)


def test_death_is_seen_while_a_child_keeps_the_pipe_open(tmp_path, monkeypatch):
    fake_serve(tmp_path, monkeypatch, f"sleep 30 & echo $! > {tmp_path}/child.txt\nkill -KILL $$")
    t0 = time.monotonic()
    try:
        with pytest.raises(shmgrad.Error, match="killed by SIGKILL"):
            Launcher(options()).start()
        assert time.monotonic() - t0 < 3
    finally:
        os.kill(int((tmp_path / "child.txt").read_text()), signal.SIGKILL)


def test_no_line_within_the_startup_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "STATUS_LINE_MARGIN_S", 0.0)
    fake_serve(tmp_path, monkeypatch, 'echo "still loading"\nexec sleep 60')
    with pytest.raises(shmgrad.EngineTimeoutError, match="did not report within 0.5 s") as info:
        Launcher(options(startup_timeout=0.5)).start()
    assert "still loading" in str(info.value)
    assert gone(serve_pid(tmp_path))


def test_unreadable_line(tmp_path, monkeypatch):
    fake_serve(tmp_path, monkeypatch, 'echo "serving!" >&$fd\nexec sleep 60')
    with pytest.raises(shmgrad.Error, match="unreadable status line"):
        Launcher(options()).start()
    assert gone(serve_pid(tmp_path))


def test_stop_kills_what_ignores_sigterm(tmp_path, monkeypatch):
    fake_serve(
        tmp_path,
        monkeypatch,
        "trap '' TERM\necho '{\"event\": \"serving\"}' >&$fd\nwhile true; do sleep 0.1; done",
    )
    lch = Launcher(options())
    lch.start()
    t0 = time.monotonic()
    lch.stop(timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert gone(lch.pid)
