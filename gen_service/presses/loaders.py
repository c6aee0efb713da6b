"""How kvdiv loads a press's learned artifact from a local folder instead of the hub.

kvpress's RestoreKVPress and QFilterPress fetch learned weights from the Hugging Face
hub by the model's name, in ``post_init_from_model``. Each loader here returns a
replacement for that method which reads the operator's folder instead
(:func:`gen_service.presses.artifacts.attach` installs it on one press instance).
The press table (:mod:`gen_service.presses.table`) names each press's loader; this
module imports nothing of gen_service, so the table can.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["Loader", "qfilters", "restorekv"]

#: folder -> a ``post_init_from_model(self, model)`` reading it
Loader = Callable[[Path], Callable[[Any, Any], None]]


def restorekv(folder: Path) -> Callable[[Any, Any], None]:
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


def qfilters(folder: Path) -> Callable[[Any, Any], None]:
    """QFilterPress.post_init_from_model, reading ``folder`` instead of the hub."""

    def post_init_from_model(self: Any, model: Any) -> None:
        from kvpress.presses.qfilter_press import QFilters

        self.q_filters = QFilters.from_pretrained(str(folder)).q_filters.to(model.dtype)

    return post_init_from_model
