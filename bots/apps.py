from django.apps import AppConfig


class BotsConfig(AppConfig):
    name = "bots"
    verbose_name = "Bots and inbox"

    def ready(self) -> None:
        # Consumers register themselves on import; discover every app's consumers.py.
        from bots import signals  # noqa: F401 - connects the Celery trace receivers
        from bots.registry import autodiscover

        autodiscover()
