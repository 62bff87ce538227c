"""A running engine's state as data: what ``shmgrad status NAME`` prints, field by field.

Read from the engine's shared-memory segment alone, so it works for any engine of this
user, also while another trainer holds it (and from a thread while this process's own
:meth:`Client.gradient` runs).
"""

import dataclasses
from typing import List, Optional

from ._native import _C


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _record(name, extra=(), namespace=None, doc=""):
    """A frozen dataclass with the fields of the native record ``name`` (engine/control.h's
    field lists, through ``_C.RECORDS``), then ``extra`` (Python-only fields)."""
    fields, lines = [], []
    for field, type_name, comment in _C.RECORDS[name]:
        kind, _, item = type_name.partition(":")
        fields.append((field, List[item] if kind == "list" else _TYPES.get(kind, object)))
        lines.append(f"    ``{field}``" + (f": {comment}" if comment else ""))
    doc = (
        (doc + "\n\n" if doc else "")
        + "Fields (as the engine defines them):\n\n"
        + "\n".join(lines)
    )
    cls = dataclasses.make_dataclass(
        name, fields + list(extra), frozen=True, namespace=dict(namespace or {}, __doc__=doc)
    )
    cls.__module__ = "shmgrad"
    return cls


WorkerStatus = _record("WorkerStatus", doc="One worker slot.")
StepSummary = _record(
    "StepSummary", doc="One finished step, from the engine's ring of recent steps."
)


class _EngineStatusMethods:
    @property
    def ready_workers(self) -> List[WorkerStatus]:
        """The workers in state ``ready``, by slot."""
        return [w for w in self.workers if w.state == "ready"]

    def worker(self, slot: int) -> Optional[WorkerStatus]:
        """Slot ``slot``'s status, or None if it has never had a process."""
        return next((w for w in self.workers if w.slot == slot), None)

    @classmethod
    def from_native(cls, d: dict, text: str) -> "EngineStatus":
        """Builds one from ``_C.status(name)``'s dict and ``_C.format_status(name)``."""
        plain = {f: d[f] for f, _, _ in _C.RECORDS["EngineStatus"]}
        plain["workers"] = [WorkerStatus(**w) for w in d["workers"]]
        plain["recent_steps"] = [StepSummary(**r) for r in d["recent_steps"]]
        return cls(**plain, text=text)


EngineStatus = _record(
    "EngineStatus",
    extra=[
        # What `shmgrad status NAME` prints; read a moment after the other fields, so a
        # busy engine's text may show a later step than they do.
        ("text", str),
        # Why the workers are of this kind, as the process that started the engine chose
        # it (Engine.mode_reason); "" when read by a process that did not start it.
        ("mode_reason", str, dataclasses.field(default="")),
        # An engine started with workers="auto", as its trainer (this process) probed it:
        # per candidate {"workers", "threads_per_worker", "ms_per_example", "steps"}, and
        # the probe in one line ("" and () elsewhere).
        ("placement_probe", tuple, dataclasses.field(default=())),
        ("placement_report", str, dataclasses.field(default="")),
    ],
    namespace={k: v for k, v in vars(_EngineStatusMethods).items() if not k.startswith("__")},
    doc="An engine's state, as :meth:`Client.status` and :func:`read_status` return it. "
    "``text`` is what ``shmgrad status NAME`` prints; ``mode_reason`` why the workers are "
    "of their kind (known to the process that started the engine); ``placement_probe`` "
    "and ``placement_report`` the placement probe of an engine started with "
    '``workers="auto"`` (known to its trainer).',
)


def read_status(name: str) -> EngineStatus:
    """The status of the engine ``name`` (without attaching to it).

    Raises EngineNotFoundError if there is none.
    """
    return EngineStatus.from_native(_C.status(name), _C.format_status(name))
