"""The package list, which pyproject.toml cannot say: the folders kernels/, envs/ and experiments/ install under the
import names jaxopd_kernels, jaxopd_envs and jaxopd_experiments (a package-dir mapping), never as generic top-level
names that other distributions own (Hugging Face's `kernels`, required by transformers >= 5.25, and `envs`,
`experiments` on PyPI). kernels/ and envs/ have no __init__.py, so that run from the repository root (which is then
on sys.path) they are no regular packages named `kernels` / `envs` shadowing those distributions; they install as
namespace packages. bench/ is not installed: it runs from a checkout (`python -m bench.NAME`)."""
from setuptools import find_packages, setup

FOLDERS = {"jaxopd_kernels": "kernels", "jaxopd_envs": "envs", "jaxopd_experiments": "experiments"}

packages = find_packages(include=["jaxopd", "jaxopd.*"])
for name, folder in FOLDERS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(where=folder)]

setup(package_dir=FOLDERS, packages=packages,
      package_data={"jaxopd_experiments": ["actfirst_alfworld/data/*.json"]})
