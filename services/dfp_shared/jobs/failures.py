"""Failures no retry can mend: the worker fails the job at once with the reason, and acks the task."""

from __future__ import annotations


class CannotSucceed(Exception):
    """The task can never succeed as specified (a refused model, a spec the worker rejects): its job
    fails at once with this message instead of being retried and dead-lettered."""


class ModelRefused(CannotSucceed):
    """A model the services will not load (e.g. weights only as a pickle, which would run code)."""
