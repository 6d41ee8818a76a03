"""The steps a model applied last, by the id their client gave each (StepRequest.step_id):
a step sent again after its reply was lost is answered as it was, not applied twice."""

from __future__ import annotations

import threading
from collections import OrderedDict

from pergrad.server.errors import InvalidArgument
from pergrad.v1 import gradient_service_pb2 as pb

# Responses kept per model (8 bytes an example, losses and norms, and a number a variable:
# 2 MB at most for --max-batch 4096), and the longest id.
RECENT_STEPS = 64
MAX_STEP_ID_CHARS = 128


def checked_step_id(step_id: str) -> str:
    if len(step_id) > MAX_STEP_ID_CHARS:
        raise InvalidArgument(
            f"step_id: {len(step_id)} characters, over {MAX_STEP_ID_CHARS}; "
            "send a short random id (the client's are 32 hex digits)"
        )
    return step_id


class RecentSteps:
    """The responses of a model's last RECENT_STEPS steps that carried an id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._responses: OrderedDict[str, pb.StepResponse] = OrderedDict()

    def get(self, step_id: str) -> pb.StepResponse | None:
        """The response of the step `step_id` names, if it is among the recent ones."""
        if not step_id:
            return None
        with self._lock:
            return self._responses.get(step_id)

    def add(self, step_id: str, response: pb.StepResponse) -> None:
        if not step_id:
            return
        with self._lock:
            self._responses[step_id] = response
            while len(self._responses) > RECENT_STEPS:
                self._responses.popitem(last=False)
