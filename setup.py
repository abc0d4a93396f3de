"""Package list for setuptools (the metadata is in pyproject.toml).

conf/ and recipes/ stay at the top of the repository, where Hydra and people find them; a built
wheel carries them as the data packages rlhf._conf and rlhf._recipes (rlhf/paths.py looks there
first). pyproject.toml alone cannot both find the rlhf.* packages and map extra folders to
packages, hence this file.
"""

from setuptools import find_namespace_packages, find_packages, setup

DATA_PACKAGES = {"rlhf._conf": "conf", "rlhf._recipes": "recipes"}

setup(
    # hydra_plugins.*: the hydra/launcher=parallel plugin and the rlhf://recipes config source (Hydra loads
    # plugins only from there; an editable install maps each plugin package by name, so a new one needs a reinstall)
    packages=find_packages(include=["rlhf", "rlhf.*"]) + find_namespace_packages(include=["hydra_plugins.*"])
    + list(DATA_PACKAGES),
    package_dir=DATA_PACKAGES,
    package_data={"rlhf._conf": ["*.yaml", "*/*.yaml"], "rlhf._recipes": ["*.yaml"]},
    include_package_data=False,
)
