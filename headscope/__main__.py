"""The ``headscope`` command's process entry (the installed ``headscope`` script, ``python -m headscope``): garbage
collection tuned for a command process (:func:`headscope.runtime.lean_gc`) before the command line's heavy imports,
then the typer app of :mod:`headscope.cli`."""

from .runtime import lean_gc


def main() -> None:
    """Run the ``headscope`` command line in this process (exit code: the command's)."""
    lean_gc()
    from .cli import app

    app()


if __name__ == "__main__":
    main()
