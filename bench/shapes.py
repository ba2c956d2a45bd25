"""Model folders at the shapes of real models, with random weights: what memory and step time are
measured on where the real weights cannot be fetched.

    SmolLM2-135M    Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, MLP 1536, vocab 49,152
    Qwen2.5-0.5B    Qwen2, 24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864, vocab 151,936
    Qwen2.5-1.5B    Qwen2, 28 layers, hidden 1536, 12 heads / 2 KV heads, MLP 8960, vocab 151,936

Each config is the published model's (all three tie the output layer to the input embedding;
Qwen2's q/k/v projections carry a bias). A folder holds config.json, model.safetensors in bf16
(as the published checkpoints are; drawn from `seed` by transformers' own initialisation) and
SmolLM2's tokenizer, whose ids all fit the larger vocabularies: a plain HF folder that
model.path takes. Measuring plumbing, memory and time, not learning.

    python bench/shapes.py qwen2.5-0.5b            # writes bench/out/shapes/qwen2.5-0.5b, prints it
    python bench/shapes.py qwen2.5-1.5b --out DIR
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

ROOT = REPO / "bench" / "out" / "shapes"
"""Where the folders are written by default (ignored by git)."""
QWEN_COMMON = {"model_type": "qwen2", "vocab_size": 151_936, "tie_word_embeddings": True,
               "rope_theta": 1_000_000.0, "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6,
               "hidden_act": "silu", "use_sliding_window": False}
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "vocab_size": 49_152, "tie_word_embeddings": True, "rope_theta": 100_000.0,
                     "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu"},
    "qwen2.5-0.5b": {**QWEN_COMMON, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2},
    "qwen2.5-1.5b": {**QWEN_COMMON, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2},
}
"""name -> the published config's fields that set its shape."""


def config(name: str, tok: Any = None, vocab: int | None = None) -> Any:
    """The transformers config of shape `name` (`vocab`: another vocabulary size), special token
    ids from `tok` (SmolLM2's)."""
    from transformers import AutoConfig

    fields = {**SHAPES[name], **({"vocab_size": vocab} if vocab else {})}
    model_type = fields.pop("model_type")
    if tok is not None:
        fields.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return AutoConfig.for_model(model_type, **fields)


def parameters(name: str) -> int:
    """Parameters of shape `name` (tied weights once), counted on the meta device: nothing allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config(name))
    return sum(p.numel() for p in model.parameters())


def model_folder(name: str, root: Path = ROOT, seed: int = 0, vocab: int | None = None) -> Path:
    """root/name: shape `name` as an HF folder (written once; a folder already there is reused);
    root/name-v<vocab> with another vocabulary size. Written into a temp folder renamed into
    place, so a crash leaves no half folder."""
    out = root / (f"{name}-v{vocab}" if vocab else name)
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    from areal_aio.workers.models import TINY, load_tokenizer

    if name not in SHAPES:
        raise ValueError(f"shape {name!r}; choose one of {', '.join(SHAPES)}")
    tok = load_tokenizer(TINY)  # SmolLM2's tokenizer, from the embedded model's cache
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-"))
    try:
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config(name, tok, vocab), dtype=torch.bfloat16)
        finally:
            torch.random.set_rng_state(state)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del model
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("--out", type=Path, default=ROOT, help="parent folder (default bench/out/shapes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=None, help="another vocabulary size (folder NAME-v<vocab>)")
    args = ap.parse_args(argv)
    print(model_folder(args.shape, args.out, args.seed, args.vocab))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
