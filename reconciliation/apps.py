from django.apps import AppConfig


class ReconciliationConfig(AppConfig):
    name = "reconciliation"
    verbose_name = "Reconciliation and recovery"

    def ready(self) -> None:
        # Connects the signal receivers; registers the bulk-queue tasks (autodiscover finds only `tasks`).
        from core.workers import outage_watch
        from reconciliation import receivers, triage_tasks  # noqa: F401
        from reconciliation.resume import resume

        outage_watch.register(resume)
