"""kopf handlers for KimiK3Deployment: create / update / resume / timer / delete.

Importing this module registers the handlers in kopf's default registry (`k3serve operator run`
imports it after putting its flags into the environment). Every handler is idempotent: it renders
the whole desired state and applies only differences (see apply.py). kopf keeps its bookkeeping in
annotations (prefix k3serve.io) so the status holds only the CRD's documented fields.
"""

from __future__ import annotations

import logging
import time

import kopf

from k3serve.operator import crd
from k3serve.operator.kube import KubeClient
from k3serve.operator.metrics import OperatorMetrics
from k3serve.operator.reconcile import Outcome, Reconciler
from k3serve.operator.settings import OperatorSettings

SETTINGS = OperatorSettings.from_env()
RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)
FINALIZER = "k3serve.io/finalizer"
METRICS = OperatorMetrics()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="k3serve.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="k3serve.io", key="last-handled-configuration"
    )
    # No CRD or namespace watching: the operator needs neither permission (least privilege); our own
    # CRD is found at start (Helm installs CRDs first) and namespaces are given exactly (-n) or all (-A).
    settings.scanning.disabled = True
    # A deletion that races a running status timer waits for the timer to exit, polling this often
    # (kopf's default is 60 s, which would hold every such deletion for a minute).
    settings.background.cancellation_polling = 1.0
    settings.posting.level = logging.WARNING  # kopf's own chatter stays in the log; our Events are explicit
    memo.reconciler = Reconciler(KubeClient(), SETTINGS)
    logger.info(
        "k3serve operator: status every %ss, full resync every %ss, default image %s",
        SETTINGS.status_interval,
        SETTINGS.resync_interval,
        SETTINGS.default_image,
    )


def _finish(body: kopf.Body, patch: kopf.Patch, outcome: Outcome, handler: str, started: float) -> None:
    for key, value in outcome.status_patch.items():
        patch.status[key] = value
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    METRICS.observe(handler, outcome.result, time.monotonic() - started)
    METRICS.set_phase(body.metadata.namespace, body.metadata.name, outcome.phase)
    if outcome.result == "error":
        raise kopf.TemporaryError(outcome.error, delay=max(5.0, SETTINGS.status_interval))


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
async def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, reason: str, **_) -> None:
    started = time.monotonic()
    outcome = await memo.reconciler.reconcile(_plain(body))
    _finish(body, patch, outcome, str(reason), started)


@kopf.timer(
    *RESOURCE,
    interval=SETTINGS.status_interval,
    initial_delay=SETTINGS.status_interval,
    idle=SETTINGS.status_interval / 2,
)
async def refresh(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_) -> None:
    """Refresh the status from the workloads; every resync interval, a full reconcile that repairs drift."""
    started = time.monotonic()
    outcome = await memo.reconciler.tick(_plain(body))
    _finish(body, patch, outcome, "timer", started)


@kopf.on.delete(*RESOURCE)
async def delete(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_) -> None:
    started = time.monotonic()
    deleted = await memo.reconciler.cleanup(_plain(body))
    if deleted:
        logger.info("deleted objects not owned by this deployment: %s", ", ".join(deleted))
    METRICS.observe("delete", "ok", time.monotonic() - started)
    METRICS.set_phase(body.metadata.namespace, body.metadata.name, None)


class _DropTimerSuccess(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno <= logging.INFO and str(record.msg).startswith("Timer 'refresh' succeeded")
        )


def quiet_timer_logs() -> None:
    """Keep kopf's per-tick success lines out of the log (one per deployment every status interval)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropTimerSuccess())


def _plain(body: kopf.Body) -> dict:
    import copy

    return copy.deepcopy(dict(body))
