"""Fault injection for the end-to-end tests: make one rank die, pause, or be killed mid-checkpoint.

Read from the environment variable ``ULYSSES_SP_TEST_FAULT`` = ``KIND:STEP[:RANK]`` (RANK defaults to 0):

- ``exit:STEP:RANK`` — after optimizer step STEP, that rank exits at once with status 43 (a crashed
  worker: the others must stop within bounded time, with a message naming the failure);
- ``pause:STEP`` — after step STEP is logged, every rank sleeps (so a test can kill the whole run at a
  known point);
- ``kill_in_save:STEP:RANK`` — that rank SIGKILLs itself inside the checkpoint save of step STEP, after
  every file is in the temporary directory and just before the save is committed.

Nothing happens when the variable is unset; it is never set outside tests.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

ENV_VAR = "ULYSSES_SP_TEST_FAULT"
KINDS = ("exit", "pause", "kill_in_save")
EXIT_STATUS = 43


@dataclass(frozen=True)
class Fault:
    """One planned fault; see the module docstring."""

    kind: str
    step: int
    rank: int = 0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Fault | None:
        """The fault in ``ULYSSES_SP_TEST_FAULT``, or None; ValueError for a malformed value."""
        text = (environ if environ is not None else os.environ).get(ENV_VAR, "").strip()
        if not text:
            return None
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[0] not in KINDS or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"{ENV_VAR}={text!r}: expected KIND:STEP[:RANK] with KIND in {KINDS}")
        return cls(parts[0], *(int(p) for p in parts[1:]))

    def after_step(self, step: int, rank: int) -> None:
        """Called by every rank after step ``step`` is done and logged."""
        if step != self.step:
            return
        if self.kind == "exit" and rank == self.rank:
            print(f"[test fault] rank {rank} exits with status {EXIT_STATUS} after step {step}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(EXIT_STATUS)
        if self.kind == "pause":
            time.sleep(3600)

    def in_save(self, step: int, rank: int) -> None:
        """Called by every rank inside the checkpoint save of step ``step``, before it is committed."""
        if self.kind == "kill_in_save" and step == self.step and rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
