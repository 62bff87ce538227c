"""Options declared once: a gradient call's and attach's (engine/trainer.h) and serve's
(engine/serve_options.h). The binding passes them by field name in their lists' order, and
every Python signature, the launcher's command line and `shmgrad serve --help` take their
names, flags and defaults from the lists: each is checked here against them."""

import dataclasses
import inspect
import re
import subprocess

import pytest
import torch

import shmgrad
from shmgrad import _client, _engine, _job, _launcher
from shmgrad._native import _C, ATTACH_OPTIONS, DEFAULTS, GRADIENT_OPTIONS, SERVE_OPTIONS


def _native_parameters(function):
    """(name, default repr or None) of a pybind function's parameters, from its signature."""
    signature = function.__doc__.splitlines()[0]
    inside = signature[signature.index("(") + 1 : signature.rindex(") ->")]
    found = re.findall(
        r"(\w+): (?:[^=,]|, (?!\w+: ))+?(?: = ((?:[^,]|, (?!\w+: ))+))?(?=, \w+: |$)", inside
    )
    return [(name, default or None) for name, default in found]


@pytest.mark.parametrize(
    "function,leading,options",
    [
        (_C.Trainer.gradient, ["self", "indices", "inputs", "targets"], GRADIENT_OPTIONS),
        (_C.Trainer.gradient_structured, ["self", "leaves", "structure"], GRADIENT_OPTIONS),
        (_C.Trainer.attach, ["name"], ATTACH_OPTIONS),
    ],
)
def test_options_cross_the_binding_by_name_in_their_lists_order(function, leading, options):
    params = _native_parameters(function)
    assert [n for n, _ in params] == leading + list(options), function.__doc__
    for name, default in params[len(leading) :]:
        assert default == repr(options[name].default), (name, default)


def test_the_lists_say_what_each_option_is():
    for options in (GRADIENT_OPTIONS, ATTACH_OPTIONS, SERVE_OPTIONS):
        for name, option in options.items():
            assert option.type in ("int", "float", "bool", "str", "list:int"), (name, option)
            assert option.doc and "\n\n" not in option.doc, name
            kind = {"int": int, "float": float, "bool": bool, "str": str, "list:int": list}
            assert type(option.default) is kind[option.type], (name, option)
    # What users and the docs rely on: a change of one of these is a change of the API.
    defaults = {n: o.default for n, o in GRADIENT_OPTIONS.items()}
    assert (defaults["timeout_seconds"], defaults["max_retries"]) == (600.0, 3)
    assert (defaults["min_examples_per_worker"], defaults["max_examples_per_pass"]) == (1, 0)
    assert defaults["mean"] is False and defaults["average_buffers"] is True
    assert (defaults["accumulate"], defaults["loss_scale"]) == (0, 1.0)
    assert ATTACH_OPTIONS["timeout_seconds"].default == 30.0
    assert DEFAULTS["stop_timeout"] == 30.0 and _launcher.STOP_TIMEOUT_S == 30.0


class _Recorder:
    """A native trainer's stand-in that records what gradient() passes and returns the last
    real step's statistics."""

    def __init__(self, trainer, native):
        self._trainer, self._native, self.calls = trainer, native, []

    def __getattr__(self, name):
        return getattr(self._trainer, name)

    def gradient(self, *args):
        self.calls.append(args)
        return self._native


def test_gradient_gives_each_native_option_its_field():
    # gradient()'s tuple is written in GRADIENT_OPTION_SOURCES' order, which import checks
    # against the list's; here each value must reach the field it is for. Three calls give
    # each bool option its own pattern, and every other option its own value.
    assert tuple(_client.GRADIENT_OPTION_SOURCES) == tuple(GRADIENT_OPTIONS)
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with shmgrad.Engine(model=model, workers=1, loss="cross_entropy") as engine:
        engine.bind(model)
        real = engine._trainer
        recorder = engine._trainer = _Recorder(real, engine.gradient(inputs=x, targets=y)._native)
        try:
            given = dict(timeout=123.0, max_retries=7, min_examples_per_worker=5, seed=42)
            given.update(max_examples_per_pass=9, loss_scale=2.0)
            expected = []
            for mean, raise_on_nonfinite, train in ((1, 0, 1), (0, 1, 0), (1, 1, 0)):
                model.train(bool(train))
                engine.gradient(
                    inputs=x,
                    targets=y,
                    reduction="mean" if mean else "sum",
                    raise_on_nonfinite=bool(raise_on_nonfinite),
                    **given,
                )
                expected.append(
                    dict(
                        mean=bool(mean),
                        sum_through_mean=False,
                        timeout_seconds=123.0,
                        max_retries=7,
                        min_examples_per_worker=5,
                        max_examples_per_pass=9,
                        raise_on_nonfinite=bool(raise_on_nonfinite),
                        loss_scale=2.0,
                        seed=42,
                        train=bool(train),
                        average_buffers=True,
                        accumulate=0,
                        prev_count=0.0,
                    )
                )
        finally:
            engine._trainer = real
    assert len(recorder.calls) == 3
    for args, want in zip(recorder.calls, expected):
        assert args[1] is x and args[2] is y
        got = dict(zip(GRADIENT_OPTIONS, args[3:]))
        assert got == want
        assert [type(v) for v in got.values()] == [type(v) for v in want.values()], got


def _default(function, name):
    return inspect.signature(function).parameters[name].default


def test_gradient_and_attach_defaults_are_the_lists():
    gradient = inspect.signature(shmgrad.Client.gradient).parameters
    for native, source in _client.GRADIENT_OPTION_SOURCES.items():
        if source is None:
            continue
        assert source in gradient, f"GRADIENT_OPTION_SOURCES: gradient() has no {source!r}"
        default = gradient[source].default
        if default is None or source == "reduction":
            continue  # derived per call (the client's default, the loss's reduction, a seed)
        assert default == GRADIENT_OPTIONS[native].default, (source, default)
        assert type(default) is type(GRADIENT_OPTIONS[native].default) or source == "accumulate"
    # The client-wide defaults of what gradient() leaves at None, wherever they are taken.
    for function in (shmgrad.Client.__init__, shmgrad.attach, shmgrad.Engine.__init__):
        for name in ("min_examples_per_worker", "max_examples_per_pass"):
            assert _default(function, name) == GRADIENT_OPTIONS[name].default, (function, name)
        assert _default(function, "buffers") == "average"  # average_buffers
    assert _default(shmgrad.attach, "timeout") == ATTACH_OPTIONS["timeout_seconds"].default
    for function in (_engine.Server.stop, shmgrad.Engine.close):
        assert _default(function, "timeout") == DEFAULTS["stop_timeout"]
    lightning = pytest.importorskip("shmgrad.lightning")  # the strategy's step options
    strategy = lightning.EngineStrategy.__init__
    assert _default(strategy, "timeout") == GRADIENT_OPTIONS["timeout_seconds"].default
    assert _default(strategy, "max_retries") == GRADIENT_OPTIONS["max_retries"].default


# serve's options that shmgrad.serve() does not take under their own name, and why.
SERVE_NOT_IN_PYTHON = {
    "model_path": "model= (a module is saved first)",
    "auto_placement": 'workers="auto"',
    "numerics": "always the trainer's own",
    "status_fd": "the launcher's pipe",
    "quiet": "the engine's output goes to Engine.log()",
}


def test_serve_and_engine_take_serves_options_with_its_defaults():
    user = {n for n, o in SERVE_OPTIONS.items() if not o.internal}
    for function in (shmgrad.serve, shmgrad.Engine.__init__):
        params = inspect.signature(function).parameters
        missing = user - set(params) - set(SERVE_NOT_IN_PYTHON)
        assert not missing, f"{function.__qualname__} lacks serve's {sorted(missing)}"
        for name in user & set(params):
            default = params[name].default
            assert default is None or default == SERVE_OPTIONS[name].default, (name, default)
    assert set(SERVE_NOT_IN_PYTHON) <= user


def test_the_launcher_gives_each_option_its_flag_from_the_list():
    fields = {f.name: f for f in dataclasses.fields(_launcher.ServeOptions)}
    assert set(fields) - {"eager_job"} <= set(SERVE_OPTIONS), set(fields) - set(SERVE_OPTIONS)
    for name, field in fields.items():
        if field.default is not dataclasses.MISSING and field.default is not None:
            assert field.default == SERVE_OPTIONS[name].default, name
    given = _launcher.ServeOptions(
        name="n",
        model_path="m.pt",
        workers=3,
        loss="mse",
        dataset="fashion-mnist",
        max_workers=4,
        devices=(0, 1),
        numerics="cudnn_tf32=1",
    )
    args = given.arguments()
    pairs = dict(zip(args[::2], args[1::2]))
    flags = {o.flag.split(" ")[0]: n for n, o in SERVE_OPTIONS.items()}
    assert set(pairs) <= set(flags), set(pairs) - set(flags)
    for flag, value in pairs.items():
        expected = getattr(given, flags[flag])
        expected = ",".join(map(str, expected)) if isinstance(expected, tuple) else str(expected)
        assert value == expected, (flag, value)
    assert "--threads-per-worker" not in dataclasses.replace(given, workers="auto").arguments()
    # The eager job's options are the launchers' (hidden in --help).
    job = _job.EagerJob("d", "holder.bin", "job.pkl", 2, "mean")
    internal = {o.flag.split(" ")[0] for o in SERVE_OPTIONS.values() if o.internal}
    assert set(job.serve_arguments()[::2]) <= internal, job.serve_arguments()


def test_serve_eager_names_serves_own_flags():
    # `shmgrad serve --eager` re-execs serve with these (its own --eager aside).
    from shmgrad import _serve_eager

    flags = {o.flag.split(" ")[0] for o in SERVE_OPTIONS.values() if o.flag}
    named = set(re.findall(r"""["'](--[a-z][a-z-]*)["']""", inspect.getsource(_serve_eager)))
    assert named and named - {"--eager"} <= flags, named - flags


def test_serve_help_is_the_list():
    out = subprocess.run(
        [shmgrad.program("shmgrad"), "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for option in SERVE_OPTIONS.values():
        if not option.flag:
            continue
        flag, _, value_name = option.flag.partition(" ")
        at = [i for i, line in enumerate(lines) if re.match(rf"\s+{flag}\b", line)]
        if option.internal:
            assert not at, f"{flag} is the launchers': hidden in --help"
            continue
        assert len(at) == 1, (flag, out.stdout)
        column = re.split(r"\s{2,}", lines[at[0]].strip())[0]  # "--max-batch N:INT ...=65536"
        if value_name:
            assert column.split()[1].startswith(value_name), (flag, column)
        # The default, where it is a value (not 0, -1, empty or a switch's: the doc says).
        shown = option.default
        if isinstance(shown, (int, float)) and not isinstance(shown, bool) and shown > 0:
            assert column.endswith(f"={shown:g}"), (flag, column, shown)
        elif isinstance(shown, str) and shown:
            assert column.endswith(f"={shown}"), (flag, column, shown)
        else:
            assert "=" not in column, (flag, column)
        text = " ".join(" ".join(lines[at[0] : at[0] + 6]).split())
        first_line = " ".join(option.doc.splitlines()[0].split())
        assert first_line in text, (flag, first_line, text)


def test_stop_help_shows_the_stop_timeout():
    out = subprocess.run(
        [shmgrad.program("shmgrad"), "stop", "--help"], capture_output=True, text=True, timeout=60
    )
    timeout = f"{DEFAULTS['stop_timeout']:g}"
    assert f"S:FLOAT in [0 - 86400]={timeout}" in out.stdout, out.stdout
    assert f"(default {timeout} s)" in out.stdout, out.stdout


def test_engine_module_defaults_are_not_restated():
    # The sources give no literal default for what the lists declare (ipc/config.h's are
    # taken through DEFAULTS): they name the list.
    for module in (_client, _engine, _launcher):
        source = inspect.getsource(module)
        for literal in ("= 600.0", "= 30.0", 'buffers: str = "average"', "max_retries: int = 3"):
            assert literal not in source, (module.__name__, literal)
