"""Artifacts the operator supplies as local files, for presses that would download them.

kvpress's RestoreKVPress and QFilterPress load learned weights from the Hugging Face
hub by the model's name. A trace server never downloads on a request's behalf: the
operator points the press at a local copy at start (``kvdiv serve --press-option
RestoreKVPress:path=DIR``), and each press built for a request loads from there
instead of the hub (its ``post_init_from_model`` is replaced on that instance only).

========================  ==============================  ===========================================
press                     option                          DIR holds (as the hub repository does)
========================  ==============================  ===========================================
RestoreKVPress            ``path=DIR``                    a PEFT LoRA adapter (``adapter_config.json``,
                          (``plus_path=DIR`` for          ``adapter_model.safetensors``) and
                          ``kvzip_plus_normalization``)   ``restore_embeddings.safetensors``
                                                          (``restore_embeddings``: n × hidden)
QFilterPress              ``path=DIR``                    ``QFilters.save_pretrained`` output
                                                          (``config.json``, ``model.safetensors``)
========================  ==============================  ===========================================
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import MethodType
from typing import Any

from gen_service.errors import PolicyError

__all__ = ["LOCAL_ARTIFACTS", "OPTION_KEYS", "artifact_path", "attach", "check_options"]

# class name -> {option key: files DIR must hold}
LOCAL_ARTIFACTS: dict[str, dict[str, tuple[str, ...]]] = {
    "RestoreKVPress": {
        "path": ("adapter_config.json", "restore_embeddings.safetensors"),
        "plus_path": ("adapter_config.json", "restore_embeddings.safetensors"),
    },
    "QFilterPress": {"path": ("config.json",)},
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
    key = "plus_path" if cls_name == "RestoreKVPress" and kwargs.get("kvzip_plus_normalization") else "path"
    value = options.get(key)
    return (None if value is None else str(value)), key


def attach(press: Any, folder: str) -> None:
    """Make ``press`` load its artifact from ``folder`` instead of the hub."""
    loader = _LOADERS[type(press).__name__]
    press.post_init_from_model = MethodType(loader(Path(folder)), press)


def _restorekv(folder: Path) -> Callable[[Any, Any], None]:
    """RestoreKVPress.post_init_from_model, reading ``folder`` instead of the hub."""

    def post_init_from_model(self: Any, model: Any) -> None:
        from safetensors.torch import load_file

        name = str(folder)
        if name == self.restore_model_name:
            return
        embeddings = load_file(str(folder / "restore_embeddings.safetensors"))["restore_embeddings"]
        self.restore_embeddings = embeddings.to(model.device, dtype=model.dtype)
        if self.adapter_name not in getattr(model, "peft_config", {}):
            model.load_adapter(name, adapter_name=self.adapter_name)
        model.disable_adapters()   # LoRA acts only in the restore pass, which enables it
        self.restore_model_name = name

    return post_init_from_model


def _qfilters(folder: Path) -> Callable[[Any, Any], None]:
    """QFilterPress.post_init_from_model, reading ``folder`` instead of the hub."""

    def post_init_from_model(self: Any, model: Any) -> None:
        from kvpress.presses.qfilter_press import QFilters

        self.q_filters = QFilters.from_pretrained(str(folder)).q_filters.to(model.dtype)

    return post_init_from_model


_LOADERS: dict[str, Callable[[Path], Callable[[Any, Any], None]]] = {
    "RestoreKVPress": _restorekv, "QFilterPress": _qfilters,
}
