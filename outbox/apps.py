from django.apps import AppConfig


class OutboxConfig(AppConfig):
    name = "outbox"
    verbose_name = "Outbox (delivery)"

    def ready(self) -> None:
        from outbox import checks  # noqa: F401 - registers the system checks
