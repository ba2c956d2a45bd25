"""workers/trainer/microbatch.py: the packed layout's rows, positions, mask and targets, and the budget."""

from __future__ import annotations

import random

import pytest
import torch

from areal_aio import wire
from areal_aio.workers.trainer.microbatch import (
    build_micro_batch,
    build_packed_micro_batch,
    check_samples,
    group_row_length,
    plan_micro_batches,
    prompt_groups,
)

PAD = 0


def sample(prompt: list[int], completion: list[int], group: int = 0) -> wire.TrainSample:
    n = len(completion)
    return wire.TrainSample(prompt, completion, [-1.0] * n, [0] * n, 0.0, group)


def test_the_worked_example_of_the_module_docstring() -> None:
    prompt = [11, 12, 13]
    a, b, c = [21, 22, 23, 24], [31, 32], [41, 42, 43, 44, 45]
    samples = [sample(prompt, a), sample(prompt, b), sample(prompt, c)]
    mb = build_packed_micro_batch(samples, [[0, 1, 2]], torch.zeros(3), PAD, "cpu")
    assert mb.shared and mb.index == [0, 1, 2]
    assert mb.input_ids.tolist() == [[11, 12, 13, 21, 22, 23, 31, 41, 42, 43, 44]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 3, 3, 4, 5, 6]]
    assert mb.gather.tolist() == [2, 3, 4, 5, 2, 6, 2, 7, 8, 9, 10]
    assert mb.targets.tolist() == a + b + c
    assert mb.tokens == 11 and mb.computed == 11 == group_row_length(samples, [0, 1, 2])
    sees = mb.attention_mask[0, 0]  # [L, L]
    assert sees[4].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 4]  # a1: the prompt, a0, itself
    assert sees[6].nonzero()[:, 0].tolist() == [0, 1, 2, 6]  # b0: the prompt, itself
    assert sees[9].nonzero()[:, 0].tolist() == [0, 1, 2, 7, 8, 9]  # c2: not a, not b
    assert sees[:3].nonzero().tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [2, 1], [2, 2]]


def test_one_token_and_empty_replies_are_predicted_from_the_prompt_alone() -> None:
    prompt = [5, 6]
    samples = [sample(prompt, [7]), sample(prompt, []), sample(prompt, [8, 9])]
    mb = build_packed_micro_batch(samples, [[0, 1, 2]], torch.zeros(3), PAD, "cpu")
    assert mb.input_ids.tolist() == [[5, 6, 8]]  # the 1-token and empty replies take no position
    assert mb.gather.tolist() == [1, 1, 2] and mb.targets.tolist() == [7, 8, 9]
    assert mb.index == [0, 1, 2]


def test_padding_sees_itself_and_is_seen_by_no_one() -> None:
    samples = [sample([1, 2], [3, 4, 5], group=0), sample([6, 7, 8, 9], [10, 11, 12, 13, 14], group=1)]
    mb = build_packed_micro_batch(samples, [[0], [1]], torch.zeros(2), PAD, "cpu")
    assert mb.input_ids.shape == (2, 8) and mb.computed == 16
    sees = mb.attention_mask[0, 0]  # row 0: 4 real positions, then 4 pads
    assert not sees[:4, 4:].any()  # no real query sees a pad
    assert torch.equal(sees[4:, :], torch.eye(8, dtype=torch.bool)[4:])  # each pad only itself
    assert mb.gather.tolist() == [1, 2, 3, 8 + 3, 8 + 4, 8 + 5, 8 + 6, 8 + 7]


def test_the_unshared_layout_predicts_each_token_from_the_position_before_it() -> None:
    samples = [sample([1, 2], [3, 4]), sample([5, 6, 7], [8])]
    mb = build_micro_batch(samples, [0, 1], torch.zeros(2), PAD, "cpu")
    assert not mb.shared and mb.position_ids is None
    assert mb.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert mb.gather.tolist() == [1, 2, 4 + 2] and mb.targets.tolist() == [3, 4, 8]


def test_plans_keep_the_budget_on_computed_positions_and_cover_every_sample() -> None:
    rng = random.Random(0)
    samples = []
    for g in range(12):
        prompt = [1] * rng.randint(5, 30)
        samples += [sample(prompt, [2] * rng.randint(1, 64), group=g) for _ in range(rng.randint(1, 8))]
    adv = torch.zeros(len(samples))
    for packed in (True, False):
        mbs = plan_micro_batches(samples, 0, len(samples), adv, packed=packed, max_tokens=600,
                                 pad_id=PAD, device="cpu")
        assert [i for mb in mbs for i in mb.index] == list(range(len(samples)))
        assert sum(mb.tokens for mb in mbs) == sum(len(s.completion_ids) for s in samples)
        assert len(mbs) > 1 and all(mb.computed <= 600 or mb.input_ids.shape[0] == 1 for mb in mbs)
    # packed, the whole batch computes its real tokens plus the padding between group rows
    groups = prompt_groups(samples, 0, len(samples))
    one = plan_micro_batches(samples, 0, len(samples), adv, packed=True, max_tokens=10**6,
                             pad_id=PAD, device="cpu")[0]
    assert one.computed == len(groups) * max(group_row_length(samples, g) for g in groups)


def test_a_loss_mask_keeps_tool_turns_in_the_row_and_out_of_the_targets() -> None:
    """An episode: reply 21 22 | tool turn 91 92 93 | reply 23 24. Every token is in the row
    (the context); only the replies are targets, each predicted from the position before it."""
    prompt = [11, 12, 13]
    ids = [21, 22, 91, 92, 93, 23, 24]
    mask = [1, 1, 0, 0, 0, 1, 1]
    nan = float("nan")  # placeholders: a read would poison behav
    ep = wire.TrainSample(prompt, ids, [-0.1, -0.2, nan, nan, nan, -0.3, -0.4], [3, 3, -7, -7, -7, 4, 4],
                          1.0, 0, loss_mask=mask)
    other = sample(prompt, [31, 32])
    packed = build_packed_micro_batch([ep, other], [[0, 1]], torch.tensor([2.0, -1.0]), PAD, "cpu")
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 22, 91, 92, 93, 23, 31]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 3]]
    assert packed.targets.tolist() == [21, 22, 23, 24, 31, 32]
    assert packed.gather.tolist() == [2, 3, 7, 8, 2, 9]  # 23 from 93 (the turn's last), 24 from 23
    assert packed.behav.tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -1.0, -1.0])
    assert packed.adv.tolist() == [2.0] * 4 + [-1.0] * 2 and packed.tokens == 6
    flat = build_micro_batch([ep, other], [0, 1], torch.tensor([2.0, -1.0]), PAD, "cpu")
    width = flat.input_ids.shape[1]
    assert flat.input_ids[0].tolist() == prompt + ids
    assert flat.targets.tolist() == packed.targets.tolist()
    assert flat.gather.tolist() == [2, 3, 7, 8, width + 2, width + 3]
    assert torch.equal(flat.behav, packed.behav)


def test_a_loss_mask_of_the_wrong_length_is_refused() -> None:
    bad = wire.TrainSample([1], [2, 3], [0.0, 0.0], [0, 0], 0.0, 0, loss_mask=[1])
    with pytest.raises(ValueError, match="loss mask"):
        check_samples([bad])
