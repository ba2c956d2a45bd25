"""A cold-start model in miniature for tests: embedded:tiny-random taught, in a few seconds on
CPU, to answer any prompt with one fixed step-format reply, so that runs with process rewards
see scorable steps and sample real continuations from them on the real workers.

How it learns fast: the (tied) embedding stays frozen and only the two layers and norms train,
against a softmax over the reply's own tokens (not the 49k vocabulary); tiny-random's
end-of-turn token is its pad token, whose embedding row the initializer zeroes (its logit would
be 0 forever), so that row gets a random vector first; last, the final norm is scaled up so the
reply's tokens beat the untrained rest of the vocabulary by a wide margin (sampling at
temperature 0.7 then writes the reply, and a continuation from a step prefix writes its rest).
"""

from __future__ import annotations

from pathlib import Path

from areal_aio.tasks.steps import render

REPLY = render(["2 + 1 = 3", "3 + 1 = 4"], "4")
"""What the model writes (a continuation from step 1 writes step 2 and the answer)."""
PROMPTS = ("Calculate 2 + 1 + 1.", "Calculate 1 + 3.")
SHARPEN = 5.0
"""Final-norm scale after training: 10 of 10 samples at temperature 0.7 were REPLY exactly."""


def build_step_model(folder: Path, steps: int = 150, lr: float = 1e-2) -> Path:
    """Train tiny-random (seed 0) to write REPLY after PROMPTS; save it with its tokenizer."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a few small matmuls: more threads only contend (several x slower)
    try:
        return _build(folder, steps, lr)
    finally:
        torch.set_num_threads(threads)


def _build(folder: Path, steps: int, lr: float) -> Path:
    import torch

    from areal_aio.workers.models import TINY, encode_prompt, load_model

    model, tok = load_model(TINY, seed=0)
    table = model.lm_head.weight  # tied: the input embedding too
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        table[tok.eos_token_id] = torch.randn(table.shape[1], generator=gen) * table[5:1000].std()
    table.requires_grad_(False)
    reply = tok.encode(REPLY, add_special_tokens=False) + [tok.eos_token_id]
    vocab = sorted(set(reply))
    targets = torch.tensor([vocab.index(t) for t in reply] * len(PROMPTS))
    rows = [encode_prompt(tok, p) + reply for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    predicts = torch.zeros((len(rows), width), dtype=torch.bool)  # positions whose next token is the reply's
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
        predicts[i, len(row) - len(reply) - 1:len(row) - 1] = True
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[predicts]
        loss = torch.nn.functional.cross_entropy(hidden @ table[vocab].T, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    table.requires_grad_(True)
    model.eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
