"""The serving app's backend over one decoder worker in this process (no Ray), for the tests that
put `adapt.serving.http_app.build_app` on uvicorn in front of a `workers.ray_worker.DecoderWorker`."""

from __future__ import annotations


class WorkerBackend:
    """Streams go to ``worker``; loads come from ``store`` (default: the worker's own store, the
    in-process one of a plugin built with ``store=None``)."""

    def __init__(self, worker, store=None):
        self.worker, self.store = worker, store

    def stream(self, request):
        return self.worker.generate(request)

    async def loads(self):
        return (self.store if self.store is not None else self.worker.plugin.store).loads()
