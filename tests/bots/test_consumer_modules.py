"""Your consumers in a module of your own, named by DOVECOTE_CONSUMER_MODULES: found at
start-up without an INSTALLED_APPS edit, in a real manage.py process."""

from __future__ import annotations

import subprocess

import pytest

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


@pytest.mark.parametrize("module", ["shop.no_such_consumers", ".relative", "shop..consumers"])
def test_a_consumer_module_that_cannot_be_imported_stops_the_process_naming_it(process_env, module) -> None:
    env = {**process_env, "DOVECOTE_CONSUMER_MODULES": f"tests.bots.extension.shop_consumers,{module}"}
    done = manage(env, "check")

    assert done.returncode != 0
    assert f"DOVECOTE_CONSUMER_MODULES names {module!r}, which cannot be imported" in done.stderr
