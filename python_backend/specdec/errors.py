"""Errors the core raises; adapters map them to Triton error codes."""

from __future__ import annotations


class SpecDecError(Exception):
    """Base class of the project's errors."""


class InvalidRequestError(SpecDecError):
    """A request parameter is invalid; the message names the field (maps to INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UnsupportedError(InvalidRequestError):
    """A recognised parameter asks for something this server does not do (never silently ignored)."""


class CapacityError(SpecDecError):
    """No KV slot or context room is left (maps to UNAVAILABLE / resource exhausted)."""


class SequenceStateError(SpecDecError):
    """A step arrived for a sequence whose KV slot does not exist (expired or never started)."""


class DeadlineExceededError(CapacityError):
    """A generation ran past its deadline (the server's limit or the request's timeout); maps to UNAVAILABLE."""
