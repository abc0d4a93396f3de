"""The shipped recipes as a Hydra config source: ``rlhf://recipes`` on the search path holds the
group ``recipe``, one option per ``recipes/*.yaml`` (``rlhf._recipes`` in a wheel).

A file source cannot serve them (the folder is ``recipes/``, the group ``recipe``), and the
ConfigStore would load every recipe up front (one broken file breaks every command) and clash with a
user's file of the same name. Hydra reads a recipe from here only when it is picked, and since
conf/config.yaml puts this source last on the search path (``hydra.searchpath``), a user's folder
(``-cd DIR``) that holds ``recipe/<name>.yaml`` of a shipped name replaces the shipped one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource

GROUP = "recipe"


class RecipesConfigSource(ConfigSource):
    def __init__(self, provider: str, path: str) -> None:
        if path.find("://") == -1:
            path = f"{self.scheme()}://{path}"
        super().__init__(provider=provider, path=path)

    @staticmethod
    def scheme() -> str:
        return "rlhf"

    @staticmethod
    def _folder() -> Path:
        from rlhf import paths

        return paths.recipes_dir()

    def _file(self, config_path: str) -> Optional[Path]:
        group, _, name = self._normalize_file_name(config_path).rpartition("/")
        return self._folder() / name if group == GROUP else None

    def load_config(self, config_path: str) -> ConfigResult:
        from omegaconf import OmegaConf

        path = self._file(config_path)
        if path is None or not path.is_file():
            raise ConfigLoadError(f"Config not found : {config_path}")
        text = path.read_text(encoding="utf-8")
        return ConfigResult(config=OmegaConf.create(OmegaConf.load(path)), path=f"{self.scheme()}://{self.path}",
                            provider=self.provider, header=ConfigSource._get_header_dict(text[:512]))

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        return config_path.strip("/") in ("", GROUP)

    def is_config(self, config_path: str) -> bool:
        path = self._file(config_path)
        return path is not None and path.is_file()

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        files: List[str] = []
        if config_path.strip("/") == "":
            names = [GROUP]
        elif config_path.strip("/") == GROUP and self._folder().is_dir():
            names = os.listdir(self._folder())
        else:
            names = []
        for name in names:
            self._list_add_result(files=files, file_path=f"{config_path.strip('/')}/{name}".lstrip("/"),
                                  file_name=name, results_filter=results_filter)
        return sorted(set(files))
