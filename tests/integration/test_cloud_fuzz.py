"""The cloud API under requests generated from its own OpenAPI document (schemathesis): no
generated request, valid or not, gets a 5xx answer from the real server.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.generation import GenerationMode  # noqa: E402

EXAMPLES = 25  # per operation and mode: the whole document in a few seconds


@pytest.mark.slow
def test_generated_requests_never_get_a_5xx(cloud_tiny_url):
    schema = schemathesis.openapi.from_url(f"{cloud_tiny_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path.endswith("/infer") for op in operations)
    failures: list[str] = []
    calls = 0
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def call(case):
                nonlocal calls
                response = case.call(base_url=cloud_tiny_url, timeout=10)
                calls += 1
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.formatted_path} -> "
                                    f"{response.status_code}: {response.text[:200]}")

            try:
                call()
            except Unsatisfiable:  # nothing to make invalid (a route without parameters)
                assert mode is GenerationMode.NEGATIVE
    assert calls >= len(operations) * EXAMPLES
    assert not failures, "\n".join(failures[:10])
