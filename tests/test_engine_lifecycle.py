"""What a serving engine's users rely on beyond decoding: abort, streaming, fault recovery and bounded admission, on
the tiny random target with a briefly trained drafter.

* ``abort`` at every phase (queued, at its prefill, mid-run from a streaming callback, with deferred drafter
  context) frees every page and leaves the others' tokens unchanged (T = 0) or seeded-identical (T = 1);
* a fault in the prefill, draft or verify forward fails exactly the requests of that forward (reported as "error"
  with the exception), the others and the queue go on, nothing is lost or duplicated and the pages balance;
* a streaming callback that raises fails its own request only (at its prefill or mid-run), is not called again,
  and an exception from a finished request's last callback is recorded without changing how it finished;
* admission waits while the KV pools cannot hold a request's worst case, instead of failing.
"""

import pytest

from dspark_kernels.engine.engine import Engine
from dspark_kernels.engine.policies import make_policy
from dspark_kernels.models import generate
from tests.test_drafter_engine import target  # noqa: F401 (fixture)
from tests.test_engine import GAMMA, PROMPTS, drafter, linear_profile  # noqa: F401 (fixture)

NEW = 12


def make_engine(target, drafter, max_batch=3, kv_pages=None, policy="fixed3"):  # noqa: F811
    return Engine(target, drafter, make_policy(policy), linear_profile(max_batch * (GAMMA + 1), 6.0), GAMMA,
                  page_size=8, max_batch=max_batch, max_seq_len=64, kv_pages=kv_pages)


def pages_balance(eng: Engine) -> bool:
    """Every page of both pools is free, no request holds one, and nothing is reserved."""
    return (eng.tcache.num_free_pages == eng.tcache.num_pages and not eng.tcache.request_ids
            and eng.dstate.num_free_pages == eng.dstate.num_pages and eng.free_pages == eng.kv_pages)


def on_call(count: int, action, calls: dict):
    """A streaming callback that counts its calls per request in ``calls`` and runs ``action(rid)`` at call
    ``count``."""
    def on_tokens(rid, new, reason):
        calls[rid] = calls.get(rid, 0) + 1
        if calls[rid] == count:
            action(rid)
    return on_tokens


def drain(eng: Engine) -> list[int]:
    finished = []
    while eng.has_work:
        finished += eng.step()
    return finished


@pytest.fixture(scope="module")
def greedy(target):  # noqa: F811
    return generate(target, PROMPTS, NEW, temperature=0.0).tokens


def test_abort_at_every_phase_frees_pages_and_leaves_the_others_unchanged(target, drafter, greedy):  # noqa: F811
    eng = make_engine(target, drafter, max_batch=2)
    calls = {}

    def abort(rid):
        assert eng.abort(rid)

    def abort_on(count):
        return on_call(count, abort, calls)

    at_prefill = eng.add_request(PROMPTS[0], NEW, on_tokens=abort_on(1))  # aborted by its first callback
    keep = eng.add_request(PROMPTS[1], NEW)
    queued = eng.add_request(PROMPTS[2], NEW)  # waits: max_batch 2
    mid_run = eng.add_request(PROMPTS[3], NEW, on_tokens=abort_on(2))  # aborted after its first round
    assert eng.abort(queued) and queued not in eng.pending
    assert eng.step() == [at_prefill]
    assert eng.requests[at_prefill].reason == "aborted" and len(eng.requests[at_prefill].tokens) == 1
    eng.step()  # mid_run is admitted in place of at_prefill ...
    eng.step()  # ... and aborted from its second callback (after its first round)
    assert eng.requests[mid_run].reason == "aborted" and mid_run not in eng.live
    deferred = eng.add_request(PROMPTS[4], NEW)
    eng.step()
    eng.step()
    assert eng._pending.longest([deferred]) > 0  # its committed tokens wait for the drafter's next round
    assert eng.abort(deferred)
    drain(eng)
    assert eng.requests[keep].tokens == greedy[1] and eng.requests[keep].reason == "length"
    assert not eng.abort(keep)  # already finished
    with pytest.raises(KeyError, match="no request with id 99"):
        eng.abort(99)
    assert pages_balance(eng)
    assert {eng.requests[i].reason for i in (at_prefill, queued, mid_run, deferred)} == {"aborted"}


def test_abort_keeps_the_others_seeded_identical_at_t1(target, drafter):  # noqa: F811
    def run(with_victim: bool) -> list[list[int]]:
        eng = make_engine(target, drafter)
        rids = [eng.add_request(p, NEW, temperature=1.0, seed=7 + i) for i, p in enumerate(PROMPTS[:2])]
        if with_victim:
            victim = eng.add_request(PROMPTS[2], NEW, temperature=1.0, seed=3)
            eng.step()
            eng.step()
            eng.abort(victim)
        drain(eng)
        assert pages_balance(eng)
        return [eng.requests[i].tokens for i in rids]

    assert run(True) == run(False)


def test_streaming_callback_gives_every_token_once_then_the_reason(target, drafter, greedy):  # noqa: F811
    eng = make_engine(target, drafter)
    calls: dict[int, list] = {}
    rids = [eng.add_request(p, NEW, on_tokens=lambda rid, new, reason: calls.setdefault(rid, []).append((new, reason)))
            for p in PROMPTS[:3]]
    drain(eng)
    for i, rid in enumerate(rids):
        assert [t for new, _ in calls[rid] for t in new] == greedy[i]
        assert [reason for _, reason in calls[rid]] == [None] * (len(calls[rid]) - 1) + ["length"]
        assert all(new for new, _ in calls[rid][:-1])  # a running request is called only with new tokens
    with pytest.raises(TypeError, match="on_tokens must be callable"):
        eng.add_request(PROMPTS[0], NEW, on_tokens=3)


class Fault(RuntimeError):
    pass


def failing_target_forward(target, monkeypatch, fail_when):  # noqa: F811
    """Make the target's forward raise :class:`Fault` on the calls for which ``fail_when(call_index, rids)``."""
    real = target.forward
    count = [0]

    def forward(ids, cu, rids, cache, *args, **kwargs):
        count[0] += 1
        if fail_when(count[0], list(rids)):
            raise Fault(f"injected at forward {count[0]}")
        return real(ids, cu, rids, cache, *args, **kwargs)

    monkeypatch.setattr(target, "forward", forward)


def test_a_failed_prefill_fails_only_its_requests(target, drafter, greedy, monkeypatch):  # noqa: F811
    eng = make_engine(target, drafter, max_batch=2)
    first = eng.add_request(PROMPTS[0], NEW)
    eng.step()
    victim = eng.add_request(PROMPTS[1], NEW)
    failing_target_forward(target, monkeypatch, lambda n, rids: victim in rids and len(rids) == 1 and
                           eng.requests[victim].reason is None and not eng.requests[victim].tokens)
    after = eng.add_request(PROMPTS[2], NEW)  # queued behind the victim: admitted once it failed
    finished = drain(eng)
    assert sorted(finished) == sorted([first, victim, after]) and len(finished) == 3  # nothing lost or duplicated
    assert eng.requests[victim].reason == "error" and "Fault: injected" in eng.requests[victim].error
    assert eng.requests[first].tokens == greedy[0] and eng.requests[after].tokens == greedy[2]
    assert pages_balance(eng)


def test_a_failed_verify_fails_its_round_and_the_queue_goes_on(target, drafter, greedy, monkeypatch):  # noqa: F811
    eng = make_engine(target, drafter, max_batch=2)
    a, b = eng.add_request(PROMPTS[0], NEW), eng.add_request(PROMPTS[1], NEW)
    eng.step()
    failing_target_forward(target, monkeypatch, lambda n, rids: n == 1)  # the next forward: a and b's verify
    c = eng.add_request(PROMPTS[3], NEW)
    finished = drain(eng)
    assert sorted(finished) == sorted([a, b, c]) and len(finished) == 3
    assert eng.requests[a].reason == eng.requests[b].reason == "error"
    assert eng.requests[c].tokens == greedy[3] and eng.requests[c].reason == "length"
    assert pages_balance(eng)


def test_a_failed_draft_fails_its_round(target, drafter, greedy, monkeypatch):  # noqa: F811
    eng = make_engine(target, drafter, max_batch=1)
    a = eng.add_request(PROMPTS[0], NEW)
    b = eng.add_request(PROMPTS[1], NEW)
    eng.step()
    real = drafter.draft
    calls = [0]

    def draft(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise Fault("drafter")
        return real(*args, **kwargs)

    monkeypatch.setattr(drafter, "draft", draft)
    finished = drain(eng)
    assert sorted(finished) == [a, b] and eng.requests[a].reason == "error"
    assert eng.requests[b].tokens == greedy[1]
    assert pages_balance(eng)


def test_admission_waits_for_room_in_a_full_kv_pool(target, drafter, greedy):  # noqa: F811
    """Each request's worst case (prompt + 12 + gamma + 1 <= 22 tokens at most here: 3 pages of 8) fits once in 5
    pages: the engine runs them one at a time although max_batch is 4, and every one completes."""
    eng = make_engine(target, drafter, max_batch=4, kv_pages=5)
    rids = [eng.add_request(p, NEW) for i, p in enumerate(PROMPTS) if i != 2]
    while eng.has_work:
        eng.step()
        assert len(eng.live) <= 1 and eng.free_pages >= 0
    assert [eng.requests[i].tokens for i in rids] == [greedy[i] for i in (0, 1, 3, 4)]
    assert pages_balance(eng)
    with pytest.raises(ValueError, match="kv_pages = 5"):
        eng.add_request(PROMPTS[2], NEW)  # 26 + 12 + 5 tokens: 6 pages, more than the pool
    with pytest.raises(ValueError, match="kv_pages must be an int >= 1"):
        make_engine(target, drafter, kv_pages=0)
    assert eng.free_pages == 5


def test_a_raising_callback_fails_only_its_request(target, drafter, greedy):  # noqa: F811
    eng = make_engine(target, drafter, max_batch=3)
    calls = {}

    def went_away(rid):
        raise RuntimeError(f"client {rid} went away")

    def raise_on(count):
        return on_call(count, went_away, calls)

    at_prefill = eng.add_request(PROMPTS[0], NEW, on_tokens=raise_on(1))
    mid_run = eng.add_request(PROMPTS[1], NEW, on_tokens=raise_on(3))
    keep = eng.add_request(PROMPTS[2], NEW, on_tokens=lambda rid, new, reason: None)
    at_end = eng.add_request(PROMPTS[3], NEW, on_tokens=lambda rid, new, reason: 1 / 0 if reason else None)
    assert eng.step() == [at_prefill]  # failed at its prefill: no round for it; at_end waits (max_batch 3)
    drain(eng)
    for rid, count in ((at_prefill, 1), (mid_run, 3)):
        req = eng.requests[rid]
        assert req.reason == "error" and req.error == f"RuntimeError: client {rid} went away"
        assert calls[rid] == count  # not called again
        assert 1 <= len(req.tokens) < NEW and req.tokens == greedy[rid][:len(req.tokens)]
    assert eng.requests[keep].tokens == greedy[2] and eng.requests[keep].reason == "length"
    finished = eng.requests[at_end]
    assert finished.tokens == greedy[3] and finished.reason == "length"
    assert finished.error == "on_tokens raised ZeroDivisionError: division by zero"
    assert pages_balance(eng)
