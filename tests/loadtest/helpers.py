"""Synthetic records with hand-chosen timelines, for the report and sweep tests."""

from __future__ import annotations

from kvserve.loadtest.records import RequestRecord, Status

T0 = 1_800_000_000.0  # an arbitrary wall-clock origin


def timeline(
    send: float,
    first: float,
    gap: float,
    tokens: int,
    status: Status = "ok",
    scenario: str = "chat",
    done_after: float = 0.001,
) -> RequestRecord:
    """A request sent at T0 + ``send`` whose ``tokens`` tokens stream one per chunk,
    the first ``first`` s after the send, then every ``gap`` s; done ``done_after`` later."""
    times = [round(first + gap * i, 6) for i in range(tokens)]
    return RequestRecord(
        send_time=T0 + send,
        status=status,
        end_s=round(times[-1] + done_after, 6),
        scenario=scenario,
        first_token_s=times[0],
        last_token_s=times[-1],
        chunk_times_s=times,
        output_tokens=tokens,
        prompt_tokens=100,
        cached_tokens=40,
        finish_reason="length" if status == "ok" else None,
        http_status=200,
    )


def failed(send: float, after: float = 0.05, error: str = "HTTP 503: overloaded") -> RequestRecord:
    return RequestRecord(
        send_time=T0 + send, status="error", end_s=after, http_status=503, error=error
    )


def cohort_100() -> list[RequestRecord]:
    """The worked check: a 10 s closed cohort of 100 requests, 98 succeed, 95 meet the SLO.

    SLO TTFT ≤ 1000 ms, TPOT ≤ 100 ms. Sends every 0.098 s from 0; the last request is done
    at exactly 10 s (sent at 9.7, done 0.3 s later), so the window is 10 s.
    """
    recs: list[RequestRecord] = []
    for i in range(100):
        send = round(i * 0.098, 6)
        if i in (10, 20):  # 2 failures
            recs.append(failed(send))
        elif i in (30, 40):  # 2 too slow to start: TTFT 1.5 s
            recs.append(timeline(send, 1.5, 0.025, 10))
        elif i == 50:  # 1 too slow per token: TPOT 150 ms
            recs.append(timeline(send, 0.19, 0.150, 5))
        else:
            recs.append(timeline(send, 0.19, 0.025, 4))
    last = recs[-1]
    last.end_s = round(10.0 - (last.send_time - T0), 6)
    return recs
