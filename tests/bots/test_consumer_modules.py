"""Your consumers in a module of your own, named by DOVECOTE_CONSUMER_MODULES: found at
start-up without an INSTALLED_APPS edit, in a real manage.py process."""

from __future__ import annotations

import subprocess

from tests.support import ROOT, VENV_BIN


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV_BIN / "python"), "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_a_consumer_module_named_in_the_setting_is_discovered(process_env, bot, sandbox) -> None:
    env = {**process_env, "DOVECOTE_CONSUMER_MODULES": "tests.bots.extension.shop_consumers"}
    done = manage(env, "set_webhook", bot.name, "--url", "https://bot.example.com")

    assert done.returncode == 0, done.stderr
    # Its declared update type reaches Telegram: the consumer was registered in that process.
    allowed = sandbox.calls(token=bot.token, method="setWebhook")[-1]["params"]["allowed_updates"]
    assert allowed == ["callback_query", "message"]


def test_a_consumer_module_that_cannot_be_imported_stops_the_process_naming_it(process_env) -> None:
    env = {**process_env, "DOVECOTE_CONSUMER_MODULES": "shop.no_such_consumers"}
    done = manage(env, "check")

    assert done.returncode != 0
    assert "DOVECOTE_CONSUMER_MODULES names 'shop.no_such_consumers'" in done.stderr
