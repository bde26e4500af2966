"""One copy of each model for every gunicorn worker (`server.workers > 1`).

The gunicorn master starts an engine host process (`host.py`) that owns the engines of
every configured model (a Fleet of ManagedEngines: on-demand loading, the memory
budget, keep_alive, reloads). Each worker's app gets RemoteEngines (`client.py`) that
send jobs over one Unix socket per worker and receive each engine step's events for all
of that worker's requests in one message (`wire.py`). The master restarts a host that
died (`supervisor.py`); requests in flight then end with an in-protocol error.
See docs/architecture.md, "Processes".
"""
