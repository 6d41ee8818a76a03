"""What a client has learnt of each model: its ModelInfo, and which weights each version
had. A version it pins is then pinned by content, so a restarted server (versions start
again at 1) cannot pass other weights off under a number the client knew."""

from __future__ import annotations

import dataclasses

from pergrad.client._call import Call
from pergrad.client._methods import Methods
from pergrad.client._types import ModelInfo, answer_checked
from pergrad.v1 import gradient_service_pb2 as pb


class Known:
    def __init__(self, methods: Methods, max_model_bytes: int) -> None:
        self._methods, self._max_model_bytes = methods, max_model_bytes
        self._infos: dict[str, ModelInfo] = {}
        self._ids: dict[tuple[str, int], str] = {}

    def fetch(self, model: str, timeout: float | None) -> ModelInfo:
        """The model's info as the server describes it now (a malformed one: DATA_LOSS)."""
        reply = self._methods.info(pb.GetModelInfoRequest(model=model), timeout=timeout)
        with answer_checked(f"model info of {model!r}: "):
            message = pb.ModelInfo.FromString(reply)
            info = ModelInfo.from_proto(message, max_bytes=self._max_model_bytes)
        self._infos[model] = info
        self.seen(model, info.model_version, info.weights_id)
        return info

    def info(self, model: str, timeout: float | None) -> ModelInfo:
        return self._infos.get(model) or self.fetch(model, timeout)

    def seen(self, model: str, version: int, weights_id: str) -> None:
        if weights_id:
            self._ids[model, version] = weights_id

    def id_of(self, model: str, version: int) -> str:
        """The weights_id seen for `version` ("" if unseen, or for version 0: any)."""
        return self._ids.get((model, version), "") if version else ""

    def pinned(self, call: Call) -> Call:
        """`call` pinned by content too, where it pins a version whose weights are known."""
        known = self.id_of(call.model, call.model_version)
        if call.weights_id or not known:
            return call
        return dataclasses.replace(call, weights_id=known)
