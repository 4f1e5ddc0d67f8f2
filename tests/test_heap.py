"""The web and worker processes set their startup heap aside from the garbage collector's
passes once they are ready, and collect the youngest generation less often
(project/heap.py): each full pass walked every object imported at startup and stopped the
process for tens of milliseconds. Run in subprocesses, as the processes do it, so that this
test process's own collector is left as it is."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT, base_env

# What the frozen heap holds, and whether a cycle made afterwards is still collected.
_REPORT = """
import gc, json, weakref
class Node: pass
node = Node(); node.me = node; alive = weakref.ref(node); del node
gc.collect()
print(json.dumps({
    "frozen": gc.get_freeze_count(), "young": gc.get_threshold()[0],
    "enabled": gc.isenabled(), "cycle_left": alive() is not None,
}))
"""


def _run(setup: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", setup + _REPORT], cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_gunicorn_worker_freezes_its_heap_once_the_app_is_loaded() -> None:
    report = _run("import runpy\nimport project.wsgi\nrunpy.run_path('gunicorn.conf.py')['post_worker_init'](None)\n")

    assert report["frozen"] > 10_000  # Django and the project's modules, not a handful
    assert report == {"frozen": report["frozen"], "young": 10_000, "enabled": True, "cycle_left": False}


def test_a_celery_worker_and_its_prefork_children_freeze_their_heap_when_ready() -> None:
    # The signals Celery sends in a prefork child once it is set up, and in the main process
    # once the worker is ready: the project's receivers freeze the heap.
    for signal in ("worker_process_init", "worker_ready"):
        report = _run(
            "import django; django.setup()\n"
            "import project.celery\n"
            f"from celery.signals import {signal}\n"
            "import gc; assert gc.get_freeze_count() == 0\n"
            f"{signal}.send(sender=None)\n"
        )

        assert report["frozen"] > 10_000, signal
        assert (report["young"], report["enabled"], report["cycle_left"]) == (10_000, True, False), signal


def test_without_the_hooks_nothing_is_frozen() -> None:
    # The figure above is the hooks' doing: a process that only imports the app has none.
    report = _run("import project.wsgi\n")

    assert report == {"frozen": 0, "young": 700, "enabled": True, "cycle_left": False}
