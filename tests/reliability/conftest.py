"""Fixtures of the reliability tests: the worker tests' real service, without Ray."""

from tests.workers.conftest import service, worker  # noqa: F401 (fixtures, offered here too)
