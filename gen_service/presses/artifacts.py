"""Artifacts the operator supplies as local files, for presses that would download them.

kvpress's RestoreKVPress and QFilterPress load learned weights from the Hugging Face
hub by the model's name. A trace server never downloads on a request's behalf: the
operator points the press at a local copy at start (``kvdiv serve --press-option
RestoreKVPress:path=DIR``), and each press built for a request loads from there
instead of the hub (its ``post_init_from_model`` is replaced on that instance only).

Which presses take which folders, what each folder must hold and how it is loaded is
the press's ``artifact`` in the press table (:mod:`gen_service.presses.table`); the
loaders are in :mod:`gen_service.presses.loaders`. docs/service.md, "Presses that need
an artifact", shows the folders' layout.
"""

from __future__ import annotations

from pathlib import Path
from types import MethodType
from typing import Any

from gen_service.errors import PolicyError
from gen_service.presses.table import PRESSES, by_name

__all__ = ["LOCAL_ARTIFACTS", "OPTION_KEYS", "artifact_path", "attach", "check_options"]

# class name -> {option key: files DIR must hold}, from the press table
LOCAL_ARTIFACTS: dict[str, dict[str, tuple[str, ...]]] = {
    p.name: dict(p.artifact.files) for p in PRESSES if p.artifact is not None and p.artifact.files
}
OPTION_KEYS = frozenset(k for keys in LOCAL_ARTIFACTS.values() for k in keys)


def check_options(press_options: dict[str, dict[str, Any]]) -> None:
    """Check the operator's local-artifact options at server start.

    Raises
    ------
    PolicyError
        An option for a press that takes none, or a folder missing a file it needs.
    """
    for cls_name, options in press_options.items():
        for key, value in options.items():
            if key not in OPTION_KEYS:
                continue
            if key not in LOCAL_ARTIFACTS.get(cls_name, {}):
                known = ", ".join(f"{c}:{k}" for c, keys in LOCAL_ARTIFACTS.items() for k in keys)
                raise PolicyError(f"--press-option {cls_name}:{key}: {cls_name} takes no local artifact "
                                  f"(known: {known})", key)
            folder = Path(str(value))
            missing = [f for f in LOCAL_ARTIFACTS[cls_name][key] if not (folder / f).is_file()]
            if missing:
                raise PolicyError(f"--press-option {cls_name}:{key}={value}: {folder} lacks {', '.join(missing)}", key)


def artifact_path(cls_name: str, options: dict[str, Any], kwargs: dict[str, Any]) -> tuple[str | None, str]:
    """The local folder this press needs for these parameters, and its option key.

    Returns
    -------
    tuple of (str or None, str)
        The folder (None when the operator gave none) and the option that names it.
    """
    spec = by_name(cls_name)
    variant = None if spec is None or spec.artifact is None else spec.artifact.variant
    key = variant[1] if variant is not None and kwargs.get(variant[0]) else "path"
    value = options.get(key)
    return (None if value is None else str(value)), key


def attach(press: Any, folder: str) -> None:
    """Make ``press`` load its artifact from ``folder`` instead of the hub."""
    spec = by_name(type(press).__name__)
    assert spec is not None and spec.artifact is not None and spec.artifact.loader is not None
    press.post_init_from_model = MethodType(spec.artifact.loader(Path(folder)), press)
