"""The one retry policy: delays double from initial to maximum; statuses that mean 'later'."""

import pytest

from ddnn.errors import ConfigError
from ddnn.plumbing.retry import RETRY_STATUSES, RetryPolicy


def test_delays_double_up_to_the_maximum():
    p = RetryPolicy(initial=0.5, maximum=3.0)
    assert [p.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_backoff_resets_after_a_success():
    b = RetryPolicy(initial=0.25, maximum=10.0).backoff()
    assert b.ready()
    assert [b.failed(), b.failed(), b.failed()] == [0.25, 0.5, 1.0]
    assert not b.ready()
    b.succeeded()
    assert b.ready() and b.failures == 0
    assert b.failed() == 0.25


def test_statuses():
    p = RetryPolicy()
    assert all(p.retryable(s) for s in (408, 429, 503))
    assert not any(p.retryable(s) for s in (200, 400, 401, 404, 413))
    with_auth = RetryPolicy(retry_statuses=RETRY_STATUSES | {401, 403})
    assert with_auth.retryable(401) and not p.retryable(403)


@pytest.mark.parametrize(("initial", "maximum"), [(0, 1), (-1, 1), (2, 1)])
def test_bad_policies_are_refused(initial, maximum):
    with pytest.raises(ConfigError):
        RetryPolicy(initial=initial, maximum=maximum)
