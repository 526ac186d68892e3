"""What a step of the search is, and the registry of steps by name (each target lists the steps it runs:
``candidates.Target.steps``)."""
from __future__ import annotations

from typing import ClassVar, Optional

from qdeploy.utils.registry import registrar

STEPS: dict[str, type["Step"]] = {}
register_step = registrar(STEPS, "optimize step", key=lambda cls: cls.name)


class Step:
    """One step of a search: it proposes one kind of candidate, measures them through the session
    (``session.SearchSession``) and says why in the session's decisions. ``run`` is called once, in the target's
    order; ``after_choice`` once the answer is chosen on the search split (before the confirm split)."""

    name: ClassVar[str] = "step"

    def __init__(self, session):
        self.s = session

    def run(self) -> None:
        raise NotImplementedError

    def after_choice(self, chosen: Optional[object]) -> None:
        """What the step adds once the answer is chosen (a diagnostic): nothing by default."""
