from django.apps import AppConfig


class BotsConfig(AppConfig):
    name = "bots"
    verbose_name = "Bots and inbox"

    def ready(self) -> None:
        # Consumers register themselves on import; discover every app's consumers.py.
        from bots import checks, signals  # noqa: F401 - registers the checks, connects the Celery receivers
        from bots.registry import autodiscover

        autodiscover()
