"""The executor's one error (:mod:`.executor`, :mod:`.scheduler`, :mod:`.standins`), in a module of its own
so that the references can raise it without importing the executor that loads them."""

from __future__ import annotations

from ms_deepseek.core.errors import UserError


class ExecutionError(UserError):
    """A compiled program could not be executed as MindSpore would run it (names the rank and the operator)."""
