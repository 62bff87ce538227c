"""The commands the README and docs/MULTINODE.md give, run as written there (from the
checkout's root), shortened to one epoch with their own options where a full run does not
fit in CI. The Dask recipe has its own test (test_multinode.py), and the adaptive example
runs shortened in tools/device-check's dry run (test_build.py)."""

import os
import re
import subprocess

import pytest

from conftest import ROOT, python_blocks


def _commands(doc):
    """Every shell command in the document's code blocks and indented blocks, with its
    backslash continuations joined and its comment removed."""
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith((".venv/bin/", "tools/")):
            out.append(re.sub(r"\s+#.*$", "", line).strip())
    return out


def _run(command, timeout=600):
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_readme_demo_runs_as_written():
    first = _commands("README.md")[0]
    assert first == "tools/setup.sh && .venv/bin/python examples/train_fashion_mnist.py", first
    demo = first.split("&& ", 1)[1]  # set-up is what this suite runs in
    out = _run(demo + " --epochs 1")
    assert re.search(r"^epoch 1: test accuracy \d+\.\d+%", out, re.M), out[-2000:]


@pytest.mark.full  # 25-30 s; test_multinode runs the same engines over a gloo group in CI
def test_multinode_torchrun_on_one_machine_runs_as_written():
    torchrun = [c for c in _commands("docs/MULTINODE.md") if "--standalone" in c]
    assert len(torchrun) == 1 and "--epochs 2" in torchrun[0], torchrun
    out = _run(torchrun[0].replace("--epochs 2", "--epochs 1"))
    assert "parameters identical on every node (checksum" in out, out[-2000:]


# --- the documents' code, signatures and options, checked against the code -------------

DOCS = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
)


def _python_blocks():
    """(document, line, is_fragment, code) of every python block of the README and docs/."""
    return [(doc, *block) for doc in DOCS for block in python_blocks(doc)]


def test_every_python_block_parses():
    blocks = _python_blocks()
    assert len(blocks) >= 10, blocks  # the pattern still finds them
    for doc, line, _, code in blocks:
        try:
            compile(code, f"{doc}:{line}", "exec")
        except SyntaxError as e:
            raise AssertionError(f"{doc}:{line}: a python block does not parse: {e}") from e


def test_python_blocks_not_marked_fragment_run_as_written(tmp_path):
    """A block not marked ``python fragment`` is a complete program: it runs, as a user
    would paste it, in a fresh interpreter."""
    runnable = [b for b in _python_blocks() if not b[2]]
    assert any(doc == "README.md" for doc, *_ in runnable), "the README's example must run"
    for doc, line, _, code in runnable:
        proc = subprocess.run(
            [os.path.join(ROOT, ".venv", "bin", "python"), "-c", code],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"{doc}:{line}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"


def _plain_signature(obj, drop_self):
    import inspect

    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    if drop_self and params and params[0].name == "self":
        params = params[1:]
    plain = sig.replace(parameters=params, return_annotation=inspect.Signature.empty)
    return str(plain).replace("'", '"')


def _api_headings():
    """docs/API.md's ``### `NAME(SIGNATURE)` `` and ``### `NAME` `` headings."""
    with open(os.path.join(ROOT, "docs", "API.md")) as f:
        return re.findall(r"^### `([\w.]+)(\(.*\))?`$", f.read(), re.M)


def _resolve(dotted):
    import importlib

    import shmgrad

    head, _, rest = dotted.partition(".")
    if head in ("Client", "Engine", "Server"):
        return getattr(shmgrad, head), rest
    assert head == "shmgrad", dotted
    parts = rest.split(".")
    obj = shmgrad
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            obj = importlib.import_module("shmgrad." + ".".join(parts[: i + 1]))
        else:
            obj = getattr(obj, part)
    return obj, ""


def test_api_reference_signatures_match_the_code():
    import inspect

    headings = _api_headings()
    assert len(headings) > 40, headings
    for name, signature in headings:
        owner, member = _resolve(name)
        if member:
            attr = inspect.getattr_static(owner, member)
            if signature:
                got = _plain_signature(attr, drop_self=True)
            else:
                assert not callable(attr), f"docs/API.md: {name} has no signature"
                continue  # a property or an attribute
        else:
            got = _plain_signature(owner, drop_self=False)
        assert signature == got, f"docs/API.md: {name}{signature}\n       code: {name}{got}"


def test_api_reference_names_every_public_name():
    import inspect

    import shmgrad

    with open(os.path.join(ROOT, "docs", "API.md")) as f:
        text = f.read()
    documented = {name for name, _ in _api_headings()}
    for name in shmgrad.__all__:
        obj = getattr(shmgrad, name)
        if inspect.ismodule(obj):
            assert f"`shmgrad.{name}." in text, f"docs/API.md never names module shmgrad.{name}"
        elif inspect.isclass(obj) and issubclass(obj, BaseException):
            assert f"`shmgrad.{name}`" in text, f"docs/API.md's errors lack shmgrad.{name}"
        else:
            assert f"shmgrad.{name}" in documented, f"docs/API.md has no heading shmgrad.{name}"
    for member in dir(shmgrad.Client):
        if not member.startswith("_"):
            assert f"Client.{member}" in documented, f"docs/API.md has no heading Client.{member}"


def _help(command):
    proc = subprocess.run(
        [os.path.join(ROOT, ".venv", "bin", "shmgrad"), command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cli_reference_options_exist_and_serve_is_complete():
    with open(os.path.join(ROOT, "docs", "CLI.md")) as f:
        sections = re.split(r"^## ", f.read(), flags=re.M)[1:]
    seen = set()
    for section in sections:
        commands = re.findall(r"`shmgrad (\w+)", section.splitlines()[0])
        assert commands, section.splitlines()[0]
        helps = "".join(_help(c) for c in commands)
        for flag in set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", section)):
            assert re.search(rf"(?<![\w-]){flag}\b", helps), f"docs/CLI.md: {commands} {flag}"
        if commands == ["serve"]:
            seen = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", section))
    serve_flags = set(re.findall(r"^\s+(--[a-z][a-z-]*)", _help("serve"), re.M)) - {"--help"}
    assert serve_flags and serve_flags <= seen, f"docs/CLI.md lacks {sorted(serve_flags - seen)}"


def test_cli_reference_serve_table_is_the_option_list():
    """Each row of serve's table names its option and value as engine/serve_options.h's
    list does ("`--max-batch N`"), every option users give has a row, and a default a row
    states is the list's; the stop timeout stated is ipc/config.h's."""
    from shmgrad._native import DEFAULTS, SERVE_OPTIONS

    with open(os.path.join(ROOT, "docs", "CLI.md")) as f:
        text = f.read()
    options = {o.flag.split(" ")[0]: o for o in SERVE_OPTIONS.values() if o.flag}
    rows = re.findall(r"^\| `(--[a-z-]+)( [^`]+)?`[^|]*\| (.*) \|$", text, re.M)
    assert len(rows) > 10, rows
    seen = set()
    for flag, value, meaning in rows:
        if flag == "--eager":
            continue  # the command line's own: python -m shmgrad._serve_eager
        option = options[flag]
        assert flag + value.replace("\\|", "|") == option.flag, (flag, value, option.flag)
        stated = re.search(r"\(default (\d[\d.]*)\)", meaning)
        if stated:
            assert float(stated.group(1)) == option.default, (flag, stated.group(0))
        seen.add(flag)
    assert seen == {f for f, o in options.items() if not o.internal}, seen
    stop = re.search(r"`--timeout`, default (\d+) s", text)
    assert stop and float(stop.group(1)) == DEFAULTS["stop_timeout"], stop


def test_documents_the_readme_names_exist():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for doc in set(re.findall(r"\b((?:docs/)?[A-Z]+\.md)\b", readme)):
        assert os.path.exists(os.path.join(ROOT, doc)), f"README.md names {doc}"
