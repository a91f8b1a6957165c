"""Errors that several layers raise: kept below all of them, so that none imports another for its error."""

from __future__ import annotations

from typing import List

#: How many problems a :class:`SyncValidationError` message lists (all are in ``err.problems``).
MAX_LISTED = 50


class SyncValidationError(ValueError):
    """Every problem found in one weight sync, raised before any of it reaches the engine.

    Args:
        problems: one human-readable line per problem (``"<name>: <what is wrong>"``).
        context: what was being synced (e.g. ``"weight sync 3"``); prefixes the message.

    ``str(err)`` lists the first :data:`MAX_LISTED` problems and ``"... and N more"``; ``err.problems``
    holds all. Survives pickling (Ray sends exceptions between processes).
    """

    def __init__(self, problems: List[str], context: str = ""):
        self.problems = list(problems)
        self.context = context
        head = f"{context}: " if context else ""
        lines = [f"  {p}" for p in self.problems[:MAX_LISTED]]
        if len(self.problems) > MAX_LISTED:
            lines.append(f"  ... and {len(self.problems) - MAX_LISTED} more")
        n = len(self.problems)
        super().__init__(f"{head}{n} problem{'s' if n != 1 else ''} in the weight sync:\n" + "\n".join(lines))

    def __reduce__(self):
        return (type(self), (self.problems, self.context))
