"""The installed distribution owns no generic top-level import names: the folders kernels/, envs/ and experiments/
install as ``jaxopd_kernels``, ``jaxopd_envs`` and ``jaxopd_experiments`` (setup.py) and bench/ is not installed, so
Hugging Face's ``kernels`` (required by transformers >= 5.25) and PyPI's ``envs``, ``experiments`` and ``bench``
install beside jaxopd. kernels/ and envs/ have no ``__init__.py``: run from the repository root (on ``sys.path`` for
``python -m pytest`` and ``python -m experiments...``) they are no regular packages ``kernels`` / ``envs`` that
would shadow those distributions."""
from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OWN_NAMES = {"jaxopd", "jaxopd_envs", "jaxopd_kernels", "jaxopd_experiments"}
GENERIC_NAMES = ("kernels", "envs", "experiments", "bench")


def test_the_distribution_provides_only_its_own_top_level_names():
    found = [dist for dist in metadata.distributions() if dist.metadata["Name"] == "jaxopd"]
    assert found, "jaxopd is not installed: pip install -e ."
    for dist in found:
        top_level = set((dist.read_text("top_level.txt") or "").split())
        assert top_level == OWN_NAMES, f"{sorted(top_level)}: reinstall with pip install -e ."
    providers = metadata.packages_distributions()
    for name in GENERIC_NAMES:
        assert "jaxopd" not in providers.get(name, []), name
    for name in OWN_NAMES:
        assert "jaxopd" in providers.get(name, []), name


@pytest.mark.parametrize("folder", ["kernels", "envs"])
def test_the_folders_are_no_regular_packages_under_their_folder_names(folder):
    assert not (REPO / folder / "__init__.py").exists()
    spec = importlib.util.find_spec(folder)     # the repository root is on sys.path in this session
    # (a virtual environment may live inside the repository, as CI's .venv does: only the folder itself counts)
    assert spec is None or spec.origin is None or REPO / folder not in Path(spec.origin).resolve().parents, spec


def test_hugging_face_kernels_is_the_one_imported_as_kernels():
    try:
        version = metadata.version("kernels")
    except metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed (transformers < 5.25)")
    import kernels
    assert REPO / "kernels" not in Path(kernels.__file__).resolve().parents, (version, kernels.__file__)
    assert not hasattr(kernels, "get_backend")
    from jaxopd_kernels import registry                 # ours, under its own name
    assert registry.get_backend("reference").name == "reference"


def test_the_mapped_packages_are_served_from_their_folders():
    import jaxopd_envs.base
    import jaxopd_experiments
    import jaxopd_kernels.dense
    assert Path(jaxopd_kernels.dense.__file__).resolve().parent == REPO / "kernels"
    assert Path(jaxopd_envs.base.__file__).resolve().parent == REPO / "envs"
    assert Path(jaxopd_experiments.__file__).resolve().parent == REPO / "experiments"


@pytest.mark.parametrize("package", ["jaxopd_envs", "jaxopd_kernels"])
def test_the_namespace_packages_have_no_import_cycles(package):
    """pyproject's acyclic_siblings contract for the two namespace packages, which import-linter cannot name."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph(package, cache_dir=None)
    graph.add_module(package)
    assert len(graph.find_children(package)) > 2
    assert graph.nominate_cycle_breakers(package) == set()
