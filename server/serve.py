"""`pergrad serve`: the flags checked first, then the server started and run until SIGTERM
or SIGINT, then drained.

The flags are checked before TensorFlow loads (a bad flag is exit 2 in a fraction of a
second, not after the ~6 s TensorFlow takes to import here); everything that needs
TensorFlow is imported once they are good.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from pergrad.server.config import ConfigError, parse
from pergrad.server.memory import limit_arenas

_LOGGER = logging.getLogger(__name__)
# A stop still under way this long after its grace ends prints every thread's stack and
# exits 1: a server told to stop never hangs, and a hang leaves its cause in the log.
STOP_SLACK_S = 20.0
WAKE_S = 0.5


def _refused(err: Exception) -> int:
    print(f"pergrad serve: {err}", file=sys.stderr)
    return 2


def serve(argv: Sequence[str]) -> int:
    """Run until SIGTERM or SIGINT; exit status 2 for a configuration, model or port error."""
    # Handlers first: a stop that arrives while the models load, or just after the server
    # turns SERVING (a pod deleted as it became ready), is a drain, never a kill.
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        config = parse(argv)
    except ConfigError as err:
        return _refused(err)
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    limit_arenas()
    from pergrad.server.devices import configure_devices
    from pergrad.server.engine.cores import one_blas_thread
    from pergrad.server.main import start
    from pergrad.server.models.keras_file import ModelLoadError

    try:
        configure_devices()
        one_blas_thread()
        running = start(config)
    except (ConfigError, ModelLoadError, OSError) as err:
        return _refused(err)
    # Python runs a signal's handler in the main thread only when that thread runs; the
    # kernel may deliver SIGTERM to any of the server's threads, and a wait without a
    # timeout would then never end. So the main thread wakes every WAKE_S to look.
    while not stopping.wait(WAKE_S):
        pass
    _LOGGER.info("draining for up to %.1f s", config.grace_s)
    faulthandler.dump_traceback_later(config.grace_s + STOP_SLACK_S, exit=True)
    running.stop(config.grace_s)
    _LOGGER.info("stopped")
    return 0
