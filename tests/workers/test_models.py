import subprocess
import sys
import time

import pytest
import torch

from areal_aio.store import model_cache
from areal_aio.workers import models


def test_tiny_random_is_deterministic_from_the_seed():
    a, tok = models.load_model(models.TINY, seed=3)
    b, _ = models.load_model(models.TINY, seed=3)
    c, _ = models.load_model(models.TINY, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.config.model_type == "llama" and a.config.vocab_size == len(tok)
    assert sum(p.numel() for p in a.parameters()) < 5_000_000


def test_chat_template_is_applied_the_same_way():
    tok = models.load_tokenizer(models.TINY)
    ids = models.encode_prompt(tok, "Calculate 1 + 2.")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    custom = tok.decode(models.encode_prompt(tok, "hi", system_prompt="Be brief."))
    assert "Be brief." in custom and "SmolLM" not in custom


def test_unknown_embedded_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown embedded model 'embedded:nope'"):
        models.prepare("embedded:nope")


@pytest.mark.slow
def test_embedded_smollm2_converts_once_then_loads_from_cache():
    models.prepare(models.SMOLLM2)  # downloads and converts on a fresh machine (~25 s), else nothing
    assert model_cache.is_cached(models.SMOLLM2)
    t0 = time.perf_counter()
    again = subprocess.run([sys.executable, "-m", "areal_aio.workers.models", "prepare", models.SMOLLM2],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "dequantizing" not in again.stderr and "downloading" not in again.stderr
    assert time.perf_counter() - t0 < 20
    t0 = time.perf_counter()
    model, tok = models.load_model(models.SMOLLM2)
    load_s = time.perf_counter() - t0
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert load_s < 20, f"cached load took {load_s:.1f}s"
    ids = torch.tensor([models.encode_prompt(tok, "What is 2 + 2?")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert "4" in tok.decode(out[0, ids.shape[1]:])


def test_an_episode_built_incrementally_matches_the_template_of_the_whole_chat_but_where_said():
    """An episode's ids grow as prompt + reply ids + each turn's own ids (encode_turns) and are
    never templated again. Against the chat template of the whole conversation at once they
    differ in exactly two ways: the template's '\\n' after the last reply's end of turn (an
    episode ends at the EOS the model generated), and a reply whose sampled ids are not the
    tokenizer's own split of its text (the episode keeps what was sampled: those are the ids
    trained, with their log-probs)."""
    tok = models.load_tokenizer(models.TINY)
    eos = tok.eos_token_id

    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    chat = [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "<calc>6*7</calc>"},
            {"role": "tool", "content": "42"}, {"role": "assistant", "content": "<answer>42</answer>"}]
    whole = tok.apply_chat_template(chat, tokenize=False)
    reply1, reply2 = ids(chat[1]["content"]) + [eos], ids(chat[3]["content"]) + [eos]
    turn = models.encode_turns(tok, [chat[2]], closed=True)
    built = models.encode_prompt(tok, chat[0]["content"]) + reply1 + turn + reply2
    assert tok.decode(turn) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert built + ids("\n") == ids(whole)  # the only difference: the template's final '\n'

    # a reply cut at its length limit (no EOS): its turn closes the reply with the end of turn
    cut = models.encode_turns(tok, [chat[2]], closed=False)
    assert cut == [eos] + turn
    assert models.encode_prompt(tok, chat[0]["content"]) + reply1[:-1] + cut + reply2 + ids("\n") == ids(whole)

    # a reply sampled as other ids for the same text: kept as sampled, not as the template splits it
    split = [t for ch in "<answer>42</answer>" for t in ids(ch)] + [eos]
    assert split != reply2 and tok.decode(split) == tok.decode(reply2)
    resampled = models.encode_prompt(tok, chat[0]["content"]) + reply1 + turn + split
    assert resampled + ids("\n") != ids(whole) and tok.decode(resampled + ids("\n")) == whole


def test_random_weights_in_bf16_keep_fp32_rope_frequencies():
    """As from_pretrained keeps them: a bf16 random shape (a trainer's bf16-loaded LoRA base, a bf16
    rollout) rotates positions with the frequencies the fp32 model uses."""
    model, _ = models.load_model(models.TINY, seed=3, dtype="bfloat16")
    wide, _ = models.load_model(models.TINY, seed=3)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(torch.equal(b, w) for b, w in zip(model.buffers(), wide.buffers(), strict=True))
