"""What TensorFlow sees: a GPU takes memory as it needs it, and the settings whose
"auto" depends on whether there is one are resolved against it."""

from __future__ import annotations

import logging
from dataclasses import replace

from pergrad.server.config import Config

_LOGGER = logging.getLogger(__name__)


def configure_devices() -> None:
    """Use a GPU when TensorFlow sees one, growing its memory instead of taking it all."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    _LOGGER.info("devices: %s", ", ".join(d.name for d in gpus) or "CPU only")


def with_coalescing_resolved(config: Config) -> Config:
    """The config with --max-coalesced-batch auto made a number for this machine
    (`Config.coalescing_bound`), as every part of the server then reads it."""
    import tensorflow as tf

    gpu = bool(tf.config.list_physical_devices("GPU"))
    bound = config.coalescing_bound(gpu=gpu)
    why = (
        "set"
        if config.max_coalesced_batch is not None
        else "auto, " + ("a GPU is seen" if gpu else "CPU only")
    )
    sharing = "small requests share passes" if bound else "no shared passes"
    _LOGGER.info("--max-coalesced-batch %d (%s): %s", bound, why, sharing)
    return replace(config, max_coalesced_batch=bound)
