"""The rollout engine in-process on embedded:tiny-random: batching, logprobs, versions, aborts."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from areal_aio.store.weights import WeightStore
from areal_aio.workers.models import TINY, encode_prompt, load_model
from areal_aio.workers.rollout import engine as engine_module
from areal_aio.workers.rollout.engine import HEADROOM_TOKENS, Engine, Request, _Seq, _tail_buckets
from tests.conftest import HostReads

PROMPTS = ["Calculate 3 + 4.", "What is 12 - 5? Put the answer in <answer></answer> tags.", "Hi",
           "Calculate 7 * 8 and explain every step of the way, slowly and carefully."]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine, two OpenMP threads stall each other at
    every op's barrier whenever another process holds a core (tiny ops get ~100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_steps(engine: Engine, steps: int) -> list:
    """Up to `steps` decode steps (fewer when nothing is left to do); the finished sequences."""
    done = []
    while steps > 0 and engine.busy:
        taken, finished = engine.advance(steps)
        steps -= taken
        done.extend(finished)
    return done



@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY, seed=0)


def _perturbed(model, seed: int):
    """A copy of `model` with noise added: weights that a trainer step might have produced."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return other


def _drain(engine: Engine) -> dict:
    out = {}
    while engine.busy:
        for c in engine.step():
            out[c.request_id] = c
    return out


def _reference_logprobs(model, completion, temperature: float, top_p: float) -> list[float]:
    """Log-prob of each completion token by one full forward pass (no cache, no padding),
    through transformers' own temperature and top-p warpers."""
    ids = torch.tensor([completion.prompt_ids + completion.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(completion.prompt_ids) - 1:-1].float()
    if temperature > 0:
        logits = TemperatureLogitsWarper(temperature)(None, logits)
        if top_p < 1:
            logits = TopPLogitsWarper(top_p)(None, logits)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(completion.completion_ids)[:, None])[:, 0].tolist()


def _mixed_requests(tok, n: int, **kw) -> list[Request]:
    """Requests of different prompt lengths, greedy and sampled, with and without top-p."""
    settings = [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9), (1.3, 0.5)]
    return [Request(f"r{i}", encode_prompt(tok, PROMPTS[i % len(PROMPTS)]), 5 + 3 * i,
                    *settings[i % len(settings)], **kw) for i in range(n)]


def test_many_requests_of_different_lengths_all_complete(tiny):
    model, tok = tiny
    engine = Engine(model, tok, max_batch=3, seed=1)
    wanted = {}
    for i in range(10):
        n = 2 + 3 * i
        wanted[f"r{i}"] = n
        engine.add(Request(f"r{i}", encode_prompt(tok, PROMPTS[i % len(PROMPTS)]), n, 1.0))
    peak = 0
    out = {}
    while engine.busy:
        for c in engine.step():
            out[c.request_id] = c
        peak = max(peak, engine.running)
    assert peak == 3  # slots are refilled as soon as they open, never above max_batch
    assert set(out) == set(wanted)
    for rid, c in out.items():
        assert c.finish == "length" and len(c.completion_ids) == wanted[rid]
        assert len(c.logprobs) == len(c.versions) == wanted[rid]
        assert c.versions == [0] * wanted[rid] and c.interrupts == 0
        assert c.text == tok.decode(c.completion_ids, skip_special_tokens=True)
    assert engine.running == 0 and not engine.waiting


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_equal_a_fresh_forward_pass(tiny, temperature, top_p):
    model, tok = tiny
    engine = Engine(model, tok, max_batch=8, seed=2)
    for i, prompt in enumerate(PROMPTS * 2):
        engine.add(Request(f"r{i}", encode_prompt(tok, prompt), 6 + 2 * i, temperature, top_p))
    out = _drain(engine)
    assert len(out) == 8
    for c in out.values():
        ref = _reference_logprobs(model, c, temperature, top_p)
        assert max(abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)) < 1e-4


def test_sampled_tokens_do_not_depend_on_batching(tiny):
    """A seeded request draws the same tokens alone or sharing its steps with other requests,
    admitted at other times: each token's uniform is a function of (seed, position) only."""
    model, tok = tiny
    ids = [encode_prompt(tok, p) for p in PROMPTS]
    alone = Engine(model, tok, max_batch=1, seed=0)
    alone.add(Request("x", ids[0], 12, 1.0, seed=99))
    expected = _drain(alone)["x"]
    crowded = Engine(model, tok, max_batch=3, seed=5)
    for i, p in enumerate(ids[1:]):
        crowded.add(Request(f"o{i}", p, 4 + 3 * i, 1.0))
    crowded.step()
    crowded.add(Request("x", ids[0], 12, 1.0, seed=99))
    got = _drain(crowded)["x"]
    assert got.completion_ids == expected.completion_ids
    assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)


def test_long_sequences_outgrow_the_kv_headroom(tiny):
    model, tok = tiny
    engine = Engine(model, tok, max_batch=2, seed=8)
    n = 3 * HEADROOM_TOKENS + 5  # the cache buffers regrow several times
    for i in range(2):
        engine.add(Request(f"r{i}", encode_prompt(tok, PROMPTS[i]), n, 1.0))
    out = _drain(engine)
    for c in out.values():
        assert len(c.completion_ids) == n
        ref = _reference_logprobs(model, c, 1.0, 1.0)
        assert max(abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)) < 1e-4


def test_group_of_identical_prompts_samples_independently(tiny):
    model, tok = tiny
    engine = Engine(model, tok, max_batch=8, seed=3)
    ids = encode_prompt(tok, PROMPTS[0])
    for i in range(8):
        engine.add(Request(f"g{i}", ids, 8, 1.0))
    out = _drain(engine)
    assert len({tuple(c.completion_ids) for c in out.values()}) > 1
    for c in out.values():
        ref = _reference_logprobs(model, c, 1.0, 1.0)
        assert max(abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)) < 1e-4


def test_a_group_admitted_piecemeal_is_prefilled_once(tiny):
    model, tok = tiny
    engine = Engine(model, tok, max_batch=2, seed=9)
    forwards = []
    compute = engine._forward
    engine._forward = lambda rows: forwards.append(len(rows)) or compute(rows)
    ids = encode_prompt(tok, PROMPTS[1])
    for i in range(6):
        engine.add(Request(f"g{i}", ids, 3 + i, 1.0))
    out = _drain(engine)
    assert forwards == [1] and len(out) == 6  # later admissions hit the prefix cache
    for c in out.values():
        ref = _reference_logprobs(model, c, 1.0, 1.0)
        assert max(abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)) < 1e-4


def test_greedy_equals_model_generate(tiny):
    model, tok = tiny
    engine = Engine(model, tok, max_batch=5, seed=4)
    for i, prompt in enumerate(PROMPTS):
        engine.add(Request(f"r{i}", encode_prompt(tok, prompt), 12, 0.0, top_p=0.9))
    # a sampled row with top-p shares the batch; greedy rows still log-prob the plain softmax
    engine.add(Request("sampled", encode_prompt(tok, PROMPTS[0]), 12, 1.0, top_p=0.9))
    out = _drain(engine)
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([encode_prompt(tok, prompt)])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=12)[0, ids.shape[1]:].tolist()
        assert out[f"r{i}"].completion_ids == ref
        assert max(abs(a - b) for a, b in zip(
            _reference_logprobs(model, out[f"r{i}"], 0.0, 1.0), out[f"r{i}"].logprobs,
            strict=True)) < 1e-4


def test_eos_stops_a_sequence_and_is_kept(tiny):
    model, tok = tiny
    ids = encode_prompt(tok, PROMPTS[0])
    probe = Engine(model, tok, max_batch=1, seed=7)
    probe.add(Request("p", ids, 10, 1.0))
    sampled = _drain(probe)["p"].completion_ids
    at = next(i for i, t in enumerate(sampled) if t not in sampled[:i] and i > 0)
    engine = Engine(model, tok, max_batch=1, seed=7)  # same seed: the same draws
    engine.eos = {sampled[at]}  # pretend a later sampled token is EOS
    engine.add(Request("r", ids, 10, 1.0))
    c = _drain(engine)["r"]
    assert c.finish == "stop" and c.completion_ids == sampled[:at + 1]


def test_abort_queued_and_running(tiny):
    model, tok = tiny
    engine = Engine(model, tok, max_batch=2, seed=5)
    for i in range(4):
        engine.add(Request(f"r{i}", encode_prompt(tok, PROMPTS[i]), 20, 1.0))
    run_steps(engine, 3)
    running = engine.abort("r1")
    queued = engine.abort("r3")
    assert engine.abort("nope") is None
    # the first step samples twice: once from the prefill, once from the decode
    assert running.finish == "abort" and len(running.completion_ids) == 4
    assert len(running.logprobs) == len(running.versions) == 4
    assert queued.finish == "abort" and queued.completion_ids == []
    out = _drain(engine)
    assert set(out) == {"r0", "r2"} and all(c.finish == "length" for c in out.values())


def test_rebuild_passes_group_similar_completion_lengths():
    def lengths(tails):
        seqs = [_Seq(Request("r", [1], 99), 0.0, completion=[0] * k) for k in sorted(tails)]
        return [[len(s.completion) for s in group] for group in _tail_buckets(seqs)]

    assert lengths([6, 6, 6, 6]) == [[6, 6, 6, 6]]
    assert lengths([1, 2, 3, 60, 61, 62]) == [[1, 2, 3], [60, 61, 62]]
    assert lengths([]) == []


@pytest.mark.parametrize("overhead", [engine_module.FORWARD_OVERHEAD_TOKENS, 0])
def test_weight_update_mid_generation_rebuilds_and_versions_tokens(tiny, tmp_path, monkeypatch,
                                                                   overhead):
    """overhead 0: every distinct completion length is rebuilt in a pass of its own."""
    monkeypatch.setattr(engine_module, "FORWARD_OVERHEAD_TOKENS", overhead)
    model, tok = tiny
    model = copy.deepcopy(model)  # the engine loads new weights into it
    v0 = copy.deepcopy(model)
    v1 = _perturbed(model, seed=6)
    path = WeightStore(tmp_path).publish(v1, 1)
    engine = Engine(model, tok, max_batch=4, seed=6)
    # r0 finishes early and r4 takes its slot: at the update the rows hold completions of
    # different lengths after prompts of different lengths (masked holes in the rebuilt KV)
    lengths = [3, 16, 16, 16, 16, 16]
    for i, prompt in enumerate(PROMPTS + PROMPTS[:2]):
        engine.add(Request(f"r{i}", encode_prompt(tok, prompt), lengths[i], 0.8, 0.95))
    early = {c.request_id: c for c in run_steps(engine, 5)}
    assert set(early) == {"r0"}
    tails = sorted(len(s.completion) for s in engine.batch.seqs)
    assert tails[0] < tails[-1]
    loaded, done = engine.update_weights(1, str(path))
    assert loaded.version == 1 and loaded.rebuilt == 4 and not done
    # r5 is queued and shares r1's prompt, prefilled under v0: the prefix cache must not serve it
    out = {**early, **_drain(engine)}
    assert len(out) == 6 and {r for r, c in out.items() if c.interrupts} == {"r1", "r2", "r3", "r4"}
    assert out["r0"].versions == [0] * 3 and set(out["r5"].versions) == {1}
    for rid, c in out.items():
        versions = c.versions
        assert versions == sorted(versions) and len(versions) == lengths[int(rid[1:])]
        if c.interrupts:
            assert versions[0] == 0 and versions[-1] == 1 and c.interrupts == 1
        # each token's logprob under the weights of its own version
        ref = {0: _reference_logprobs(v0, c, 0.8, 0.95), 1: _reference_logprobs(v1, c, 0.8, 0.95)}
        for i, (lp, v) in enumerate(zip(c.logprobs, versions, strict=True)):
            assert abs(lp - ref[v][i]) < 1e-4, (c.request_id, i, v)
        assert any(abs(ref[0][i] - ref[1][i]) > 1e-3 for i in range(len(versions)))  # they differ


def test_keep_kv_update_decodes_on_over_the_old_weights_kv(tiny, tmp_path):
    """rollout.kv_on_update = keep: nothing is rebuilt; a token drawn after the update has the
    log-prob of the new weights reading the old weights' KV of everything before the pending
    token, and a request queued meanwhile starts on the new weights (no stale prefix)."""
    model, tok = tiny
    model = copy.deepcopy(model)
    v0, v1 = copy.deepcopy(model), _perturbed(model, seed=7)
    path = WeightStore(tmp_path).publish(v1, 1)
    engine = Engine(model, tok, max_batch=2, seed=7, keep_kv=True)
    for i, prompt in enumerate([PROMPTS[3], PROMPTS[0], PROMPTS[0]]):  # "r2" waits for a slot
        engine.add(Request(f"r{i}", encode_prompt(tok, prompt), 12, 0.8, 0.95))
    assert not run_steps(engine, 4)
    before = {s.req.request_id: len(s.completion) for s in engine.batch.seqs}
    loaded, done = engine.update_weights(1, str(path))
    assert loaded.rebuilt == 0 and not done and len(engine.batch) == 2
    out = _drain(engine)
    for rid, k in before.items():
        c = out[rid]
        assert c.interrupts == 1 and c.versions == [0] * k + [1] * (12 - k)
        prompt = torch.tensor([c.prompt_ids + c.completion_ids[:k - 1]])
        with torch.no_grad():  # old KV up to the pending token, then the new weights
            past = v0(prompt, use_cache=True).past_key_values
            logits = v1(torch.tensor([c.completion_ids[k - 1:-1]]), **{engine.cache_kw: past}).logits[0]
        logp = torch.log_softmax(TopPLogitsWarper(0.95)(None, TemperatureLogitsWarper(0.8)(None, logits)), -1)
        expected = logp.gather(1, torch.tensor(c.completion_ids[k:])[:, None])[:, 0].tolist()
        assert c.logprobs[k:] == pytest.approx(expected, abs=1e-4)
        rebuilt = _reference_logprobs(v1, c, 0.8, 0.95)[k:]
        assert max(abs(a - b) for a, b in zip(c.logprobs[k:], rebuilt, strict=True)) > 1e-3
    assert out["r2"].versions == [1] * 12 and out["r2"].interrupts == 0
    assert out["r2"].logprobs == pytest.approx(_reference_logprobs(v1, out["r2"], 0.8, 0.95), abs=1e-4)


@pytest.mark.parametrize("look_every_step", [True, False])
def test_a_stop_string_ends_the_row_at_the_token_that_completes_it(tiny, look_every_step):
    """The stop string is a piece of what the free reply writes from its 5th token on, across
    token boundaries: the reply with it ends at the first token whose text completes it (kept),
    whether the host looks every step or once per chunk; its batch mate runs on."""
    model, tok = tiny
    prompt = encode_prompt(tok, PROMPTS[0])
    engine = Engine(model, tok, max_batch=2, seed=1, look_every_step=look_every_step)
    engine.add(Request("free", prompt, 24, 1.0, seed=5))
    full = _drain(engine)["free"].completion_ids
    assert len(set(full[4:8])) > 1  # distinct tokens: the string spans several
    stop = tok.decode(full[4:8], skip_special_tokens=True)[1:-1]
    end = next(k for k in range(1, len(full) + 1) if stop in tok.decode(full[:k], skip_special_tokens=True))
    assert 5 < end < len(full)
    engine.add(Request("stop", prompt, 24, 1.0, seed=5, stop=("never written", stop)))
    engine.add(Request("mate", prompt, 24, 1.0, seed=5))
    out = {}
    while engine.busy:
        out.update((c.request_id, c) for c in engine.advance(8)[1])
    assert out["stop"].completion_ids == full[:end] and out["stop"].finish == "stop"
    assert stop in out["stop"].text and out["mate"].completion_ids == full


def test_update_weights_with_a_missing_file_raises(tiny, tmp_path):
    model, tok = tiny
    engine = Engine(copy.deepcopy(model), tok)
    with pytest.raises(Exception, match="no such weight version"):
        engine.update_weights(1, str(tmp_path / "v1.safetensors"))


def test_a_prefill_whose_rows_all_finish_at_once_leaves_the_batch_intact(tiny, tmp_path):
    """A rows-all-done prefill (admitted with one token left, or rebuilt one token before its
    limit) merges nothing into a running batch: once a crash in an areal run on a GPU."""
    model, tok = tiny
    model = copy.deepcopy(model)
    path = WeightStore(tmp_path).publish(_perturbed(model, seed=2), 1)
    engine = Engine(model, tok, max_batch=4, seed=2)
    engine.add(Request("long", encode_prompt(tok, PROMPTS[0]), 12, 0.8, 1.0))
    engine.add(Request("short", encode_prompt(tok, PROMPTS[1]), 4, 0.8, 1.0))
    out = {c.request_id: c for c in run_steps(engine, 1)}  # 2 tokens each
    assert not out and len(engine.batch) == 2
    engine.add(Request("one", encode_prompt(tok, PROMPTS[2]), 1, 0.8, 1.0))  # done at admission
    out.update((c.request_id, c) for c in engine.step())
    assert "one" in out and len(out["one"].completion_ids) == 1 and len(engine.batch) == 2
    # "short" has 3 of 4 tokens: its rebuild samples the last one and finishes in its own pass
    loaded, done = engine.update_weights(1, str(path))
    assert loaded.rebuilt == 2 and [c.request_id for c in done] == ["short"]
    out.update((c.request_id, c) for c in done)
    out.update(_drain(engine))
    assert len(out["long"].completion_ids) == 12 and out["long"].versions[-1] == 1


def test_a_decode_step_reads_nothing_on_the_host(tiny):
    """Sampling, uniforms, counters, positions and the mask stay on the device: a decode step
    neither reads a tensor's value nor uploads host data (on a GPU, either waits for the
    device), so only the look at the end of `advance` does."""
    model, tok = tiny
    engine = Engine(model, tok, max_batch=4, seed=1, look_every_step=False)
    for req in _mixed_requests(tok, 4):
        engine.add(req)
    decode, looks, seen = engine._decode, [], []

    def watched(b):
        with HostReads() as reads:
            decode(b)
        seen.extend(reads.seen)

    engine._decode = watched
    look = engine._look
    engine._look = lambda b: looks.append(len(b.drawn)) or look(b)
    out = {c.request_id: c for c in run_steps(engine, 6)}
    out.update((c.request_id, c) for c in run_steps(engine, 100))
    assert len(out) == 4 and not engine.busy
    assert seen == []
    # tokens read per look: the first ones after admission, then a stretch of steps up to the
    # end of the chunk (6 steps: 4 + 2) or the next row's length limit (8, 11, 14 tokens)
    assert looks == [1, 4, 2, 1, 3, 3], looks
    for c in out.values():
        assert len(c.completion_ids) == int(c.request_id[1:]) * 3 + 5


@pytest.mark.parametrize("chunk", [4, 16])
def test_looking_once_per_chunk_gives_the_sequences_of_a_look_every_step(tiny, chunk):
    """Rows that sample EOS mid-chunk stop exactly there; what they draw later is dropped and
    no other row changes. In float64 the results agree bit for bit (in float32 a finished row
    that stays in the batch moves the other rows' floats in the last bits, as any batch mate
    does, and tiny-random's flat distributions then flip a draw now and then)."""
    model, tok = tiny
    model = copy.deepcopy(model).double()
    runs = []
    for look_every_step in (True, False):
        engine = Engine(model, tok, max_batch=3, seed=4, look_every_step=look_every_step)
        engine.eos = set(range(100, 2100))  # ~4% of the vocabulary: EOS every ~25 tokens
        reqs = _mixed_requests(tok, 7)
        for req in reqs[:5]:
            engine.add(req)
        out, looks = {}, []
        look = engine._look
        engine._look = lambda b, look=look, looks=looks: looks.append((len(b.drawn), len(b))) or look(b)
        while engine.busy or reqs[5:]:
            if len(out) >= 3 and reqs[5:]:  # more arrive at a chunk boundary, as over the pipe
                for req in reqs[5:]:
                    engine.add(req)
                reqs = reqs[:5]
            out.update((c.request_id, c) for c in run_steps(engine, chunk))
        runs.append((out, looks))
    (every, every_looks), (chunked, chunked_looks) = runs
    assert {steps for steps, _ in every_looks} == {1}
    assert max(steps for steps, _ in chunked_looks) > 1  # stretches of steps did run
    kept = sum(len(c.completion_ids) for c in chunked.values())
    assert sum(steps * rows for steps, rows in chunked_looks) > kept  # tokens after EOS dropped
    assert set(every) == set(chunked) == {f"r{i}" for i in range(7)}
    assert any(c.finish == "stop" for c in every.values())
    for rid, c in every.items():
        d = chunked[rid]
        assert (d.completion_ids, d.logprobs, d.versions, d.finish) == \
            (c.completion_ids, c.logprobs, c.versions, c.finish), rid
        if c.finish == "stop":
            assert c.completion_ids[-1] in engine.eos
            assert not set(c.completion_ids[:-1]) & engine.eos
