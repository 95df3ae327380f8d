"""Helpers of the local demo and the tests: a private Redis, a process supervisor, a tiny target."""
