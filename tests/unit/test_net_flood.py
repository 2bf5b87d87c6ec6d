"""The cheap parts of flood handling: REFUSED built from a query's header, the summary
lines that stand for many packets, and the memory of learned elements (issue 17.5, 17.6)."""

from __future__ import annotations

from ipaddress import IPv4Address

import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import pytest

from hutch.config import NetLimits
from hutch.contract.views import EgressEvent
from hutch.net.dns_io import refused_reply
from hutch.net.egress_log import EgressLog
from hutch.net.learned import LearnedElements
from hutch.net.nft_apply import SandboxCounters
from hutch.net.nft_sandbox import LearnedAddress
from hutch.net.summaries import Summaries

SID = "sb-0123456789ab"


# -- refused_reply ------------------------------------------------------------------------


@pytest.mark.parametrize("edns", [False, True])
def test_refused_reply_repeats_id_and_question(edns: bool) -> None:
    query = dns.message.make_query("x1.flood.test", "A", use_edns=0 if edns else None)
    wire = query.to_wire()
    reply = dns.message.from_wire(refused_reply(wire) or b"")
    assert query.is_response(reply), "stub resolvers ignore a reply without the question"
    assert reply.rcode() == dns.rcode.REFUSED
    assert reply.flags & dns.flags.QR and reply.flags & dns.flags.RD
    assert reply.opcode() == dns.opcode.QUERY
    assert (len(reply.answer), len(reply.additional)) == (0, 0)


def test_refused_reply_drops_what_it_cannot_read_cheaply() -> None:
    wire = dns.message.make_query("good.test", "A").to_wire()
    assert refused_reply(wire[:11]) is None  # no header
    assert refused_reply(wire[:-2]) is None  # question cut short
    response = dns.message.make_response(dns.message.make_query("good.test", "A"))
    assert refused_reply(response.to_wire()) is None  # answers are not answered
    compressed = wire[:12] + b"\xc0\x0c" + b"\x00\x01\x00\x01"
    assert refused_reply(compressed) is None
    # Never terminated. (Not a repeat of the whole message: the query id at random
    # would then now and then read as a label that ends the name.)
    endless = wire[:12] + (b"\x3f" + b"a" * 63) * 6
    assert refused_reply(endless) is None
    no_question = wire[:4] + b"\x00\x00" + wire[6:12]
    assert refused_reply(no_question) == (no_question[:2] + b"\x81\x85" + b"\x00" * 8), (
        "header only, QR RD RA REFUSED"
    )


# -- summaries --------------------------------------------------------------------------


def test_refusals_become_one_line_and_exact_counts() -> None:
    log = EgressLog()
    summaries = Summaries(log, NetLimits(dns_rate=50, dns_burst=60), clock=lambda: 1.5e9)
    summaries.refused(SID, "dns", 12_345, 1.0)
    summaries.refused(SID, "proxy", 7, 1.0)
    summaries.refused(SID, "dns", 0, 1.0)  # nothing: no line
    events = log.events(SID)
    assert [(e.protocol, e.port, e.verdict) for e in events] == [
        ("dns", 53, "deny"),
        ("tcp", None, "deny"),
    ]
    assert "12345 DNS queries answered REFUSED" in events[0].reason
    assert "limit 50/s, burst 60 per sandbox" in events[0].reason
    assert "7 new proxy connections closed" in events[1].reason
    assert log.rate_limited(SID) == 12_352
    assert log.counters(SID) == (0, 0), "summary lines are not denials of their own"


def test_kernel_counters_give_lines_only_when_they_grow() -> None:
    log = EgressLog()
    summaries = Summaries(log, NetLimits(), clock=lambda: 1.5e9)
    other = "sb-ba9876543210"
    summaries.kernel(
        {SID: SandboxCounters(0, 100, unlogged=60, rate_limited=9000), other: SandboxCounters(0, 3)}
    )
    summaries.kernel(
        {SID: SandboxCounters(0, 100, unlogged=60, rate_limited=9000), other: SandboxCounters(0, 3)}
    )
    summaries.kernel({SID: SandboxCounters(0, 150, unlogged=90, rate_limited=9000)})
    reasons = [e.reason for e in log.events(SID)]
    assert len(reasons) == 3, reasons
    assert reasons[0].startswith("rate-limited: 9000 DNS packets or new resolver/proxy")
    assert "past 400 DNS packets/s or 200 connections/s" in reasons[0]
    assert reasons[1].startswith("60 denied packets not logged one by one")
    assert reasons[2].startswith("30 denied packets not logged one by one")
    assert "log budget of 20/s, burst 40 per sandbox" in reasons[2]
    assert log.events(other) == []
    assert log.counters(SID) == (0, 0)


# -- the egress log ----------------------------------------------------------------------


def test_events_counted_elsewhere_are_kept_but_not_counted_twice() -> None:
    """NFLOG denials are counted by nft (``c_<key>_deny``) and summary lines stand for
    packets counted elsewhere: both are in the ring, neither moves the log's counters."""
    log = EgressLog()
    log.record(
        EgressEvent(1.0, SID, "198.18.0.1", 25, "tcp", None, "deny", None, "smtp"), count=False
    )
    log.record(EgressEvent(2.0, SID, "good.test", None, "dns", "good.test", "deny", None, "x"))
    log.add_rate_limited(SID, 5)
    assert len(log.events(SID)) == 2
    assert log.counters(SID) == (0, 1)
    assert log.rate_limited(SID) == 5
    log.forget(SID)
    assert log.rate_limited(SID) == 0


# -- learned elements: what the sets hold, so repeats cost no nft run ----------------------

WEB, CDN = IPv4Address("198.18.0.10"), IPv4Address("198.18.0.11")


def test_learned_elements_skip_what_the_set_holds_long_enough() -> None:
    elements = LearnedElements()
    a, b = (WEB, None), (CDN, 443)
    now = 1000.0
    assert elements.stale([a, b], 30, now) == [a, b]
    elements.added([a, b], 40, now)  # added with ttl 30 + slack 10
    assert elements.stale([a, b], 30, now) == []
    now += 10  # exactly ttl left: still covers an answer with that ttl
    assert elements.stale([a, b], 30, now) == []
    now += 0.5
    assert elements.stale([a, b], 30, now) == [a, b], "the guest could cache it past the element"
    assert elements.stale([a], 20, now) == []


def test_learned_elements_never_outlive_a_swap() -> None:
    """A policy swap flushes the sets and writes exactly the carried-over items: the
    memory claims those (with their own time left, the last of a key winning as in nft)
    and nothing the flush removed."""
    elements = LearnedElements()
    elements.added([(WEB, None), (CDN, None)], 40, 0.0)
    elements.replaced(
        [
            LearnedAddress(WEB, None, 5, 100),
            LearnedAddress(WEB, None, 35, 100),  # same element, written later: wins
            LearnedAddress(CDN, 443, None, 100),  # no new connections: not in the dns sets
        ],
        now=1.0,
    )
    assert elements.stale([(WEB, None)], 30, 1.0) == []
    assert elements.stale([(WEB, None)], 36, 1.0) == [(WEB, None)]
    assert elements.stale([(CDN, None), (CDN, 443)], 1, 1.0) == [(CDN, None), (CDN, 443)]
    elements.replaced([], now=2.0)
    assert len(elements) == 0
