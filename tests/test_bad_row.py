"""One bad row never fails a batch: a row whose own hook (its grammar's draft_begin, draft_mask_logits,
draft_allowed, window_mask, is_allowed, consume or mask_logits; its penalties; its sampler) raises at any step of
the round (draft, accept, commit) fails alone with that error, and every other row's tokens, logit rows and
telemetry are bit for bit those of the same batch run without it. A row failing while drafting never reaches the
verify forward. Alone, the failure is the caller's exception."""
from __future__ import annotations

import concurrent.futures
import sys

import openai
import pytest
import torch

from engine.graphs import EAGER
from engine.loader import load_model
from engine.sampling import PenaltyState, SpecSampling
from engine.scheduler import Scheduler
from engine.spec import SpecSession
from engine.tokenizer import Tokenizer
from grammar import GrammarError
from grammar.compile import GrammarCompiler, GuidanceTokenizer, source_from_request
from grammar.constraint import GuidanceConstraint
from tests.server_fixtures import ServerThread, wait_until
from tests.tiny import make_checkpoint

K = 3  # the scheduler's K; the good rows draft 2, the bad row 3 (so its leaving changes the round's width)
GOOD_K = 2
N_NEW = 24
LARK = {"structured_outputs": {"grammar": 'start: item (", " item){5,30}\nitem: NUM | WORD\nNUM: /[0-9]{1,3}/\n'
                                          'WORD: /[a-z]{1,5}/'}}
#: the round's steps, by the engine function a hook is called from
STEPS = ("_draft", "_accept", "commit_round", "choose_first")


class Injected(RuntimeError):
    """The failure a test injects."""


class Cue:
    """Raise `Injected` at the n-th call of a hook made from round step `step` (a name in STEPS); `at` = the verify
    forwards `spy` had seen by then."""

    def __init__(self, step: str, n: int, spy: Spy | None = None) -> None:
        self.step, self.n, self.spy, self.seen = step, n, spy, 0
        self.fired: Injected | None = None
        self.at = -1

    def check(self, what: str) -> None:
        f = sys._getframe(1)
        while f is not None and f.f_code.co_name not in STEPS:
            f = f.f_back
        if f is None or f.f_code.co_name != self.step or self.fired is not None:
            return
        self.seen += 1
        if self.seen == self.n:
            self.fired = Injected(f"{what} failed on cue in {self.step}")
            self.at = len(self.spy.verified) if self.spy is not None else -1
            raise self.fired


GRAMMAR_HOOKS = ("draft_begin", "draft_mask_logits", "draft_allowed", "window_mask", "is_allowed", "mask_logits",
                 "consume")


class CuedGrammar(GuidanceConstraint):
    """A real llguidance constraint whose hook `hook` (one of GRAMMAR_HOOKS) raises on cue."""

    def __init__(self, grammar, hook: str, cue: Cue) -> None:
        super().__init__(grammar)
        self.hook, self.cue = hook, cue


def _cued(name: str):
    def hook(self, *a):
        if name == self.hook:
            self.cue.check(name)
        return getattr(GuidanceConstraint, name)(self, *a)
    return hook


for _name in GRAMMAR_HOOKS:
    setattr(CuedGrammar, _name, _cued(_name))


class CuedPenalties(PenaltyState):
    cue: Cue

    def apply(self, *a, **kw):
        self.cue.check("penalties")
        return super().apply(*a, **kw)


class Rows(SpecSession):
    """A session that keeps the raw logit row each emitted token was chosen from (test-only: a subclass)."""

    def _emit(self, toks, rows):
        self.rows = getattr(self, "rows", []) + [r.clone() for r in rows[:len(toks)]]
        super()._emit(toks, rows)


class CuedSampler(Rows):
    """A sampled session whose generator (its sampler's source of randomness) fails on cue."""

    cue: Cue | None = None

    @property
    def _gen(self):
        if self.cue is not None:
            self.cue.check("sampler")
        return self._real_gen

    @_gen.setter
    def _gen(self, g):
        self._real_gen = g


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("badrow"), seed=31, with_tokenizer=True)
    model = load_model(ckpt, dtype="float32")
    tok = Tokenizer.from_dir(ckpt)
    comp = GrammarCompiler(GuidanceTokenizer.from_tokenizer(tok, n_vocab=model.config.vocab_size))
    grammar = comp.compile(source_from_request(**LARK)).grammar
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 11, 3, 8, 6)]
    return model, grammar, prompts


class Spy:
    """The eager runner, recording the pool slots and the width T of every verify forward."""

    def __init__(self) -> None:
        self.verified: list[tuple[list[int], int]] = []

    def verify(self, model, pool, tokens, slots, pos0, cur):
        self.verified.append((list(slots), tokens.shape[1]))
        return EAGER.verify(model, pool, tokens, slots, pos0, cur)

    def draft(self, *a):
        return EAGER.draft(*a)


def _good(model, grammar, prompts, pool) -> list[Rows]:
    """The well-behaved rows: greedy, greedy under a grammar, sampled with penalties, greedy with penalties."""
    mk = lambda i, **kw: Rows(model, prompts[i], N_NEW, k=GOOD_K, capmax=K, pool=pool, **kw)  # noqa: E731
    return [mk(0), mk(1, constraint=GuidanceConstraint(grammar)),
            mk(2, sampling=SpecSampling(temperature=0.8, top_p=0.95, seed=3, repetition_penalty=1.3)),
            mk(3, sampling=SpecSampling(frequency_penalty=0.7, logit_bias=((7, 2.0),)))]


def _run(sched: Scheduler, good: list[Rows], bad: list[SpecSession] = ()) -> None:
    """Every row joins at step 0; step until all are done. Each bad row must leave while every good row runs."""
    for s in good + list(bad):
        sched.add(s)
    for _ in range(500):
        if not sched.num_sessions:
            break
        running = [b for b in bad if not b.finished]
        sched.step()
        if any(b.finished for b in running):
            assert not any(g.finished for g in good), "a good row ended with the bad one"
    else:
        raise AssertionError("the batch never finished")
    assert sched.pool.num_free == 6 and not sched.running and not sched.joining


def _sched(model) -> Scheduler:
    sched = Scheduler(model, max_num_seqs=6, max_model_len=128, k=K, max_num_batched_tokens=512)
    sched.runner = Spy()
    return sched


@pytest.fixture(scope="module")
def reference(tiny):
    model, grammar, prompts = tiny
    sched = _sched(model)
    good = _good(model, grammar, prompts, sched.pool)
    _run(sched, good)
    assert all(g.finish_reason == "length" and len(g.emitted) == N_NEW for g in good)
    return good


def _same_as_without(good: list[Rows], ref: list[Rows]) -> None:
    for i, (g, r) in enumerate(zip(good, ref)):
        assert g.error is None and g.finish_reason == r.finish_reason, i
        assert g.emitted == r.emitted, f"row {i}: tokens differ"
        assert len(g.rows) == len(r.rows) and all(torch.equal(a, b) for a, b in zip(g.rows, r.rows)), \
            f"row {i}: logit rows differ"
        assert (g.telem.pos_drafted, g.telem.pos_accepted) == (r.telem.pos_drafted, r.telem.pos_accepted), i


def _bad_row(model, grammar, prompts, pool, kind: str, cue: Cue) -> SpecSession:
    """The row that fails on cue: greedy under a grammar whose hook `kind` raises, or (kind "penalties" / "sampler")
    greedy with penalties / sampled, whose penalties / sampler raise. commit_round chooses a token itself only in a
    plain step (K = 0) under a grammar, so for that step the row decodes plainly and penalty / sampler rows carry
    a grammar too."""
    plain = cue.step == "commit_round" and kind in ("penalties", "sampler", "mask_logits")
    kw = dict(capmax=K, pool=pool, k=0 if plain else K)
    if kind in ("penalties", "sampler"):
        if plain:
            kw["constraint"] = GuidanceConstraint(grammar)
        if kind == "sampler":
            s = CuedSampler(model, prompts[4], N_NEW, sampling=SpecSampling(temperature=0.7, seed=9), **kw)
            s.cue = cue
            return s
        s = Rows(model, prompts[4], N_NEW, sampling=SpecSampling(repetition_penalty=1.2), **kw)
        s._pen.__class__ = CuedPenalties
        s._pen.cue = cue
        return s
    return Rows(model, prompts[4], N_NEW, constraint=CuedGrammar(grammar, kind, cue), **kw)


# (hook, the round step it raises in, at its n-th call from that step)
CASES = [
    ("draft_begin", "_draft", 2), ("draft_mask_logits", "_draft", 4), ("draft_allowed", "_draft", 3),
    ("window_mask", "_accept", 2), ("is_allowed", "commit_round", 3), ("consume", "commit_round", 3),
    ("mask_logits", "commit_round", 2),
    ("penalties", "_draft", 3), ("penalties", "_accept", 2), ("penalties", "commit_round", 2),
    ("sampler", "_draft", 3), ("sampler", "_accept", 2), ("sampler", "commit_round", 2),
]


@pytest.mark.parametrize("kind,step,n", CASES, ids=[f"{h}-{s.strip('_')}" for h, s, _ in CASES])
def test_a_row_whose_hook_raises_mid_round_fails_alone(tiny, reference, kind, step, n):
    model, grammar, prompts = tiny
    sched = _sched(model)
    cue = Cue(step, n, sched.runner)
    good = _good(model, grammar, prompts, sched.pool)
    bad = _bad_row(model, grammar, prompts, sched.pool, kind, cue)
    _run(sched, good, [bad])
    assert cue.fired is not None, "the cue never fired"
    assert bad.error is cue.fired and bad.finish_reason == "error"
    assert 0 < len(bad.emitted) < N_NEW
    _same_as_without(good, reference)
    # the bad row was in every verify forward until it failed, and in none after; failing while drafting, it never
    # reached the verify forward of that round, which ran as wide as the good rows alone need
    verified = sched.runner.verified
    assert [bad.slot in slots for slots, _ in verified] == [True] * cue.at + [False] * (len(verified) - cue.at)
    if step == "_draft":
        slots, T = verified[cue.at]
        assert sorted(slots) == sorted(g.slot for g in good) and T == GOOD_K + 1


def test_several_bad_rows_in_one_round_and_a_round_of_bad_rows_only(tiny, reference):
    """Two rows fail in the same draft step (the only rows drafting 3): the rest are unchanged. Then a
    batch whose every row fails while drafting: the round ends before the verify and every slot comes back."""
    model, grammar, prompts = tiny
    sched = _sched(model)
    cues = [Cue("_draft", 2, sched.runner), Cue("_draft", 4, sched.runner)]  # both in the second round
    good = _good(model, grammar, prompts, sched.pool)
    bad = [_bad_row(model, grammar, prompts, sched.pool, "draft_begin", cues[0]),
           _bad_row(model, grammar, prompts, sched.pool, "penalties", cues[1])]
    _run(sched, good, bad)
    assert all(b.error is c.fired is not None for b, c in zip(bad, cues)) and cues[0].at == cues[1].at == 1
    _same_as_without(good, reference)
    sched = _sched(model)
    cues = [Cue("_draft", 1), Cue("_draft", 1)]
    bad = [_bad_row(model, grammar, prompts, sched.pool, "draft_begin", cues[0]),
           _bad_row(model, grammar, prompts, sched.pool, "sampler", cues[1])]
    _run(sched, [], bad)
    assert all(b.error is c.fired is not None for b, c in zip(bad, cues))
    assert sched.runner.verified == []


@pytest.mark.parametrize("kind,step", [("draft_allowed", "_draft"), ("window_mask", "_accept"),
                                       ("consume", "commit_round")])
def test_alone_the_failure_is_the_callers_exception(tiny, kind, step):
    model, grammar, prompts = tiny
    cue = Cue(step, 2)
    s = SpecSession(model, prompts[4], N_NEW, k=K, capmax=K, constraint=CuedGrammar(grammar, kind, cue))
    with pytest.raises(Injected) as e:
        s.run()
    assert e.value is cue.fired and s.error is cue.fired and s.finished and s.finish_reason == "error"
    assert s.step() == []  # finished: nothing more


# --------------------------------------------------------------------------------------- through the server
LARK_BODY = {"structured_outputs": LARK["structured_outputs"], "ignore_eos": True}
#: a request's `seed` arms its grammar to raise at its 4th draft_allowed call in a batch of several rows: seed -> what
SERVER_CUES: dict[int, BaseException] = {}
SERVER_STATE: dict[str, object] = {}


class FailingGrammar:
    """Wraps a request's constraint; its draft_allowed raises `err` at the 4th call made while other rows share
    the batch (worker thread: the scheduler is its own)."""

    def __init__(self, inner, err: BaseException) -> None:
        self._inner, self._err, self._calls = inner, err, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def draft_allowed(self, tok):
        self._calls += len(SERVER_STATE["worker"].scheduler.running) > 1
        if self._calls == 4:
            SERVER_STATE["fired"] = True
            raise self._err
        return self._inner.draft_allowed(tok)


class CuedServerSession(SpecSession):
    """The worker's session: a request whose seed is in SERVER_CUES gets a grammar that raises mid-round."""

    def __init__(self, model, prompt_ids, max_new_tokens, *, sampling=SpecSampling(), constraint=None, **kw):
        if sampling.seed in SERVER_CUES:
            constraint = FailingGrammar(constraint, SERVER_CUES[sampling.seed])
        super().__init__(model, prompt_ids, max_new_tokens, sampling=sampling, constraint=constraint, **kw)


@pytest.fixture(scope="module")
def server():
    # fixed K: the cue fires in draft_allowed, which a row the K controller set to 0 would not call
    with ServerThread(worker_kw={"session_factory": CuedServerSession}, max_num_seqs=6, spec_adaptive=False) as s:
        SERVER_STATE["worker"] = s.worker
        yield s


def _good_requests(c, model: str) -> list:
    """Three requests that run together: greedy, greedy under a grammar, sampled; with logprobs (the logit rows'
    log-softmax, printed exactly)."""
    kw = dict(model=model, max_tokens=30, logprobs=3)
    calls = [lambda: c.completions.create(prompt="Hello world", temperature=0, extra_body={"ignore_eos": True}, **kw),
             lambda: c.completions.create(prompt="The quick brown fox", temperature=0, extra_body=LARK_BODY, **kw),
             lambda: c.completions.create(prompt="numbers", temperature=0.9, seed=5, extra_body={"ignore_eos": True},
                                          **kw)]
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as ex:
        return [f.result() for f in [ex.submit(f) for f in calls]]


def _outputs(rs) -> list:
    return [(ch.text, ch.finish_reason, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs)
            for r in rs for ch in r.choices]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("err,status", [
    (lambda: Injected("the grammar broke"), 500),
    (lambda: GrammarError("structured_outputs.grammar: this grammar cannot be followed here",
                          "structured_outputs.grammar"), 400)], ids=["internal", "input"])
def test_a_request_whose_grammar_raises_mid_round_through_the_server(server, err, status, stream):
    """The bad request gets its error (500 internal_error naming it; 400 naming the field when the request's own
    grammar is at fault), as a status or, streaming, as an error event; the requests decoded beside it get exactly
    the answer (tokens and logprobs) they get without it."""
    c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    ref = _outputs(_good_requests(c, server.model))
    SERVER_CUES[777] = err()
    SERVER_STATE["fired"] = False

    def bad():  # long enough to be running when the others arrive
        kw = dict(model=server.model, prompt="abc", max_tokens=400, temperature=0, seed=777, extra_body=LARK_BODY)
        if not stream:
            return c.completions.create(**kw)
        return list(c.completions.create(stream=True, **kw))

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        failed = ex.submit(bad)
        assert wait_until(lambda: server.worker.num_active == 1)
        got = _outputs(_good_requests(c, server.model))
        with pytest.raises(openai.APIError) as e:
            failed.result()
    assert SERVER_STATE["fired"]
    assert got == ref
    if stream:  # the stream had begun: the error comes as an event
        assert e.value.body["type"] == ("server_error" if status == 500 else "invalid_request_error")
    else:
        assert e.value.status_code == status
    body = e.value.body
    if status == 500:
        assert body["code"] == "internal_error" and "Injected: the grammar broke" in body["message"]
    else:
        assert body["param"] == "structured_outputs.grammar" and "cannot be followed" in body["message"]
    assert wait_until(lambda: server.worker.num_active == 0 and server.worker.num_waiting == 0)


def test_a_grammar_error_from_the_engine_process_keeps_its_field():
    """The engine process pickles a session's error to the server: a GrammarError keeps its `param`, so the 400
    still names the request's field; anything else is a 500 internal_error naming it."""
    import pickle

    from server.serving import session_error

    e = session_error(pickle.loads(pickle.dumps(GrammarError("regex: cannot be followed", "structured_outputs.regex"))))
    assert (e.status, e.param, e.code, e.message) == (400, "structured_outputs.regex", "invalid_grammar",
                                                      "regex: cannot be followed")
    e = session_error(pickle.loads(pickle.dumps(Injected("mask failed"))))
    assert (e.status, e.code, e.message) == (500, "internal_error", "generation failed: Injected: mask failed")
