"""The distributed kvstore: servers and workers in separate processes talking ZeroMQ.

``job.connect(kind)`` is what ``tandem.kvstore.create("dist_sync")`` calls in a worker process, and
``job.serve(kind)`` what ``tandem.kvstore.serve("dist_sync")`` (or ``python -m tandem.kvstore.ps``)
runs in a server process. Modules: topology (who is who), protocol and transport (the wire),
placement (which server holds which slice), client and worker (a worker's store), server, p3*
(priority-based propagation), job (joining in either role). Nothing is imported here, so that the
wire modules load without the server and worker.
"""
