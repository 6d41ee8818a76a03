"""`pergrad serve`: load the models, start gRPC with health and reflection, drain on SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pergrad.server.config import JIT_CHOICES, Config, ConfigError, parse
from pergrad.server.models.builtin import BUILTIN_MODELS
from pergrad.server.models.keras_file import ModelLoadError
from pergrad.server.models.registry import ModelRegistry, load_model
from pergrad.server.service import GradientServicer
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc

_LOGGER = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GradientService"].full_name


def configure_devices() -> None:
    """Use a GPU when TensorFlow sees one, growing its memory instead of taking it all."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    _LOGGER.info("devices: %s", ", ".join(d.name for d in gpus) or "CPU only")


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer

    def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, then let in-flight calls finish for up to `grace_s`."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def build_registry(config: Config) -> ModelRegistry:
    specs = config.models or tuple(BUILTIN_MODELS)
    return ModelRegistry(
        load_model(
            spec,
            model_dir=config.model_dir,
            loss=config.loss,
            jit_compile=JIT_CHOICES[config.jit_compile],
        )
        for spec in specs
    )


def start(config: Config, registry: ModelRegistry | None = None) -> RunningServer:
    """Start serving (port 0 picks a free one); returns at once."""
    registry = registry or build_registry(config)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers),
        options=[
            ("grpc.max_receive_message_length", config.max_request_bytes),
            ("grpc.max_send_message_length", -1),
        ],
    )
    pb_grpc.add_GradientServiceServicer_to_server(GradientServicer(registry, config), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"cannot bind {config.host}:{config.port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _LOGGER.info("pergrad ready on %s:%d serving %s", config.host, port, registry.names)
    return RunningServer(server, port, health_servicer)


def serve(argv: Sequence[str]) -> int:
    """Run until SIGTERM or SIGINT; exit status 2 for a configuration or model error."""
    try:
        config = parse(argv)
        logging.basicConfig(
            level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        configure_devices()
        running = start(config)
    except (ConfigError, ModelLoadError) as err:
        print(f"pergrad serve: {err}", file=sys.stderr)
        return 2
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    stopping.wait()
    _LOGGER.info("draining for up to %.1f s", config.grace_s)
    running.stop(config.grace_s)
    _LOGGER.info("stopped")
    return 0
