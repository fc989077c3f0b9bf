"""``python -m ulysses_sp train ...``: the same as the ``ulysses-sp`` command."""

from ulysses_sp.cli import console

if __name__ == "__main__":
    console()
