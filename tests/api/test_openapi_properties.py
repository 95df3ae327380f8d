"""Property-based tests of the API against its own OpenAPI document (schemathesis, in-process ASGI).

Every operation gets generated requests with a write key; each response must be no 5xx and match
the document (status code, content type, headers, body schema), and auth must be enforced. The document is read from an
app built at import; the requests go to an app on the test session's Redis.
"""

from __future__ import annotations

import pytest
import schemathesis
from dfp_api.app import create_app
from dfp_api.settings import ApiSettings
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from .conftest import WRITE_KEY, auth, key_entries

schema = schemathesis.openapi.from_asgi(
    "/openapi.json", create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0", api_keys=key_entries())))

# A submitted spec's storage URIs must lie inside the operator's storage roots and name endpoints the
# workers were configured with: facts of a deployment, not of the document, so a schema-valid spec
# may rightly get a 422 naming the field. Every other operation must accept what the document allows.
SPEC_CHECKED_AT_SUBMIT = {"POST /v1/jobs"}


@pytest.fixture
def live_app(make_app, redis_client):
    return make_app(rate_limit_per_s=100000.0, rate_limit_burst=100000, sse_poll_s=0.05)


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_matches_its_openapi_document(case, live_app):
    excluded = [positive_data_acceptance] if case.operation.label in SPEC_CHECKED_AT_SUBMIT else []
    case.call_and_validate(app=live_app, headers=auth(WRITE_KEY), excluded_checks=excluded)
