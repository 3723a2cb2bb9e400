"""The cluster's routing (``frontend/cluster/routing.py``, pure: no Ray, no cluster): the load bound
under bursts of keyed and unkeyed requests, sessions pinned below it, a replica's death moving only
its own keys, prompts that repeat a sent prefix following it, and the router's count of what it sent.
Exhaustive over small tables (replicas, overloads, burst sizes, key patterns)."""
from __future__ import annotations

import hashlib
import itertools
import math

import pytest

from frontend.cluster import ROUTING_STATS_PERIOD_S
from frontend.cluster.direct import endpoint_here
from frontend.cluster.routing import Load, Router, bound, checked_overload, choose, rendezvous, usable

REPLICAS = ["r-a", "r-b", "r-c", "r-d", "r-e"]
OVERLOADS = (0.0, 0.25, 1.0)


def page(*parts) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def prompt(head: str, head_pages: int, tail: str, tail_pages: int) -> tuple[bytes, ...]:
    """Page hashes of a prompt: ``head_pages`` shared by every prompt with the same ``head``, then its own."""
    return tuple(page(head, i) for i in range(head_pages)) + tuple(page(head, tail, i) for i in range(tail_pages))


# What a burst sends: (session, pages) for request i.
PATTERNS = {
    "one session": lambda i: ("chat-1", ()),
    "distinct sessions": lambda i: (f"chat-{i}", ()),
    "one long system prompt": lambda i: (None, prompt("system", 6, f"q{i}", 1)),  # worth following: 6 of 7
    "a short system prompt": lambda i: (None, prompt("system", 1, f"q{i}", 3)),  # not: 1 of 4
    "shorter than a page": lambda i: (None, ()),
    "mixed": lambda i: [("chat-1", ()), (f"chat-{i}", ()), (None, prompt("system", 6, f"q{i}", 1)),
                        (None, ())][i % 4],
}


def test_a_burst_puts_no_more_than_the_bound_on_any_replica():
    """A burst (nothing ends): every choice leaves the chosen replica at or below the bound of that moment,
    so at the end none holds more than ceil((1 + max_overload) * N / R)."""
    reached = set()
    for r, overload, (name, pattern) in itertools.product(range(1, 6), OVERLOADS, PATTERNS.items()):
        replicas = REPLICAS[:r]
        router = Router(overload)
        for i in range(40):
            loads = {x: Load() for x in replicas}
            limit = bound({x: Load(sent=router.sent(x)) for x in replicas}, overload)
            chosen = router.route(f"req-{i}", *pattern(i), loads, 0.0)
            assert router.sent(chosen) <= limit, (name, r, overload, i)
        most = max(router.sent(x) for x in replicas)
        assert most <= math.ceil((1 + overload) * 40 / r), (name, r, overload)
        assert sum(router.sent(x) for x in replicas) == 40
        reached.add((name, r, overload, most == math.ceil((1 + overload) * 40 / r)))
    # non-vacuity: with one key the owner is filled to the bound, not below it (affinity is kept up to it)
    assert ("one session", 4, 0.25, True) in reached and ("one long system prompt", 4, 1.0, True) in reached
    # and without the bound one key would take the whole burst
    unbounded = Router(max_overload=1e9)
    assert {unbounded.route(f"req-{i}", "chat-1", (), {x: Load() for x in REPLICAS}, 0.0) for i in range(40)} == {
        rendezvous("s:chat-1", REPLICAS)[0]}


def test_a_report_adds_the_other_routers_requests_and_never_this_ones_twice():
    """A replica's load: this router's requests there now, plus those of its report that were not this
    router's when the report was taken (those it had in flight there then, by the report's clock)."""
    router = Router(0.25)
    own = rendezvous("s:chat-1", REPLICAS[:2])[0]
    other = next(x for x in REPLICAS[:2] if x != own)
    assert router.route("a", "chat-1", (), {own: Load(), other: Load()}, 1.0) == own
    # taken before "a" was routed: its 2 are others'; taken while "a" ran: 1 of its 2 is "a"
    assert router.counted(own, Load(running=2, taken=0.5)).held == 3
    assert router.counted(own, Load(running=2, taken=1.5)).held == 2
    # own reports 5 (4 from another router): it holds 5, above the bound ceil(1.25 * (5 + 1) / 2) = 4
    assert router.route("b", "chat-1", (), {own: Load(running=5, taken=2.0), other: Load()}, 2.5) == other
    router.ended("a", own, now=3.0)
    assert router.counted(own, Load(running=1, taken=2.9)).held == 0  # "a", ended since: stale, not held
    assert router.counted(own, Load(running=1, taken=3.5)).held == 1  # taken after its end: another's
    assert router.counted(own, Load(running=1)).held == 1  # (no time: all of it counts)
    assert Load(running=2, waiting=1, sent=2, own=2).held == 3 and Load(running=0, sent=4, own=1).held == 4


def test_a_session_stays_with_its_owner_while_the_owner_is_below_the_bound():
    for r, overload in itertools.product(range(2, 6), OVERLOADS):
        replicas = REPLICAS[:r]
        for s in range(50):
            order = rendezvous(f"s:chat-{s}", replicas)
            owner = order[0]
            for held in range(12):  # the owner's load, the others' 3 each
                loads = {x: Load(sent=3) for x in replicas} | {owner: Load(sent=held)}
                chosen = choose(order, loads, overload)
                if held < bound(loads, overload):
                    assert chosen == owner
                else:  # above it: the next in the session's order that is below (all others are: 3 < bound)
                    assert chosen == order[1], (r, overload, s, held)
    # a full queue is passed over while another has room, and kept when none has
    order = rendezvous("s:chat-1", REPLICAS)
    full = {x: Load() for x in REPLICAS} | {order[0]: Load(queue_full=True)}
    assert choose(order, full) == order[1]
    assert choose(order, {x: Load(queue_full=True) for x in REPLICAS}) == order[0]


def _one_at_a_time(replicas, sessions, duration, gap, delay, phase) -> tuple[list[str], int]:
    """Requests of ``sessions`` (None: sessionless, shorter than a page) one after another, each ending
    before the next starts, routed with the reports of the moment: each replica's taken every
    ROUTING_STATS_PERIOD_S (``phase`` apart) and seen ``delay`` later, saying what ran on it then. The
    replicas chosen, and how many reports still showed a request that had ended."""
    period = ROUTING_STATS_PERIOD_S
    router, ran, stale = Router(), [], 0  # ran: (replica, start, end) of each request
    for i, session in enumerate(sessions):
        now = i * (duration + gap)
        loads = {}
        for k, x in enumerate(replicas):
            taken = math.floor((now - delay - phase * k) / period) * period + phase * k
            running = sum(where == x and start <= taken < end for where, start, end in ran)
            stale += running
            loads[x] = Load(running=running, taken=taken)
        chosen = router.route(f"req-{i}", session, (), loads, now)
        router.ended(f"req-{i}", chosen, now=now + duration)
        ran.append((chosen, now, now + duration))
    return [x for x, _, _ in ran], stale


def test_one_request_at_a_time_goes_where_its_session_prefers_whatever_the_reports_say():
    """Twelve users' requests one after another, as the cluster test sends them: a report may still show
    a request that has ended (taken while it ran), which read alone puts a replica at the bound (one
    request, three replicas or more) and takes a session off it. Each goes to its session's first replica,
    and sessionless ones take the replicas in turn. (Serve's own fallback, which once sent twelve such
    users to one replica of two, is ruled out in router.py: one rank.)"""
    stale_seen = 0
    for r, duration, gap, delay, phase in itertools.product(range(2, 6), (0.01, 0.3, 2.5), (0.0, 0.05),
                                                            (0.0, 0.5, 1.0), (0.0, 0.37)):
        replicas = REPLICAS[:r]
        users = [f"user-{i}" for i in range(12)]
        chosen, stale = _one_at_a_time(replicas, users, duration, gap, delay * ROUTING_STATS_PERIOD_S, phase)
        assert chosen == [rendezvous(f"s:{u}", replicas)[0] for u in users], (r, duration, gap, delay, phase)
        assert len(set(chosen)) > 1  # non-vacuity: the twelve are not one replica's by hashing alone
        chosen, stale_too = _one_at_a_time(replicas, [None] * 12, duration, gap, delay, phase)
        counts = [chosen.count(x) for x in replicas]
        assert max(counts) - min(counts) <= 1, (r, duration, gap, delay, phase, chosen)
        stale_seen += stale + stale_too
    assert stale_seen  # non-vacuity: reports of requests that had ended were seen
    # the limit of the argument: two requests the owner held at once (only overlapping ones) divert a session
    owner, second = rendezvous("s:user-0", REPLICAS[:2])
    assert Router().route("x", "user-0", (), {owner: Load(running=2), second: Load()}, 0.0) == second


def test_a_replicas_death_moves_only_the_keys_it_had():
    for r in range(2, 6):
        replicas = REPLICAS[:r]
        for dead in replicas:
            alive = [x for x in replicas if x != dead]
            moved = 0
            for s in range(500):
                key = f"s:chat-{s}"
                before = choose(rendezvous(key, replicas), {x: Load() for x in replicas})
                after = choose(rendezvous(key, alive), {x: Load() for x in alive})
                assert after == before or before == dead
                assert rendezvous(key, alive) == [x for x in rendezvous(key, replicas) if x != dead]
                moved += before == dead
            assert 500 / r / 2 < moved < 500 / r * 2  # non-vacuity: the dead one had about its share
    assert rendezvous("s:x", REPLICAS) == rendezvous("s:x", list(reversed(REPLICAS)))  # order does not matter


def test_a_prompt_that_mostly_repeats_a_sent_one_follows_it_and_a_short_shared_prefix_does_not():
    router = Router()
    loads = {x: Load() for x in REPLICAS[:2]}
    turn1 = prompt("chat", 3, "", 0)
    home = router.route("t1", None, turn1, loads, 0.0)
    router.ended("t1", now=0.0)
    turn2 = turn1 + prompt("chat", 0, "turn 2", 2)  # 3 of its 5 pages were sent: it follows them
    for i in range(5):
        assert router.route(f"t2-{i}", None, turn2, loads, 0.0) == home
        router.ended(f"t2-{i}", now=0.0)
    turn3 = turn2 + prompt("chat", 0, "turn 3", 2)  # 5 of 7 were sent (the last two with turn 2): still home
    assert router.route("t3", None, turn3, loads, 0.0) == home
    router.ended("t3", now=0.0)
    # 24 questions under one short system prompt (1 page of 4): no preference, so the least loaded,
    # in turn among equals: they spread evenly whether they overlap (nothing ends) or not
    for overlap in (True, False):
        counts = {x: 0 for x in loads}
        for i in range(24):
            chosen = router.route(f"q{overlap}-{i}", None, prompt("system", 1, f"q{overlap}{i}", 3), loads,
                                  0.0)
            counts[chosen] += 1
            if not overlap:
                router.ended(f"q{overlap}-{i}", now=0.0)
        assert sorted(counts.values()) == [12, 12], (overlap, counts)
    # non-vacuity: a long shared system prompt (6 of 7 pages) is followed to one replica (below the bound)
    followed = set()
    for i in range(3):
        followed.add(router.route(f"s{i}", None, prompt("long", 6, f"s{i}", 1), loads, 0.0))
        router.ended(f"s{i}", now=0.0)
    assert len(followed) == 1


def test_the_router_counts_each_request_once_from_routing_to_its_end():
    router = Router()
    loads = {x: Load() for x in REPLICAS[:3]}
    first = router.route("a", "chat-1", (), loads, 0.0)
    assert router.sent(first) == 1
    assert router.route("a", "chat-1", (), loads, 0.0) == first and router.sent(first) == 1  # routed again: moved
    # routed again while its first replica looks full (Serve chooses again for a request that found no room)
    other = router.route("a", "chat-1", (), loads | {first: Load(queue_full=True)}, 0.0)
    assert other != first
    assert (router.sent(first), router.sent(other)) == (0, 1)
    router.ended("a", first, now=0.0)  # the end of the attempt rejected there, reported late: not this one
    assert router.sent(other) == 1
    router.ended("a", other, now=0.0)
    router.ended("a", now=0.0)  # twice: nothing below zero
    assert all(router.sent(x) == 0 for x in loads)
    router.ended("never-routed", now=0.0)


def test_remembered_pages_are_bounded():
    router = Router(remembered_pages=8)
    loads = {x: Load() for x in REPLICAS[:2]}
    for i in range(10):
        router.route(f"r{i}", None, prompt(f"p{i}", 4, "", 0), loads, 0.0)
    assert router.preference(None, prompt("p0", 4, "", 0), loads) == []  # forgotten (least recently sent)
    assert router.preference(None, prompt("p9", 4, "", 0), loads) != []


def test_failed_and_avoided_replicas_are_not_usable_unless_nothing_else_is():
    loads = {r: Load() for r in REPLICAS[:4]} | {"r-a": Load.from_stats({"failed": True})}
    assert Load.from_stats({"failed": True}).failed and not Load.from_stats({}).failed
    assert Load.from_stats(None) == Load() and Load.from_stats({"running": 2, "waiting": 1}).held == 3
    assert sorted(usable(loads)) == ["r-b", "r-c", "r-d"]
    assert sorted(usable(loads, ("r-b", "r-c"))) == ["r-d"]
    assert usable(loads, ("r-b", "r-c", "r-d")) == loads  # nothing else: all of them (the ingress gives up)
    key = next(f"s:{i}" for i in range(100) if rendezvous(f"s:{i}", list(loads))[0] == "r-a")
    assert choose(rendezvous(key, list(loads)), loads) == "r-a"  # non-vacuity: r-a comes first for key
    assert choose(rendezvous(key, list(loads)), usable(loads)) != "r-a"


def test_bad_input_is_refused_with_a_clear_error():
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="max_overload must be >= 0"):
            checked_overload(bad)
        with pytest.raises(ValueError, match="max_overload must be >= 0"):
            Router(bad)
    with pytest.raises(ValueError, match="no replicas"):
        choose([], {})


def test_only_a_replica_on_the_ingresss_node_is_read_directly():
    """The direct path's endpoint: a replica that reported one on this node; any other goes through Ray."""
    here = {"endpoint": "ipc:///tmp/tandem-r-a-x/serve.sock", "node": "n1", "pid": 123}
    assert endpoint_here(here, "n1") == here["endpoint"]
    assert endpoint_here(here, "n2") is None  # another node: its actor streams the tokens
    assert endpoint_here({}, "n1") is None  # no report (an older replica, or Serve has not passed it on yet)
    assert endpoint_here({**here, "pid": None}, "n1") is None  # no process to watch: no way to see it exit
