"""workers/lora.py and the LoRA paths of both workers, in-process on embedded:tiny-random: a step
by hand, the frozen base, the published adapter, the rollout's hand-off (merged and unmerged)
against the merged export, resume, PEFT's folder format, the target errors."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from safetensors import safe_open

from areal_aio import wire
from areal_aio.store.safetensors_io import WeightStoreError
from areal_aio.workers import lora
from areal_aio.workers.models import TINY, encode_prompt, load_model
from areal_aio.workers.rollout.engine import Engine, Request
from areal_aio.workers.trainer.worker import Trainer
from tests.conftest import ROOT, generate_samples
from tests.conftest import TRAINER_PROMPTS as PROMPTS
from tests.conftest import TRAINER_SEED as SEED
from tests.conftest import TRAINER_TEMPERATURE as TEMPERATURE
from tests.conftest import trainer_settings as settings

RANK, ALPHA = 4, 8.0
LORA = (f"lora.rank={RANK}", f"lora.alpha={ALPHA}")
TARGETS = "lora.targets=['q_proj', 'down_proj']"
"""Two kinds of layer of the two blocks: a hand computation of four adapted layers."""
LR = 1e-2


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def batch() -> list[wire.TrainSample]:
    return generate_samples(*load_model(TINY, seed=SEED))


def make_trainer(folder: Path, *overrides: str, seed: int = SEED) -> Trainer:
    folder.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(TINY, seed=seed)
    torch.manual_seed(SEED)  # lora_A's start, as the worker's build() seeds it
    return Trainer(settings(*LORA, *overrides).to_dict(), folder, model=model, tokenizer=tok)


def sft_samples(tok: Any) -> list[wire.TrainSample]:
    pairs = [(PROMPTS[0], [5, 6, 7, 2]), (PROMPTS[1], [8, 9, 2]), (PROMPTS[0], [11, 2])]
    return [wire.TrainSample(encode_prompt(tok, p), c, [0.0] * len(c), [0] * len(c), 0.0, 0) for p, c in pairs]


def base_bytes(model: Any) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in lora.base_state(model).items()}


# ---- the trainer ---------------------------------------------------------------------------------


def test_a_lora_step_equals_a_hand_computation_and_leaves_the_base_alone(tmp_path) -> None:
    """One SFT step: the gradients of A and B are those of base + scale * B A written out by hand
    (forward hooks on a plain model), the step is AdamW's first step by hand, nothing else has a
    gradient or optimizer state, and after more steps the base's bytes are the ones loaded."""
    trainer = make_trainer(tmp_path, TARGETS, f"trainer.lr={LR}", "trainer.grad_clip=0")
    layers = lora.layers(trainer.model)
    assert sorted(layers) == [f"model.layers.{i}.{m}" for i in range(2) for m in ("mlp.down_proj", "self_attn.q_proj")]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at 0, where A gets no gradient: give both one
        for m in layers.values():
            m.lora_B[lora.ADAPTER].weight.copy_(torch.randn(m.lora_B[lora.ADAPTER].weight.shape, generator=gen) * 0.1)
    start = {name: (m.lora_A[lora.ADAPTER].weight.detach().clone(), m.lora_B[lora.ADAPTER].weight.detach().clone())
             for name, m in layers.items()}
    before = base_bytes(trainer.model)
    assert [p for p in trainer.params] == [p for n, p in trainer.model.named_parameters() if ".lora_" in n]

    seen: dict[str, Any] = {}
    step = trainer.opt.step

    def spy(*args: Any, **kw: Any) -> Any:
        seen["grads"] = [p.grad.clone() for p in trainer.params]
        seen["others"] = [n for n, p in trainer.model.named_parameters() if ".lora_" not in n and p.grad is not None]
        return step(*args, **kw)

    trainer.opt.step = spy
    samples = sft_samples(trainer.tokenizer)
    trainer.train(wire.Train(0, 0, samples, objective="sft", publish=False))
    assert seen["others"] == [] and set(trainer.opt.state) == set(trainer.params)

    # by hand: a plain model of the same base, each adapted layer's output + scale * x A^T B^T
    plain, _ = load_model(TINY, seed=SEED)
    scale = ALPHA / RANK
    leaves = {name: (a.clone().requires_grad_(), b.clone().requires_grad_()) for name, (a, b) in start.items()}
    modules = dict(plain.named_modules())
    for name, (a, b) in leaves.items():
        modules[name].register_forward_hook(lambda mod, inp, out, a=a, b=b: out + scale * (inp[0] @ a.T) @ b.T)
    nll, n = torch.zeros(()), 0
    for s in samples:  # temperature 1, completion tokens only, token mean
        logits = plain(torch.tensor([s.prompt_ids + s.completion_ids])).logits[0]
        logp = torch.log_softmax(logits[len(s.prompt_ids) - 1:-1], -1)
        nll = nll - logp.gather(1, torch.tensor(s.completion_ids)[:, None]).sum()
        n += len(s.completion_ids)
    (nll / n).backward()
    hand = [g for name in layers for g in (leaves[name][0].grad, leaves[name][1].grad)]
    for got, want in zip(seen["grads"], hand, strict=True):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    # AdamW's first step: the moments' bias corrections leave lr * g / (|g| + eps)
    for name, m in layers.items():
        for got, (leaf, w) in zip((m.lora_A[lora.ADAPTER].weight, m.lora_B[lora.ADAPTER].weight),
                                  zip(leaves[name], start[name], strict=True), strict=True):
            torch.testing.assert_close(got.detach(), w - LR * leaf.grad / (leaf.grad.abs() + 1e-8),
                                       rtol=0, atol=1e-6)

    for k in range(1, 4):
        trainer.train(wire.Train(k, k, samples, objective="sft", publish=False))
    after = lora.base_state(trainer.model)
    assert all(torch.equal(after[name], t) for name, t in before.items()) and after.keys() == before.keys()


def test_the_published_version_is_the_adapter_alone(tmp_path, batch) -> None:
    trainer = make_trainer(tmp_path)
    reply = trainer.train(wire.Train(0, 0, batch))
    assert reply.stats["mismatch_kl"] < 1e-6 and reply.stats["ratio_max"] == 1.0
    with safe_open(reply.path, "pt") as fh:
        keys, meta = list(fh.keys()), fh.metadata()
        assert all(fh.get_tensor(k).dtype == torch.float32 for k in keys)
    assert meta == {"format": "lora", "scaling": repr(ALPHA / RANK), "rank": str(RANK), "version": "1"}
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    assert len(keys) == 2 * 7 * 2  # all-linear: q k v o gate up down in each of 2 blocks
    full = sum(t.numel() * 4 for t in lora.base_state(trainer.model).values())
    assert Path(reply.path).stat().st_size < full / 20


def test_reference_kl_is_the_base_without_a_copy_and_dropout_leaves_prox_alone(tmp_path, batch) -> None:
    trainer = make_trainer(tmp_path / "kl", "trainer.kl_coef=0.1", "trainer.kl_ref=ref", "trainer.lr=3e-2")
    assert trainer.ref is None  # with LoRA the reference is the base: the adapter turned off
    first = trainer.train(wire.Train(0, 0, batch)).stats
    second = trainer.train(wire.Train(1, 1, batch)).stats
    assert first["kl"] < 1e-9 < second["kl"]
    assert all(p.requires_grad for p in trainer.params)  # turned back on after the reference pass
    drop = make_trainer(tmp_path / "drop", "lora.dropout=0.5", "trainer.lr=3e-2")
    first = drop.train(wire.Train(0, 0, batch)).stats  # B = 0: dropout cannot change anything yet
    st = drop.train(wire.Train(1, 1, batch)).stats
    # pi_prox is a pass without dropout (behav came from the same weights: no mismatch), while
    # the gradient pass, with dropout, differs from it once B has moved
    assert first["mismatch_kl"] < 1e-6 and st["ratio_max"] > 1.0 + 1e-4 > st["ratio_min"] + 2e-4
    assert all(not m.lora_dropout[lora.ADAPTER].training for m in lora.layers(drop.model).values())


def test_bf16_autocast_lora_step_is_finite(tmp_path, batch) -> None:
    trainer = make_trainer(tmp_path, "trainer.bf16=true", "trainer.lr=1e-2")
    st = trainer.train(wire.Train(0, 0, batch)).stats
    assert all(v == v for v in st.values() if isinstance(v, float)) and st["grad_norm"] > 0
    assert st["ratio_min"] == st["ratio_max"] == 1.0 and st["mismatch_kl"] < 1e-2
    assert all(p.dtype == torch.float32 for p in trainer.params)


def test_a_resumed_lora_trainer_takes_the_same_next_step_bit_for_bit(tmp_path, batch) -> None:
    a = make_trainer(tmp_path / "a", "trainer.lr=1e-2")
    a.train(wire.Train(1, 0, batch))
    saved = a.save(wire.Save("checkpoint", str(tmp_path / "ckpt")))
    a.train(wire.Train(2, 1, batch))
    files = {p.name: p.stat().st_size for p in (tmp_path / "ckpt").iterdir()}
    assert set(files) == {"v1.safetensors", "optimizer.pt", "rng.pt", "state.json"}
    full = sum(t.numel() * 4 for t in lora.base_state(a.model).values())
    assert saved.bytes == sum(files.values()) < full / 10  # the adapter and its moments only
    b = make_trainer(tmp_path / "b", "trainer.lr=1e-2")
    path = b.resume(tmp_path / "ckpt")
    assert b.version == 1 and lora.read_adapter(path)[0]  # the adapter, published for the rollout
    b.train(wire.Train(2, 1, batch))
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    other = make_trainer(tmp_path / "c", seed=SEED + 1)  # another base under the same settings
    with pytest.raises(ValueError, match=r"trained on the base embedded:tiny-random \(weights sha256 \w{12}\), "
                                         r"this trainer loaded embedded:tiny-random \(sha256 \w{12}\)"):
        other.resume(tmp_path / "ckpt")
    full_ft = Trainer(settings().to_dict(), tmp_path / "c", *load_model(TINY, seed=SEED))
    with pytest.raises(ValueError, match="holds a LoRA adapter; this trainer has lora.rank = 0"):
        full_ft.resume(tmp_path / "ckpt")


def test_a_target_the_model_lacks_is_one_line_naming_its_linear_layers(tmp_path) -> None:
    with pytest.raises(ValueError) as info:
        make_trainer(tmp_path, "lora.targets=['q_proj', 'qkv_proj']")
    assert str(info.value) == ("lora.targets: 'qkv_proj' is not a linear layer of embedded:tiny-random; its "
                               "linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj")
    assert lora.target_problem(load_model(TINY)[0], ["self_attn.q_proj", "mlp.up_proj"], TINY) is None


# ---- the hand-off and the exports ----------------------------------------------------------------


def requests(tok: Any) -> list[Request]:
    return [Request(f"r{i}", encode_prompt(tok, p), 12, t, 1.0, seed=40 + i)
            for i, (p, t) in enumerate([(PROMPTS[0], TEMPERATURE), (PROMPTS[1], TEMPERATURE),
                                        (PROMPTS[0], 0.0), ("Count to three.", 1.0)])]


def generate(engine: Engine, reqs: list[Request]) -> dict[str, wire.Completion]:
    for r in reqs:
        engine.add(r)
    out = {}
    while engine.busy:
        out.update((c.request_id, c) for c in engine.step())
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, batch) -> tuple[Path, Path, Trainer]:
    """Two LoRA updates (v2, published), then the run's model/ and adapter/ (`sft`'s layout)."""
    tmp = tmp_path_factory.mktemp("trained")
    trainer = make_trainer(tmp / "shm", "trainer.lr=3e-2")
    trainer.train(wire.Train(0, 0, batch))
    path = Path(trainer.train(wire.Train(1, 1, batch)).path)
    trainer.save(wire.Save("model", str(tmp / "run" / "model")))
    return path, tmp / "run", trainer


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "unmerged"])
def test_rollout_after_a_handoff_generates_what_the_merged_model_generates(trained, merge) -> None:
    """The rollout worker's own base plus the published adapter against the exported model/ loaded
    by transformers alone: merged, the same bits; unmerged (peft's layers), the same tokens and
    log-probs to fp32 rounding."""
    from transformers import AutoModelForCausalLM

    path, run, trainer = trained
    base, tok = load_model(TINY, seed=SEED)
    cfg = trainer.lora if merge else type(trainer.lora)(rank=RANK, alpha=ALPHA, merge=False)
    engine = Engine(base, tok, max_batch=4, seed=5, load=lora.handoff(cfg, TINY))
    loaded, _ = engine.update_weights(2, str(path))
    assert loaded.version == 2
    got = generate(engine, requests(tok))
    want = generate(Engine(AutoModelForCausalLM.from_pretrained(run / "model"), tok, max_batch=4, seed=5),
                    requests(tok))
    assert got.keys() == want.keys()
    for rid, c in got.items():
        assert c.completion_ids == want[rid].completion_ids and set(c.versions) == {2}
        if merge:
            assert c.logprobs == want[rid].logprobs
        else:
            assert max(abs(a - b) for a, b in zip(c.logprobs, want[rid].logprobs, strict=True)) < 1e-5
    v0, _ = load_model(TINY, seed=SEED)
    moved = [n for n, t in lora.base_state(engine.model).items() if not torch.equal(t, v0.state_dict()[n])]
    assert bool(moved) is merge  # unmerged: the rollout's base is never written


def test_an_int8_rollout_merges_each_version_then_requantizes_it(trained) -> None:
    """rollout.quantize = int8 with lora.merge: the merge writes the float32 weights, then the
    int8 copy is rebuilt from them, the same as quantizing the exported merged model."""
    from transformers import AutoModelForCausalLM

    from areal_aio.workers.rollout import int8

    path, run, trainer = trained
    base, tok = load_model(TINY, seed=SEED)
    load = int8.refreshing(lora.handoff(trainer.lora, TINY), int8.quantize(base))
    load(base, str(path))
    merged = AutoModelForCausalLM.from_pretrained(run / "model")
    int8.quantize(merged)
    ids = torch.tensor([tok.encode("Calculate 3 + 4.")])
    with torch.no_grad():
        assert torch.equal(base(ids).logits, merged(ids).logits)


def test_each_merge_starts_from_the_pristine_base(tmp_path, trained) -> None:
    """v1 then v2 gives the bits of v2 alone, and a mid-generation hand-off versions the tokens
    and rebuilds the rows as a full-weights one does."""
    path, _, trainer = trained
    v1 = trainer.store.publish_state({k: t * 0.5 for k, t in lora.adapter_state(trainer.model).items()}, 1,
                                     metadata=lora.metadata(trainer.lora))
    once, tok = load_model(TINY, seed=SEED)
    lora.MergedAdapter()(once, path)
    twice = Engine(load_model(TINY, seed=SEED)[0], tok, max_batch=4, seed=5, load=lora.MergedAdapter())
    for r in requests(tok):
        twice.add(r)
    twice.advance(4)
    loaded, _ = twice.update_weights(1, str(v1))
    twice.advance(3)
    twice.update_weights(2, str(path))
    out = generate(twice, [])
    assert loaded.rebuilt == 4 and all(c.interrupts == 2 for c in out.values())
    assert all(c.versions == sorted(c.versions) and {0, 1, 2} <= set(c.versions) for c in out.values())
    for name, t in once.state_dict().items():
        assert torch.equal(t, twice.model.state_dict()[name]), name


def test_adapter_folder_is_peft_format_and_loads_merged_as_a_model(trained) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, run, trainer = trained
    folder = run / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", lora.BASE_FILE, "tokenizer.json"} <= {
        p.name for p in folder.iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(run / "model")
    peft_model = PeftModel.from_pretrained(load_model(TINY, seed=SEED)[0], str(folder))
    ours, _ = load_model(str(folder))  # what `eval adapter/` loads: base + adapter, merged
    ids = torch.tensor([encode_prompt(trainer.tokenizer, PROMPTS[1])])
    with torch.no_grad():
        want = merged(ids).logits
        torch.testing.assert_close(peft_model(ids).logits, want, rtol=0, atol=1e-5)
        assert torch.equal(ours(ids).logits, want)


def test_an_adapter_that_does_not_fit_is_refused(tmp_path, trained) -> None:
    path, _, trainer = trained
    full = trainer.store.publish(load_model(TINY)[0], 9)
    with pytest.raises(WeightStoreError, match="not a LoRA adapter"):
        lora.MergedAdapter()(load_model(TINY)[0], full)
    other = copy.deepcopy(trainer.lora)
    with pytest.raises(WeightStoreError, match="not the layers this model adapts"):
        narrow = load_model(TINY)[0]
        lora.attach(narrow, type(other)(rank=RANK, targets=["q_proj"]), TINY)
        lora.load_adapter(narrow, path)


# ---- subprocesses: the check-time probe, two trainer ranks, a whole run ------------------------


@pytest.mark.slow
def test_check_time_probe_names_a_bad_target_without_torch_here() -> None:
    from areal_aio.workers.models import lora_target_problem

    assert lora_target_problem(TINY, ["q_proj", "mlp.up_proj"]) is None
    assert lora_target_problem(TINY, "all-linear") is None  # nothing to look up
    # a dotted name must end a module's path, as peft (and the trainer's start) match it
    assert lora_target_problem(TINY, ["self_attn.q_proj"]) is None
    assert lora_target_problem(TINY, ["mlp.q_proj"]).startswith("lora.targets: 'mlp.q_proj' is not a linear")
    assert lora_target_problem(TINY, ["qkv_proj"]) == (
        "lora.targets: 'qkv_proj' is not a linear layer of embedded:tiny-random; its linear layers: "
        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj")


DP_WEIGHTS_ATOL = 1e-5
"""The bound of the full-weights rank test (tests/workers/trainer/test_data_parallel.py)."""


@pytest.mark.slow
async def test_two_gloo_ranks_reach_the_adapter_of_one_rank(tmp_path, batch) -> None:
    """Packed groups split over two ranks, two mini-batches: only the adapter's gradients are
    all-reduced, and after 3 steps the adapters of 1 and 2 ranks agree within 1e-5."""
    from areal_aio.fleet import placement
    from areal_aio.fleet.trainer_ranks import TrainerRanks
    from areal_aio.settings import build_settings

    base = (f"model.path={TINY}", f"run.seed={SEED}", "trainer.bf16=off", "trainer.lr=1e-2",
            f"rollout.temperature={TEMPERATURE}", "rollout.group_size=4", "rollout.dtype=float32",
            f"trainer.batch_size={len(batch)}", "trainer.threads=1", "trainer.share_prompts=on",
            "trainer.minibatches=2", "trainer.micro_tokens=80", *LORA)
    runs = {}
    for name, extra in (("one", ()), ("two", ("trainer.devices=2",))):
        s = build_settings({}, (*base, *extra))
        client = placement.trainer_client(s, tmp_path)
        assert isinstance(client, TrainerRanks) is (name == "two")
        (tmp_path / name).mkdir()
        replies = []
        try:
            await client.start(wire.Init("trainer", s.to_dict(), str(tmp_path / name)))
            for step in range(3):
                await client.send(wire.Train(step=step + 1, version=step, samples=batch))
                reply = await client.recv()
                assert isinstance(reply, wire.Trained), client.failure(reply)
                replies.append(reply)
        finally:
            await client.stop()
        runs[name] = replies
    (a, _), (b, _) = (lora.read_adapter(r[-1].path) for r in (runs["one"], runs["two"]))
    assert a.keys() == b.keys() and len(a) == 14
    diff = max((x - y).abs().max().item() for k in a for x, y in zip(a[k], b[k], strict=True))
    moved = max(b_.abs().max().item() for _, b_ in a.values())  # B started at 0
    assert diff <= DP_WEIGHTS_ATOL < moved / 100, (diff, moved)
    for x, y in zip(runs["one"], runs["two"], strict=True):
        assert y.stats["loss"] == pytest.approx(x.stats["loss"], rel=1e-5, abs=1e-7)
        assert y.stats["grad_norm"] == pytest.approx(x.stats["grad_norm"], rel=1e-5)


RUN_CHILD = """
import asyncio, itertools, sys
from areal_aio.control.controller import Orchestrator
from areal_aio.settings import build_settings
from areal_aio.tasks.task import Task

def vowel_share(task, completion):
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0

out, resume = sys.argv[1], sys.argv[2] == "resume"
tasks = [Task(f"t{i}", f"Write something about topic number {i}.", "") for i in range(300)]
held_out = [Task(f"e{i}", f"Write something about topic number {i}.", "") for i in range(300, 304)]
orch = Orchestrator(build_settings({}, sys.argv[3:]), tasks=itertools.cycle(tasks), eval_set=held_out,
                    reward=vowel_share, out_dir=None if resume else out, resume=out if resume else None)
print(asyncio.run(orch.run())["steps"])
"""
EXACT = ["model.path=embedded:tiny-random", "rollout.max_new_tokens=12", "rollout.group_size=4",
         "trainer.batch_size=8", "task.eval_size=8", "task.eval_every=2", "run.progress=false",
         "trainer.bf16=false", "controller.reward_procs=0", "run.mode=sync", "run.checkpoint_every=2",
         "rollout.max_batch=1", "rollout.temperature=1.0", "trainer.lr=3e-2", "run.max_steps=4",
         "lora.rank=4", "lora.alpha=8.0"]
"""The exact-resume run of tests/test_e2e.py (sync, fp32, one row at a time), with LoRA."""


def child(out: Path, how: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUN_CHILD, str(out), how, *EXACT], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def kill_after_checkpoint(proc: subprocess.Popen, folder: Path, step: int) -> None:
    """SIGKILL to the whole process group once the checkpoint of `step` is complete (a later one
    written meanwhile is removed: as if it died right after `step`)."""
    manifest = folder / "checkpoints" / f"step-{step:06d}" / "manifest.json"
    deadline = time.time() + 300
    while not manifest.exists():
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for later in folder.glob("checkpoints/step-*"):
        if later.name > manifest.parent.name:
            shutil.rmtree(later)


@pytest.mark.slow
def test_a_lora_run_keeps_model_and_adapter_resumes_exactly_and_eval_takes_either(tmp_path) -> None:
    """A sync fp32 LoRA run killed after its checkpoint and resumed ends with the bytes of the
    uninterrupted one (model/ and adapter/); model/ loads with transformers alone; the checkpoint
    holds the adapter and its base's identity; eval scores adapter/ as it scores model/."""
    from transformers import AutoModelForCausalLM

    from areal_aio.control.evaluation import evaluate_model, model_settings

    whole, cut = child(tmp_path / "whole", "new"), child(tmp_path / "cut", "new")
    kill_after_checkpoint(cut, tmp_path / "cut", 2)
    assert whole.wait(300) == 0, whole.stderr.read()
    resumed = child(tmp_path / "cut", "resume")
    assert resumed.wait(300) == 0, resumed.stderr.read()

    for run in ("whole", "cut"):
        assert {"model", "adapter"} <= {p.name for p in (tmp_path / run).iterdir()}
    for name in ("model/model.safetensors", "adapter/adapter_model.safetensors"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes(), name
    rows = [[(r["step"], r["reply"], r["reward"]) for r in map(orjson.loads, (tmp_path / run / "samples.jsonl")
             .read_bytes().splitlines()) if r["kind"] == "train"] for run in ("whole", "cut")]
    assert rows[0] == rows[1] and len(rows[0]) == 4 * 8 and len({r[2] for r in rows[0]}) > 1
    ckpt = tmp_path / "whole" / "checkpoints" / "step-000004" / "trainer"
    model_bytes = (tmp_path / "whole" / "model" / "model.safetensors").stat().st_size
    assert (ckpt / "v4.safetensors").stat().st_size < model_bytes / 20
    state = orjson.loads((ckpt / "state.json").read_bytes())
    assert state["version"] == 4 and state["base"]["path"] == TINY and len(state["base"]["sha256"]) == 64
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "model")  # transformers alone
    assert model.config.use_cache and not any("lora" in n for n in model.state_dict())

    done = subprocess.run([sys.executable, "-m", "areal_aio", "eval", str(tmp_path / "whole"), "--out",
                           str(tmp_path / "eval-model.json")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # adapter/ through the eval command's own path (its settings, then evaluate_model); the
    # command's preflight takes a folder with config.json only, for now (docs/lora.md)
    settings, spec, _ = model_settings(str(tmp_path / "whole" / "adapter"), str(tmp_path / "whole" / "settings.toml"), [])
    assert spec == str(tmp_path / "whole" / "adapter")
    asyncio.run(evaluate_model(settings, tmp_path / "eval-adapter.json"))
    replies = {name: [r["reply"] for r in orjson.loads((tmp_path / f"eval-{name}.json").read_bytes())["samples"]]
               for name in ("model", "adapter")}
    assert replies["model"] == replies["adapter"] and len(replies["model"]) == 8
