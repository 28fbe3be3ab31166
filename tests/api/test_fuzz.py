"""Hostile bodies against a real server: no response is a 500 or a stall, every error has OpenAI's
shape, and /health answers within 100 ms throughout. A bounded, derandomized run in CI; a longer,
random one with `pytest tests/api/test_fuzz.py --fuzz-examples 5000`."""

from __future__ import annotations

import collections

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from kiln.perf.probe import HealthProbe
from tests.api.fuzz import check, requests
from tests.api.server import AUTH, Server
from tests.conftest import FUZZ_REPORT

pytestmark = pytest.mark.slow

CI_EXAMPLES = 400
STALL_S = 60  # the longest any one request may take: the tiny model's worst case is a few seconds


def test_fuzz(tiny_server: Server, request: pytest.FixtureRequest) -> None:
    examples = request.config.getoption("--fuzz-examples") or CI_EXAMPLES
    statuses: collections.Counter[tuple[str, int]] = collections.Counter()

    @settings(
        max_examples=examples,
        derandomize=examples == CI_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests())
    def one(path_body: tuple[str, bytes]) -> None:
        path, body = path_body
        stream = b'"stream":true' in body
        response = client.post(path, content=body, headers={**AUTH, "Content-Type": "application/json"})
        statuses[(path, response.status_code)] += 1
        check(response, stream, path)

    with (
        HealthProbe(tiny_server.url) as probe,
        httpx.Client(base_url=tiny_server.url, timeout=STALL_S) as client,
    ):
        one()
    by_status = collections.Counter(status for _, status in statuses.elements())
    request.config.stash.setdefault(FUZZ_REPORT, []).extend(
        [
            f"{sum(statuses.values())} requests ({examples} examples): "
            + ", ".join(f"{s}: {c}" for s, c in sorted(by_status.items())),
            *(f"  {path} {s}: {c}" for (path, s), c in sorted(statuses.items())),
            probe.summary(),
        ]
    )
    assert set(probe.statuses) == {200}
    assert probe.p99() < 0.1, probe.summary()
    after = httpx.post(
        f"{tiny_server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=30
    )
    assert after.status_code == 200, after.text  # and the server still serves
