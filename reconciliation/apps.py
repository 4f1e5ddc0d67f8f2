from django.apps import AppConfig


class ReconciliationConfig(AppConfig):
    name = "reconciliation"
    verbose_name = "Reconciliation and recovery"

    def ready(self) -> None:
        from reconciliation import receivers  # noqa: F401 - connects the signal receivers
