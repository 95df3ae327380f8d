"""Fixtures of the chart tests: each value profile rendered once (real Helm, no cluster)."""

from __future__ import annotations

import pytest

from tests.helm.profiles import PROFILES
from tests.support.chart import render_objects, workloads_from_objects

_CACHE: dict[str, list[dict]] = {}


def objects_for(profile: str) -> list[dict]:
    if profile not in _CACHE:
        _CACHE[profile] = render_objects(PROFILES[profile])
    return _CACHE[profile]


@pytest.fixture(params=sorted(PROFILES))
def profile(request) -> str:
    return request.param


@pytest.fixture
def objects(profile) -> list[dict]:
    return objects_for(profile)


@pytest.fixture
def workloads(objects) -> list[dict]:
    return workloads_from_objects(objects)
