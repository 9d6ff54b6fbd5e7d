"""A GGUF file converted once into a plain checkpoint directory (config.json, the tokenizer's
files, and float32 safetensors where a load asks for them) in the user's cache, so that later
loads, in any process, read that instead: transformers parses a GGUF's metadata again for the
config, the tokenizer and the weights (each parse of the embedded model's 49k-token vocabulary
takes seconds to tens of seconds on a small CPU) and rebuilds its own model to dequantize the
weights.

An entry is named by the file's path, size and modification time (a changed file is converted
again) and the transformers version that read it; it appears whole or not at all (written
aside, then renamed), its weights file too, and processes converting the same file at once wait
for the first (tensor-parallel ranks load together). A load that keeps the file's blocks reads
its weights from the file (models/gguf_file_weights.py) and asks for no weights file. The cache
lives in $PAGEDKV_CACHE_DIR, else $XDG_CACHE_HOME/pagedkv, else ~/.cache/pagedkv. Weights of
files over $PAGEDKV_GGUF_CACHE_MAX_BYTES (default 512 MiB: float32 weights take ~4-8x a quantized
file's size on disk) are read from the GGUF each time; 0 turns the cache off."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

logger = logging.getLogger("pagedkv.models.gguf_cache")

FORMAT = 1  # (bumped when what an entry holds changes)
COMPLETE = "pagedkv_gguf_source.json"  # written last: an entry without it is not used
WEIGHTS = "model.safetensors"  # (renamed into a complete entry when a load first asks for it)
DEFAULT_MAX_BYTES = 512 << 20


def cache_root() -> Path:
    if os.environ.get("PAGEDKV_CACHE_DIR"):
        return Path(os.environ["PAGEDKV_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv"


def max_bytes() -> int:
    return int(os.environ.get("PAGEDKV_GGUF_CACHE_MAX_BYTES", DEFAULT_MAX_BYTES))


def entry_name(path: str, reader_version: str) -> str:
    """The entry of `path` as it is now: its name, size and modification time, and the reader."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = f"{real}\0{stat.st_size}\0{stat.st_mtime_ns}\0{FORMAT}\0{reader_version}"
    return f"{Path(real).stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def converted(path: str, *, weights: bool = False, convert: Optional[Callable[[str, Path], None]] = None,
              convert_weights: Optional[Callable[[str, Path], None]] = None) -> Optional[str]:
    """The directory holding `path` converted (converting it now if no entry exists), with its
    float32 weights too where `weights`; None where the cache is off, the weights are asked for
    and the file is over the size limit, or the cache cannot be written. `convert(path,
    directory)` writes the config and tokenizer files into an empty directory, `convert_weights`
    the weights file (WEIGHTS) into one."""
    limit = max_bytes()
    if limit <= 0 or (weights and os.path.getsize(path) > limit):
        return None
    import transformers

    convert = convert or convert_with_transformers
    convert_weights = convert_weights or weights_with_transformers
    root = cache_root() / "gguf"
    entry = root / entry_name(path, transformers.__version__)
    if (entry / COMPLETE).is_file() and (not weights or (entry / WEIGHTS).is_file()):
        return str(entry)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{entry.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (another process converting it: wait, then use its entry)
            if not (entry / COMPLETE).is_file():
                _convert_into(path, entry, convert)
            if weights and not (entry / WEIGHTS).is_file():
                _convert_weights_into(path, entry, convert_weights)
    except OSError as error:
        logger.warning("GGUF cache not usable (%s): reading %s directly", error, path)
        return None
    return str(entry)


def _convert_into(path: str, entry: Path, convert: Callable[[str, Path], None]) -> None:
    logger.info("converting %s's config and tokenizer once into %s (later loads read that)", path, entry)
    shutil.rmtree(entry, ignore_errors=True)  # (an incomplete entry left by a killed process)
    aside = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        convert(path, aside)
        stat = os.stat(path)
        (aside / COMPLETE).write_text(json.dumps({"gguf": os.path.realpath(path), "size": stat.st_size,
                                                  "mtime_ns": stat.st_mtime_ns, "format": FORMAT}))
        os.rename(aside, entry)
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _convert_weights_into(path: str, entry: Path, convert_weights: Callable[[str, Path], None]) -> None:
    logger.info("converting %s's weights to float32 once into %s", path, entry)
    aside = Path(tempfile.mkdtemp(prefix=".weights-", dir=entry))
    try:
        convert_weights(path, aside)
        os.rename(aside / WEIGHTS, entry / WEIGHTS)
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def convert_with_transformers(path: str, directory: Path) -> None:
    """What transformers reads from the GGUF's metadata: config, tokenizer and generation config
    (where the file gives one)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    AutoConfig.from_pretrained(folder, gguf_file=name).save_pretrained(directory)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(directory)
    try:
        GenerationConfig.from_pretrained(folder, gguf_file=name).save_pretrained(directory)
    except (OSError, ValueError, TypeError):
        pass  # (the file gives none)


def weights_with_transformers(path: str, directory: Path) -> None:
    """The float32 weights transformers reads from the GGUF, under HF names, a shared tensor saved
    once, as WEIGHTS."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    weights, seen = {}, set()
    for weight_name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # (tied embeddings: the config says so, the loader ties them)
            continue
        seen.add(tensor.data_ptr())
        weights[weight_name] = tensor.detach().contiguous()
    save_file(weights, str(directory / WEIGHTS), metadata={"format": "pt"})
