"""A weight update in the Scheduler (seed 003 §5.5, the Scheduler's half).

It is checked when it arrives: a path that does not exist or holds another model is
refused at once and the old weights keep serving. A good one waits until no request runs
(the Scheduler admits nothing new meanwhile; new requests wait in the queue), then the new
weights load beside the old ones and replace them only once loaded, and the prefix cache
is flushed: its KV was computed by the old weights.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from sluice.messages import UpdateWeightsFromDiskReq, UpdateWeightsFromDiskReqOutput
from sluice.model.model_config import ModelConfig, check_servable
from sluice.model.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class PendingUpdate:
    request: UpdateWeightsFromDiskReq
    model_path: str  # absolute
    weight_version: str  # what the weights will be called once loaded


@dataclass(slots=True, frozen=True)
class Refusal:
    param: str | None  # the request field at fault
    message: str


def plan_update(
    request: UpdateWeightsFromDiskReq, served: ModelConfig, version: str, context_length: int = 0
) -> PendingUpdate | Refusal:
    """The update to carry out once nothing runs, or why it is refused. context_length: the
    server's --context-length, which the new weights are served at too."""
    path = os.path.abspath(request.model_path)
    try:
        check_servable(path)
        offered = ModelConfig.from_path(path).with_context_length(context_length)
    except (OSError, ValueError) as e:
        return Refusal("model_path", f"cannot load {path}: {e}")
    if (mismatch := served.replacement_mismatch(offered)) is not None:
        return Refusal("model_path", f"the weights at {path} do not fit the served model: {mismatch}")
    if request.weight_version is not None:
        return PendingUpdate(request, path, request.weight_version)
    if not version.isdigit():
        message = f"the served weight_version {version!r} is not a number to count up from: name the new one"
        return Refusal("weight_version", message)
    return PendingUpdate(request, path, str(int(version) + 1))


def load_weights_of(update: PendingUpdate, served: ModelRunner) -> ModelRunner | Refusal:
    """A runner of the update's weights, run as the served ones are (same dtypes, so the KV
    cache fits; quantized alike), or why they failed to load."""
    start = time.perf_counter()
    try:
        runner = ModelRunner(update.model_path, *served.load_options)
    except Exception as e:  # a file that passed the checks and is broken inside
        logger.exception("weight update from %s failed; the old weights keep serving", update.model_path)
        message = f"loading {update.model_path} failed ({type(e).__name__}: {e}); the old weights keep serving"
        return Refusal("model_path", message)
    logger.info(
        "loaded %s in %.1f s: weight_version %s", update.model_path, time.perf_counter() - start, update.weight_version
    )
    return runner


def update_reply(
    request: UpdateWeightsFromDiskReq, outcome: str | Refusal, weight_version: str, model_path: str
) -> UpdateWeightsFromDiskReqOutput:
    """The reply to `request`: done (`outcome` says what was done) or refused; either way
    with the weights served now."""
    refusal = outcome if isinstance(outcome, Refusal) else None
    return UpdateWeightsFromDiskReqOutput(
        success=refusal is None,
        message=outcome if isinstance(outcome, str) else outcome.message,
        param=None if refusal is None else refusal.param,
        weight_version=weight_version,
        model_path=model_path,
        control_id=request.control_id,
        http_worker_ipc=request.http_worker_ipc,
    )
