"""What a model folder may be, and the one way the command lines get a model.

Owns ``load_folder``: a Hugging Face folder (``weights.load_model``) or a LoRA adapter folder (``lora``: its base,
itself any model folder or a fetched model's name, cut to the kept layers, with the adapters merged in);
``load_or_init`` (a folder, or a random-initialised preset); ``base_reference`` (how an adapter folder names its
base: a fetched catalogue model by name, so that the folder works on any machine after the fetch); and
``save_adapted`` (adapters plus the adapted model's ``config.json``, so every folder check takes the folder like any
other); ``load_folder_tokenizer`` / ``check_folder_tokenizer`` (a folder's tokenizer: its own files, else its base's
along the chain of adapter folders, so an adapter folder carries no copy of the base's 3.5 MB tokenizer).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from flax import nnx

from jaxopd.models.decoder import CausalLM, ModelConfig
from jaxopd.models.lora import (ADAPTER_CONFIG, Adapters, LoraConfig, check_fits, is_adapter_folder, load_adapters,
                                merged_model, read_adapter_config, save_adapters)
from jaxopd.models.pretrained import PRETRAINED, catalogue_name, resolve_model_dir
from jaxopd.models.weights import CheckpointError, cut_layers, load_model

MAX_ADAPTER_DEPTH = 8       # adapters over adapters over …: a cycle of folders stops here


def base_reference(folder: str | os.PathLike) -> str:
    """How an adapter folder names ``folder`` as its base: a fetched catalogue model by its name, else the path."""
    return catalogue_name(folder) or str(folder)


def base_folder(folder: str | os.PathLike) -> Path:
    """The folder of the base model an adapter folder adapts (a fetched model's name resolved in the cache)."""
    ref = read_adapter_config(folder)["base_model_name_or_path"]
    if ref in PRETRAINED:
        return resolve_model_dir(ref)
    path = Path(ref) if Path(ref).is_absolute() else Path(folder) / ref
    if not path.is_dir():
        raise CheckpointError(f"{Path(folder) / ADAPTER_CONFIG}: base model {ref!r} is not a folder or a fetched "
                              "model's name")
    return path


def load_folder(folder: str | os.PathLike, *, dtype: str | None = None, _depth: int = 0) -> CausalLM:
    """The model a folder holds: a Hugging Face folder, or an adapter folder's base (cut to its kept layers) with
    its adapters merged in."""
    if not is_adapter_folder(folder):
        return load_model(folder, dtype=dtype)
    if _depth >= MAX_ADAPTER_DEPTH:
        raise CheckpointError(f"{folder}: more than {MAX_ADAPTER_DEPTH} adapter folders over each other (a cycle?)")
    adapters, config, layers = load_adapters(folder)
    model = load_folder(base_folder(folder), dtype=dtype, _depth=_depth + 1)
    if layers is not None:
        try:
            model = cut_layers(model, layers)
        except ValueError as e:
            raise CheckpointError(f"{Path(folder) / ADAPTER_CONFIG}: jaxopd_layers: {e}") from None
    check_fits(adapters, config, model, str(folder))
    return merged_model(model, adapters, config)


def tokenizer_folder(folder: str | os.PathLike, *, _depth: int = 0) -> Path:
    """The folder whose tokenizer the model in ``folder`` uses: ``folder`` itself when it holds tokenizer files or
    is no adapter folder, else its base's (an adapter over an adapter over a fetched model: the fetched model's)."""
    from jaxopd.tokenizer import HF_TOKENIZER_FILES
    folder = Path(folder)
    if any((folder / name).is_file() for name in HF_TOKENIZER_FILES) or not is_adapter_folder(folder):
        return folder
    if _depth >= MAX_ADAPTER_DEPTH:
        raise CheckpointError(f"{folder}: more than {MAX_ADAPTER_DEPTH} adapter folders over each other (a cycle?)")
    return tokenizer_folder(base_folder(folder), _depth=_depth + 1)


def load_folder_tokenizer(folder: str | os.PathLike | None) -> Any:
    """``jaxopd.tokenizer.load_tokenizer`` of the model in ``folder`` (an adapter folder: its base's tokenizer);
    None: the offline Qwen3 tokenizer of the random-initialised presets."""
    from jaxopd.tokenizer import load_tokenizer
    return load_tokenizer(None if folder is None else tokenizer_folder(folder))


def check_folder_tokenizer(folder: str | os.PathLike) -> None:
    """``jaxopd.tokenizer.check_tokenizer_files`` of the folder that gives ``folder``'s tokenizer (a cheap input
    check: configs only). ``CheckpointError`` when an adapter folder's base is missing."""
    from jaxopd.tokenizer import check_tokenizer_files
    check_tokenizer_files(tokenizer_folder(folder))


def load_or_init(folder: str | os.PathLike | None, preset: str, *, seed: int = 0,
                 dtype: str | None = None) -> CausalLM:
    """The one way the command lines get a model: the folder ``folder`` (``load_folder``), or, when it is None, a
    random-initialised ``preset`` of ``jaxopd.models.decoder.PRESETS`` from ``seed``. Raises ``CheckpointError`` /
    ``OSError`` / ``ValueError`` naming what is wrong (the callers add their flag)."""
    if folder is not None:
        return load_folder(folder, dtype=dtype)
    config = ModelConfig.preset(preset) if dtype is None else ModelConfig.preset(preset, dtype=dtype)
    return CausalLM(config, rngs=nnx.Rngs(seed))


def save_adapted(folder: str | os.PathLike, adapters: Adapters, config: LoraConfig, *, base: str | os.PathLike,
                 model_config: ModelConfig, layers: Sequence[int] | None = None) -> Path:
    """An adapter folder over ``base`` (a folder or a fetched model's name) that also carries the adapted model's
    ``config.json`` (``model_config``); its tokenizer is the base's (``load_folder_tokenizer``)."""
    folder = Path(folder)
    ref = str(base) if str(base) in PRETRAINED else base_reference(base)
    save_adapters(folder, adapters, config, base=ref, layers=layers)
    (folder / "config.json").write_text(json.dumps(model_config.to_hf_dict(), indent=2))
    return folder


__all__ = ["base_reference", "base_folder", "check_folder_tokenizer", "load_folder", "load_folder_tokenizer",
           "load_or_init", "save_adapted", "tokenizer_folder"]
