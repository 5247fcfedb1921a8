"""Ships ``lmcache-namespace-guard.pth`` at the top of site-packages (pyproject.toml has the rest).

A ``.pth`` file runs at interpreter start-up; this one only acts when the program is the
``lmcache`` console script (see ``src/lmcache_namespace_guard.py`` for why). setuptools has no
declarative way to put a file beside the packages rather than inside one, hence this hook.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "lmcache-namespace-guard.pth"


class BuildPyWithGuard(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path("src") / PTH), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildPyWithGuard})
