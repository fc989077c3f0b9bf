"""The sequence-length curriculum of ``--seq-len-schedule``: a piecewise-constant length over optimizer steps."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SeqLenSchedule"]


@dataclass(frozen=True)
class SeqLenSchedule:
    """A piecewise-constant sequence length over optimizer steps.

    ``stages`` holds ``(seq_len, until_step)`` pairs; a stage applies to the steps before ``until_step``
    (steps count from 0), and the last stage has ``until_step=None`` and applies forever.
    """

    stages: tuple[tuple[int, int | None], ...]

    @classmethod
    def parse(cls, text: str, default_seq_len: int) -> SeqLenSchedule:
        """Parse ``"8192:100,32768:200,131072"``: 8192 for steps 0-99, 32768 for 100-199, then 131072.

        An empty text means a fixed ``default_seq_len``. When the last entry has an end step
        (``"8192:100"``), training continues at ``default_seq_len`` (the ``--seq-len`` value) after it.
        """
        text = text.strip()
        if not text:
            return cls(((default_seq_len, None),))
        stages: list[tuple[int, int | None]] = []
        entries = [entry.strip() for entry in text.split(",")]
        for position, entry in enumerate(entries):
            is_last = position == len(entries) - 1
            length_text, sep, step_text = entry.partition(":")
            try:
                seq_len = int(length_text)
                until = int(step_text) if sep else None
            except ValueError:
                raise ValueError(
                    f"--seq-len-schedule: cannot parse entry {entry!r} of {text!r}; expected LEN:UNTIL_STEP "
                    "entries separated by commas, the last one optionally without a step, "
                    "e.g. '8192:100,32768:200,131072'"
                ) from None
            if seq_len < 1:
                raise ValueError(f"--seq-len-schedule: sequence length must be >= 1, got {seq_len} in {entry!r}")
            if until is None and not is_last:
                raise ValueError(
                    f"--seq-len-schedule: entry {entry!r} has no end step but is not the last entry of "
                    f"{text!r}; write it as LEN:UNTIL_STEP, e.g. '{seq_len}:100'"
                )
            if until is not None:
                previous = stages[-1][1] if stages else 0
                if until <= previous:
                    raise ValueError(
                        f"--seq-len-schedule: end steps must be positive and increasing, got {until} after "
                        f"{previous} in {text!r}"
                    )
            stages.append((seq_len, until))
        if stages[-1][1] is not None:
            stages.append((default_seq_len, None))
        return cls(tuple(stages))

    @staticmethod
    def follows_default(text: str) -> bool:
        """Whether the schedule ``text`` ever uses ``default_seq_len`` (the ``--seq-len`` value): when it is
        empty or its last entry has an end step (``"8192:100"``), not when the last entry holds to the end."""
        text = text.strip()
        return not text or ":" in text.split(",")[-1]

    def seq_len_at(self, step: int) -> int:
        """The sequence length used at optimizer step ``step`` (0-based)."""
        for seq_len, until in self.stages:
            if until is None or step < until:
                return seq_len
        raise AssertionError("the last stage of a schedule has no end step")

    @property
    def max_seq_len(self) -> int:
        """The longest sequence length any stage uses."""
        return max(seq_len for seq_len, _ in self.stages)

    @property
    def is_fixed(self) -> bool:
        """True when the schedule has a single stage."""
        return len(self.stages) == 1
