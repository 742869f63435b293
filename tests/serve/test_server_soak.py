"""A short soak of serve/server.py (bench/server_soak.py, 2 s phases): normal requests beside hostile
ones (300 MB bodies, endless chunked bodies, JSON nested 50,000 deep, 1,001-field forms, beams of 400,
requests over the token budget, slow clients) are all answered 200, each hostile kind gets its 4xx and never
a 500, the server's memory stays flat under the hostile requests alone, and its stderr holds no traceback.
The latency ratio is the benchmark's to report (python bench/server_soak.py), not a timed test's to assert."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from server_soak import percentile, soak  # noqa: E402


@pytest.mark.e2e  # (make e2e: a server under load for half a minute; make test: test_server.py's hostile requests)
def test_normal_requests_are_served_and_the_server_keeps_its_memory_under_hostile_load(trained: Path):
    # One decoder thread: each one's memory (oneDNN's scratchpads are per thread) grows to its own peak as
    # batches of new shapes land on it, which 2-second phases do not see the end of with several.
    result = soak(str(trained), seconds=2.0, clients=4, slow=10, pause=0.05, server_flags=["--workers", "1"])
    normal, hostile = (percentile(result.latencies[load], 0.5) * 1000 for load in ("normal", "hostile"))
    summary = f"p50 {normal:.0f} ms alone, {hostile:.0f} ms beside the hostile load; {result.hostile}; RSS {result.rss}"
    assert set(result.statuses["normal"]) == {200} == set(result.statuses["hostile"]), summary
    expected = {"300 MB body": 413, "endless chunked": 413, "deep JSON": 400, "1001 fields": 400, "beam 400": 400,
                "over budget": 400, "slow client": 408}
    for kind, status in expected.items():
        assert status in result.hostile[kind] and 500 not in result.hostile[kind], summary
    assert result.growth() <= 50, summary  # MiB over the first normal phase: buffers, the decoder's batches
    # Then two rounds of the hostile clients alone, with nothing decoding: flat to 2 MiB (0.0-0.3 in runs
    # here). Not the rounds beside normal load: the decoder's memory grows there, to a peak it reached in
    # about 40 s here, as batches of sizes not seen before come. RSS does not show a leak that fits in the
    # memory glibc keeps freed; test_server.py's test_hostile_requests_leave_no_memory_behind does.
    assert result.rss["hostile alone 2"] - result.rss["hostile 2"] <= 2, summary
    assert "Traceback" not in result.stderr and result.stderr.count("\n") <= 3, result.stderr[-3000:]
