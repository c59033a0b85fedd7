"""The method registry: method name -> ``Method`` class (one file per method)."""
from __future__ import annotations

from jaxopd.methods.actfirst import ActFirstOPD
from jaxopd.methods.actionopd import ActionOPD
from jaxopd.methods.base import Method
from jaxopd.methods.config import RunConfig
from jaxopd.methods.sti import STIOPD
from jaxopd.methods.vanilla import VanillaOPD

METHOD_CLASSES: dict[str, type[Method]] = {"vanilla-opd": VanillaOPD, "sti": STIOPD, "actionopd": ActionOPD}


def method_class(name: str) -> type[Method]:
    if name.startswith("actfirst"):
        return ActFirstOPD
    if name not in METHOD_CLASSES:
        raise ValueError(f"no distillation method {name!r}; expected one of {sorted(METHOD_CLASSES)} "
                         "or actfirst[-ablation]")
    return METHOD_CLASSES[name]


def make_method(config: RunConfig) -> Method:
    return method_class(config.method)(config)


__all__ = ["METHOD_CLASSES", "method_class", "make_method"]
