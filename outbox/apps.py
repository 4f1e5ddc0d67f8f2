from django.apps import AppConfig


class OutboxConfig(AppConfig):
    name = "outbox"
    verbose_name = "Outbox (delivery)"

    def ready(self) -> None:
        from core.workers import lease_keeper
        from outbox import checks  # noqa: F401 - registers the system checks
        from outbox.effects import renew_effect_leases
        from outbox.sending import probe  # noqa: F401 - schedules a bot's circuit probes, releases its backlog

        lease_keeper.register("effect", renew_effect_leases)
