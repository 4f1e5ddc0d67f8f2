"""gunicorn's settings for the `web` process; gunicorn reads this file from the working
directory, so the Procfile's `web: gunicorn project.wsgi` needs no flags.

Where it listens: `BIND` if set; else `0.0.0.0:$PORT` when the platform sets `PORT` (Heroku,
Render, Railway, Dokku route to it from outside the dyno); else 127.0.0.1:8000 for local use.
"""

import os

if os.environ.get("BIND"):
    bind = [os.environ["BIND"]]
elif os.environ.get("PORT"):
    bind = [f"0.0.0.0:{os.environ['PORT']}"]
else:
    bind = ["127.0.0.1:8000"]

# Platforms size this from the dyno's memory; 2 processes x 4 threads fits a 512 MB dyno.
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
threads = int(os.environ.get("WEB_THREADS", "4"))
# No access log: the webhook writes one JSON line per update (with its trace id), and an
# access line per request would double the logging cost of the hot path. To have one anyway:
# GUNICORN_CMD_ARGS="--access-logfile -".
# A platform sends SIGKILL 30 s after SIGTERM: finish the requests in flight well before.
graceful_timeout = 20
# The webhook answers in milliseconds; a request still running after this is stuck.
timeout = 30
# gunicorn 25.1+ opens a control socket at one path per user ($XDG_RUNTIME_DIR/gunicorn.ctl or
# ~/.gunicorn/gunicorn.ctl): a second instance on the host replaced the first's, and the first
# to stop removed the other's. The platform manages these processes; gunicornc is not used.
control_socket_disable = True


def on_starting(server: object) -> None:
    """Fail closed in the master, before any worker: one line naming what is missing."""
    from project.failclosed import load_settings_or_exit

    load_settings_or_exit()


def post_worker_init(worker: object) -> None:
    """The worker has loaded the app: its startup heap out of the garbage collector's passes,
    which held requests up for tens of milliseconds, and its youngest generation collected
    less often (project/heap.py)."""
    from core.workers import outage_watch
    from project.heap import tune_garbage_collector

    tune_garbage_collector()
    # A wake-up that Redis failed (an update stored, its router not woken) is handed on as
    # soon as Redis is back (reconciliation/resume.py), not at the sweeper's next tick.
    outage_watch.start()


def worker_exit(server: object, worker: object) -> None:
    """A worker exits (in the worker): hand over the routers' wake-ups it still holds, and
    ship its last second of counts (core/metrics.py)."""
    from bots.routing import inbox_router_wakes_flush
    from core.metrics import ship

    inbox_router_wakes_flush()
    ship()
