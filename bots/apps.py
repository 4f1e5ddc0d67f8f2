from django.apps import AppConfig


class BotsConfig(AppConfig):
    name = "bots"
    verbose_name = "Bots and inbox"

    def ready(self) -> None:
        # Consumers register themselves on import; discover every app's consumers.py.
        from bots import checks, signals  # noqa: F401 - registers the checks, connects the Celery receivers
        from bots.registry import autodiscover
        from bots.transitions import renew_run_leases
        from core.workers import lease_keeper

        lease_keeper.register("run", renew_run_leases)
        from django.conf import settings
        from django.db.backends.signals import connection_created

        from bots import aio

        if settings.DATABASE_POOLER != "transaction":  # a session setting would stay on a pooled server
            connection_created.connect(aio.name_connection, dispatch_uid="bots.name_aio_connection")
        autodiscover()
