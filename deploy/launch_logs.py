"""The folder ``pdserve launch`` writes its children's logs to, and when it goes away.

A folder launch made itself (a fresh temp folder) is removed when the launch ends cleanly
and kept, with its path printed, when it fails: the logs are what explains the failure. A
folder the user named with ``--log-dir`` is theirs and is never removed.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

TEMP_PREFIX = "pdserve-launch-"


@dataclass(frozen=True)
class LaunchLogs:
    """The launch's log folder and whether launch made it (and so may remove it)."""

    path: Path
    owned: bool

    @classmethod
    def create(cls, given: str | None) -> LaunchLogs:
        """The user's ``--log-dir`` (made if missing), else a new temp folder of our own."""
        if given:
            path = Path(given)
            path.mkdir(parents=True, exist_ok=True)
            return cls(path, owned=False)
        return cls(Path(tempfile.mkdtemp(prefix=TEMP_PREFIX)), owned=True)

    def describe(self) -> str:
        """Where the logs are, and whether they outlive a clean exit."""
        return f"logs in {self.path}" + (" (removed on a clean exit)" if self.owned else "")

    def finish(self, exit_code: int) -> str | None:
        """Remove an owned folder after a clean exit (``exit_code`` 0), or one still empty
        (nothing started, nothing to read); otherwise keep it. The line to print, if any."""
        empty = not any(self.path.iterdir()) if self.path.is_dir() else True
        if self.owned and (exit_code == 0 or empty):
            shutil.rmtree(self.path, ignore_errors=True)
            return None
        return f"logs kept in {self.path}" if exit_code != 0 else None
