import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from reconciliation.selectors import queue_status


class Command(BaseCommand):
    help = "Counts by state for inbox, consumer runs, outbox and dead letters; oldest waiting age; open cases."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Machine-readable output.")

    def handle(self, *args: Any, **options: Any) -> None:
        status = queue_status()
        if options["json"]:
            self.stdout.write(json.dumps(status, indent=2, sort_keys=True))
            return
        for queue in ("inbox", "consumer_runs", "outbox"):
            counts = ", ".join(f"{state}={n}" for state, n in status[queue].items())
            self.stdout.write(f"{queue:14} {counts}")
        by_reason = ", ".join(f"{r}={n}" for r, n in status["dead_letters"]["by_reason"].items()) or "-"
        self.stdout.write(f"{'dead letters':14} open={status['dead_letters']['open']} ({by_reason})")
        oldest = status["oldest_waiting_seconds"]
        self.stdout.write(f"{'oldest waiting':14} {'-' if oldest is None else f'{oldest:.1f}s'}")
        self.stdout.write(f"{'open cases':14} {status['open_reconciliation_cases']}")
