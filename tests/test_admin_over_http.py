"""The admin over plain HTTP with DEBUG off, as a newcomer first tries it (no TLS proxy yet):
the session and CSRF cookies are Secure, so a client never sends them back over http and the
login answers 403 (CSRF). The configuration table (docs/OPERATIONS.md) names the settings that lift it;
with them, a real gunicorn lets an operator log in over http."""

from __future__ import annotations

import re
import subprocess

import httpx
import pytest

from tests.support import ROOT, VENV_BIN, Process, base_env, start_web

pytestmark = pytest.mark.django_db(transaction=True)


def settings_for_plain_http() -> list[str]:
    """The variables the configuration table (docs/OPERATIONS.md) says to turn off for the admin over plain HTTP."""
    rows = [line for line in (ROOT / "docs" / "OPERATIONS.md").read_text().splitlines() if line.startswith("| `")]
    [row] = [row for row in rows if "plain HTTP" in row]
    return re.findall(r"`([A-Z_]+)`", row.split(" | ")[0])


@pytest.fixture(scope="module")
def static_files() -> None:
    """The admin's pages need the collected static files, as the README's build step makes them."""
    env = base_env(DJANGO_SETTINGS_MODULE="project.settings", DEBUG="0", SECRET_KEY="x")
    subprocess.run(
        [str(VENV_BIN / "python"), "manage.py", "collectstatic", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=300,
    )


def production_web(process_env: dict[str, str], processes: list[Process], **extra: str) -> str:
    env = {
        **process_env,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DEBUG": "0",
        "SECRET_KEY": "a-production-secret",
        "ALLOWED_HOSTS": "127.0.0.1",
        **extra,
    }
    proc, url = start_web(env)
    processes.append(proc)
    return url


def log_in(url: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=10) as browser:
        form = browser.get("/admin/login/?next=/admin/").text
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form)[1]
        answer = browser.post(
            "/admin/login/?next=/admin/",
            data={"username": "olga", "password": "olga-password", "csrfmiddlewaretoken": token, "next": "/admin/"},
            headers={"Origin": url, "Referer": f"{url}/admin/login/"},
        )
        if answer.status_code != 302:
            return answer
        return browser.get("/admin/")


@pytest.fixture
def olga(process_env: dict[str, str]) -> None:
    """An admin made as the README says (createsuperuser), in the production settings' hashers."""
    env = {**process_env, "DJANGO_SUPERUSER_PASSWORD": "olga-password"}
    subprocess.run(
        [str(VENV_BIN / "python"), "manage.py", "createsuperuser", "--noinput", "--username", "olga", "--email", ""],
        cwd=ROOT,
        env={**env, "DJANGO_SETTINGS_MODULE": "project.settings", "DEBUG": "0", "SECRET_KEY": "x"},
        check=True,
        timeout=60,
    )


def test_by_default_the_admin_over_plain_http_refuses_the_login_with_a_csrf_403(
    static_files: None, olga: None, process_env: dict[str, str], processes: list[Process]
) -> None:
    answer = log_in(production_web(process_env, processes))
    assert answer.status_code == 403
    assert "CSRF" in answer.text


def test_with_the_documented_settings_an_operator_logs_in_over_plain_http(
    static_files: None, olga: None, process_env: dict[str, str], processes: list[Process]
) -> None:
    names = settings_for_plain_http()
    assert set(names) == {"SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE"}
    answer = log_in(production_web(process_env, processes, **dict.fromkeys(names, "0")))
    assert answer.status_code == 200
    assert "Site administration" in answer.text
