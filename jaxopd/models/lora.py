"""LoRA adapters: low-rank updates of the attention and MLP projections, trained while the base stays frozen.

Owns the adapter pytree (``{"<layer>.<target>": {"a": [in, r], "b": [r, out]}}``, ``b`` zero at the start so the
adapted model starts as its base), ``merge`` (the base's parameters plus ``alpha / r · a @ b`` on each target, a pure
function that runs inside ``jit``), and the adapter folder: PEFT's ``adapter_config.json`` and
``adapter_model.safetensors`` (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]`` in Hugging Face's layout, so
``peft`` loads it over the same base), plus which base it adapts (a fetched model's name or a folder) and, for a
student cut from its base, the kept layers. ``jaxopd.models.folders`` loads such a folder as a model.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxopd.models.decoder import CausalLM
from jaxopd.models.weights import CheckpointError, SafetensorsFile, write_safetensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# target (PEFT's module name) → (path below ``layers/<i>``, HF module path, leading axes of the weight that are input)
TARGETS: dict[str, tuple[tuple[str, str], str, int]] = {
    "q_proj": (("attn", "q_weight_dnh"), "self_attn.q_proj", 1),
    "k_proj": (("attn", "k_weight_dkh"), "self_attn.k_proj", 1),
    "v_proj": (("attn", "v_weight_dkh"), "self_attn.v_proj", 1),
    "o_proj": (("attn", "o_weight_nhd"), "self_attn.o_proj", 2),
    "gate_proj": (("mlp", "gate_weight_df"), "mlp.gate_proj", 1),
    "up_proj": (("mlp", "up_weight_df"), "mlp.up_proj", 1),
    "down_proj": (("mlp", "down_weight_fd"), "mlp.down_proj", 1),
}

Adapters = dict[str, dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = tuple(TARGETS)
    layers: tuple[int, ...] | None = None          # the layers that get adapters (None: every layer)

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets must be among {list(TARGETS)}, got {list(self.targets)}")
        if self.layers is not None:
            layers = tuple(self.layers)
            if not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers) \
                    or list(layers) != sorted(set(layers)):
                raise ValueError(f"LoRA layers must be increasing layer indices, each once, got {list(layers)}")
            object.__setattr__(self, "layers", layers)

    def adapted_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers of a ``num_layers``-layer model that get adapters; ``ValueError`` for a layer it lacks."""
        if self.layers is None:
            return tuple(range(num_layers))
        if self.layers[-1] >= num_layers:
            raise ValueError(f"LoRA layers {list(self.layers)} name layer {self.layers[-1]}; the model has "
                             f"{num_layers} layers")
        return self.layers

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _weight(params: nnx.State, layer: int, target: str) -> Any:
    (module, name), _, _ = TARGETS[target]
    return params["layers"][layer][module][name]


def _in_out(shape: Sequence[int], target: str) -> tuple[int, int]:
    split = TARGETS[target][2]
    return int(np.prod(shape[:split])), int(np.prod(shape[split:]))


def init_adapters(params: nnx.State, config: LoraConfig, key: jax.Array, *, num_layers: int) -> Adapters:
    """Fresh adapters for every adapted layer and target: ``a`` uniform in ±1/√in (PEFT's Kaiming default), ``b``
    zero. Adapters on the upper layers only (``config.layers``) also spare the backward pass through the layers
    below them: nothing there is differentiated."""
    adapters: Adapters = {}
    for layer in config.adapted_layers(num_layers):
        for target in config.targets:
            weight = _weight(params, layer, target)
            fan_in, fan_out = _in_out(weight.shape, target)
            key, sub = jax.random.split(key)
            bound = 1.0 / math.sqrt(fan_in)
            adapters[f"{layer}.{target}"] = {
                "a": jax.random.uniform(sub, (fan_in, config.rank), jnp.float32, -bound, bound),
                "b": jnp.zeros((config.rank, fan_out), jnp.float32)}
    return adapters


def merge(params: nnx.State, adapters: Adapters, config: LoraConfig) -> nnx.State:
    """``params`` with ``scale · a @ b`` added to each adapted weight (a new state; ``params`` is untouched).
    Differentiable in ``adapters`` and usable inside ``jit``."""
    merged = jax.tree.map(lambda x: x, params)
    for name, pair in adapters.items():
        layer, target = name.split(".", 1)
        variable = _weight(merged, int(layer), target)
        base = variable[...]
        delta = (pair["a"] @ pair["b"]) * config.scale
        variable.set_value(base + delta.reshape(base.shape).astype(base.dtype))
    return merged


def merged_model(model: CausalLM, adapters: Adapters, config: LoraConfig) -> CausalLM:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graphdef, merge(params, adapters, config), rest)


# ----------------------------------------------------------------------------------------------------------
# The adapter folder
# ----------------------------------------------------------------------------------------------------------
def _hf_key(name: str, which: str) -> str:
    layer, target = name.split(".", 1)
    return f"base_model.model.model.layers.{layer}.{TARGETS[target][1]}.lora_{which}.weight"


def save_adapters(folder: str | os.PathLike, adapters: Adapters, config: LoraConfig, *, base: str,
                  layers: Sequence[int] | None = None, dtype: Any = np.float32) -> Path:
    """Write ``adapters`` as a PEFT adapter folder over ``base`` (a fetched model's name, or a folder: stored
    relative to ``folder`` when it is one); ``layers``: the base's layers the adapted model keeps (a cut student).
    ``jaxopd.models.folders.save_adapted`` also writes the adapted model's ``config.json`` and tokenizer beside."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, pair in adapters.items():
        tensors[_hf_key(name, "A")] = np.asarray(jax.device_get(pair["a"])).T.astype(dtype)
        tensors[_hf_key(name, "B")] = np.asarray(jax.device_get(pair["b"])).T.astype(dtype)
    base_ref = base
    if Path(base).is_dir():
        base_ref = os.path.relpath(Path(base).resolve(), folder.resolve())
    record = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank, "lora_alpha": config.alpha,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "target_modules": list(config.targets), "base_model_name_or_path": base_ref,
              "layers_to_transform": None if config.layers is None else list(config.layers),
              "jaxopd_layers": list(map(int, layers)) if layers is not None else None}
    write_safetensors(folder / ADAPTER_WEIGHTS, tensors, {"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(record, indent=2) + "\n")
    return folder


def is_adapter_folder(folder: str | os.PathLike) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def read_adapter_config(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / ADAPTER_CONFIG
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    for field in ("r", "lora_alpha", "target_modules", "base_model_name_or_path"):
        if field not in record:
            raise CheckpointError(f"{path} has no {field!r}")
    if record.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {record['peft_type']!r} is not LORA")
    return record


def load_adapters(folder: str | os.PathLike) -> tuple[Adapters, LoraConfig, list[int] | None]:
    """The adapters, their config and the kept layers of an adapter folder."""
    record = read_adapter_config(folder)
    try:
        adapted = record.get("layers_to_transform")
        if isinstance(adapted, int):
            adapted = [adapted]
        config = LoraConfig(int(record["r"]), float(record["lora_alpha"]), tuple(record["target_modules"]),
                            None if adapted is None else tuple(int(i) for i in adapted))
    except ValueError as e:
        raise CheckpointError(f"{Path(folder) / ADAPTER_CONFIG}: {e}") from None
    weights = SafetensorsFile(Path(folder) / ADAPTER_WEIGHTS)
    keys = set(weights.keys())
    adapters: Adapters = {}
    for key in sorted(keys):
        if not key.endswith(".lora_A.weight"):
            continue
        rest = key[len("base_model.model.model.layers."):-len(".lora_A.weight")]
        layer, module = rest.split(".", 1)
        target = next((t for t, (_, hf, _) in TARGETS.items() if hf == module), None)
        b_key = key.replace(".lora_A.", ".lora_B.")
        if target is None or b_key not in keys:
            raise CheckpointError(f"{Path(folder) / ADAPTER_WEIGHTS}: unexpected tensor {key!r}")
        adapters[f"{int(layer)}.{target}"] = {"a": jnp.asarray(np.asarray(weights[key], np.float32).T),
                                              "b": jnp.asarray(np.asarray(weights[b_key], np.float32).T)}
    layers = record.get("jaxopd_layers")
    return adapters, config, layers


def check_fits(adapters: Adapters, config: LoraConfig, model: CausalLM, where: str) -> None:
    """``CheckpointError`` unless every adapter names a layer and target of ``model`` with the matching shapes."""
    params = nnx.state(model, nnx.Param)
    for name, pair in adapters.items():
        layer, target = name.split(".", 1)
        if not 0 <= int(layer) < model.config.num_layers:
            raise CheckpointError(f"{where}: adapter for layer {layer}, the model has {model.config.num_layers} layers")
        fan_in, fan_out = _in_out(_weight(params, int(layer), target).shape, target)
        if tuple(pair["a"].shape) != (fan_in, config.rank) or tuple(pair["b"].shape) != (config.rank, fan_out):
            raise CheckpointError(f"{where}: adapter {name} has shapes {tuple(pair['a'].shape)} / "
                                  f"{tuple(pair['b'].shape)}, expected ({fan_in}, {config.rank}) / "
                                  f"({config.rank}, {fan_out})")
