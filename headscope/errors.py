"""The exception type of expected user errors (issue #19).

:class:`HeadscopeInputError` is raised for bad arguments, missing files and unmet preconditions: the
message says what is wrong and how to fix it, and the ``headscope`` command prints it as one line
(exit code 2) instead of a traceback. It subclasses ValueError, so ``except ValueError`` keeps
working; the variants below also subclass the built-in type older code raised in their place, so
``except FileNotFoundError`` (etc.) keeps working too.
"""

from __future__ import annotations


class HeadscopeInputError(ValueError):
    """An expected user error: a bad argument, a missing file or an unmet precondition."""


class SettingError(HeadscopeInputError):
    """A bad value of one named setting. ``setting`` is its name as the caller spelled it (``n_pairs``), ``text``
    the message with ``{setting}`` where the name goes; :meth:`renamed` gives the same error under the name another
    interface uses for it (the ``headscope rank`` flag ``--pairs``)."""

    def __init__(self, setting: str, text: str):
        self.setting, self.text = setting, text
        super().__init__(text.replace("{setting}", setting))

    def renamed(self, names: "dict[str, str]") -> "SettingError":
        """This error with the setting named ``names[setting]`` (itself where ``names`` has no entry)."""
        new = names.get(self.setting)
        return self if new is None else type(self)(new, self.text)


class InputFileNotFoundError(HeadscopeInputError, FileNotFoundError):
    """A file or directory that the user named, or that a later step needs, does not exist."""


class InputFileExistsError(HeadscopeInputError, FileExistsError):
    """An output would overwrite results that the user did not ask to continue."""


class InputTypeError(HeadscopeInputError, TypeError):
    """An argument of an unsupported type (e.g. a model family that cannot be converted)."""


class InputRuntimeError(HeadscopeInputError, RuntimeError):
    """The machine lacks something a requested output needs (e.g. a browser for PNG export)."""


class InputNotImplementedError(HeadscopeInputError, NotImplementedError):
    """A combination of options that headscope does not support."""


def one_line(e: BaseException) -> str:
    """The message of ``e`` on one line (newlines and runs of spaces collapsed)."""
    return " ".join(str(e).split()) or type(e).__name__
