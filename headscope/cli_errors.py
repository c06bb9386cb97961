"""How the command line reports a user's mistake: one line ``error: ...`` on stderr and exit code 2 (every
``headscope`` command runs its work inside :func:`user_errors`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import typer


def expected_errors() -> tuple[type[BaseException], ...]:
    """The exception types the CLI reports as one line with exit code 2."""
    from .errors import HeadscopeInputError
    from .patching.receivers import GapError
    from .patching.store import ConfigMismatch

    return (HeadscopeInputError, GapError, ConfigMismatch, NotImplementedError)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn an expected error into ``error: <one line>`` on stderr and exit code 2; re-raise the rest."""
    try:
        yield
    except Exception as e:
        if not isinstance(e, expected_errors()):
            raise
        from .errors import one_line

        typer.echo(f"error: {one_line(e)}", err=True)
        raise typer.Exit(2) from None
