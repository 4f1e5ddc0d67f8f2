"""Groups for the back office. Operator: triage metadata, retry, resolve, decide cases,
pause/resume. Developer: all of that, plus full payloads and bot settings."""

from django.db import migrations

OPERATOR = {
    "outbox": ["view_deadletter", "change_deadletter", "view_outboundmessage", "view_attempt", "view_effect",
               "view_circuit"],
    "bots": ["view_bot", "view_inboundupdate", "view_consumerrun"],
    "reconciliation": ["view_reconciliationcase", "change_reconciliationcase", "view_auditentry",
                       "view_bulkretry", "change_bulkretry", "view_payloadversion", "retry_deadletter",
                       "resolve_deadletter", "decide_case", "pause_circuit", "view_dashboard"],
}
DEVELOPER_EXTRA = {
    "bots": ["add_bot", "change_bot"],
    "reconciliation": ["view_payload"],
}


def _permissions(apps, spec):  # noqa: ANN001, ANN201
    Permission = apps.get_model("auth", "Permission")
    found = []
    for app_label, codenames in spec.items():
        for codename in codenames:
            found.append(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    return found


def create_groups(apps, schema_editor):  # noqa: ANN001, ANN201
    from django.contrib.auth.management import create_permissions

    # Permissions are normally created after all migrations; make them exist now.
    for app_config in apps.get_app_configs():
        original = getattr(app_config, "models_module", None)
        app_config.models_module = original or True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = original
    Group = apps.get_model("auth", "Group")
    operator, _ = Group.objects.get_or_create(name="Operator")
    operator.permissions.add(*_permissions(apps, OPERATOR))
    developer, _ = Group.objects.get_or_create(name="Developer")
    developer.permissions.add(*_permissions(apps, OPERATOR), *_permissions(apps, DEVELOPER_EXTRA))


def remove_groups(apps, schema_editor):  # noqa: ANN001, ANN201
    apps.get_model("auth", "Group").objects.filter(name__in=["Operator", "Developer"]).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("reconciliation", "0003_triage"),
        ("outbox", "0001_initial"),
        ("bots", "0001_initial"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(create_groups, remove_groups)]
