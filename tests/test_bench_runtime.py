"""bench/runtime.py: its confidence interval for a median of pairs (the order statistics the binomial tails give,
at least the promised coverage), its load generator's reading of a streamed response (token count, end) and its
steady-state window."""
import math
import random

import pytest

from bench.runtime import median_ci


def test_interval_is_the_binomial_order_statistics():
    # n = 20 at 90%: P(Bin(20, 1/2) <= 5) = 0.0207 <= 0.05 < P(<= 6) = 0.0577, so x_(6) and x_(15)
    assert median_ci([float(x) for x in range(20, 0, -1)]) == (6.0, 15.0)
    assert median_ci(list(range(1, 61))) == (24, 37)  # n = 60: j = 24
    assert median_ci([1.0, 2.0, 3.0]) == (1.0, 3.0)  # too few pairs for any j: the whole range
    assert median_ci([0.9] * 7) == (0.9, 0.9)


def test_coverage_is_at_least_the_level():
    for n in (5, 10, 20, 40, 60, 100):
        s = sorted(median_ci(list(range(n))))
        j = s[0] + 1  # x_(j) is the j-th smallest of 0..n-1
        tail = sum(math.comb(n, i) for i in range(j)) / 2 ** n
        assert 1 - 2 * tail >= 0.90 or j == 1, n
        if j > 1:  # and the next order statistic in would not be: the interval is the tightest such
            assert 1 - 2 * (tail + math.comb(n, j) / 2 ** n) < 0.90, n
    rng = random.Random(7)
    hits = sum(lo <= math.log(2) <= hi for lo, hi in
               (median_ci([rng.expovariate(1.0) for _ in range(25)]) for _ in range(2000)))
    assert hits / 2000 >= 0.88  # the exact coverage at n = 25 is 0.957; 2000 draws keep it well above 0.88


def _chunked(events: list[bytes], cuts: list[int]) -> bytes:
    """A 200 chunked SSE response carrying `events`, its body cut into chunks at byte offsets `cuts`."""
    body = b"".join(events)
    edges = [0, *cuts, len(body)]
    chunks = b"".join(b"%x\r\n%s\r\n" % (b - a, body[a:b]) for a, b in zip(edges, edges[1:]) if b > a)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunks + b"0\r\n\r\n")


def test_the_clients_count_tokens_across_chunk_cuts():
    from bench.runtime import _tokens

    events = [b'data: {"choices":[{"index":0,"text":"a\\r\\n0","token_ids":[1,2,3]}]}\n\n',
              b'data: {"choices":[{"index":0,"text":"","token_ids":[4]}]}\n\n',
              b'data: {"choices":[{"index":0,"text":"b","token_ids":null,"finish_reason":"length"}]}\n\n',
              b"data: [DONE]\n\n"]
    assert _tokens(_chunked(events, [])) == 4
    assert _tokens(_chunked(events, [3, 40, 41, 90, 150])) == 4  # events split over chunks, chunks over events
    with pytest.raises(RuntimeError, match="answered"):
        _tokens(b'HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n{}')
    with pytest.raises(RuntimeError, match="chunked"):
        _tokens(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")


def test_the_clients_stream_ends_with_the_zero_chunk_or_an_error_status():
    import asyncio

    from bench.runtime import _Conn

    async def feed(pieces: list[bytes]) -> list[bool]:
        conn = _Conn()
        conn.ended = asyncio.get_running_loop().create_future()
        seen = []
        for piece in pieces:
            conn.data_received(piece)
            seen.append(conn.ended.done())
        return seen

    raw = _chunked([b'data: {"choices":[{"token_ids":[1]}]}\n\n', b"data: [DONE]\n\n"], [10])
    cut = len(raw) - 3  # the last piece completes the zero-size chunk
    assert asyncio.run(feed([raw[:20], raw[20:cut], raw[cut:]])) == [False, False, True]
    assert asyncio.run(feed([b"HTTP/1.1 5", b"03 Service Unavailable\r\n"])) == [False, True]


def test_the_steady_window_counts_each_request_by_its_time_inside():
    from bench.runtime import _in_window

    spans = [(0.0, 2.0, 10), (2.0, 4.0, 10), (4.0, 6.0, 10), (9.0, 11.0, 10), (11.0, 13.0, 10)]
    assert _in_window(spans, 3.0, 10.0) == pytest.approx(5 + 10 + 5)  # none, half, all, half, none
    assert _in_window(spans, 0.0, 13.0) == pytest.approx(50)
    assert _in_window([(1.0, 1.0, 4)], 0.0, 2.0) == 0  # an empty span counts nothing (no division by zero)
