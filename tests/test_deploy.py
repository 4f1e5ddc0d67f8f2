"""Deploying on a Procfile platform as it is: the Procfile's own lines, run as the platform
runs them (a shell, the platform's environment), listen where the router can reach them
and refuse to start without their production configuration."""

from __future__ import annotations

import json
import os
import re
import runpy
import socket
import subprocess

import httpx
import pytest

from tests.support import ROOT, VENV_BIN, Process, base_env, free_port, wait_until


def procfile() -> dict[str, str]:
    lines = (ROOT / "Procfile").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines if line.strip() and not line.startswith("#"))


def platform_env(**overrides: str) -> dict[str, str]:
    """What a platform gives a dyno: its config vars, the project's settings, no DEBUG."""
    env = {k: v for k, v in base_env().items() if k not in ("DATABASE_URL", "REDIS_URL", "DEBUG", "PORT", "BIND")}
    env.update(
        DJANGO_SETTINGS_MODULE="project.settings",
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        SECRET_KEY="platform-secret",
    )
    env.update(overrides)
    return env


# Development runs on PostgreSQL and Redis too: /healthz asks neither.
DEV_SERVICES = {
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/never-used",
    "REDIS_URL": "redis://127.0.0.1:6379/15",
}


def test_the_web_line_listens_on_all_interfaces_at_the_platforms_port(processes: list[Process]) -> None:
    port = free_port()
    web = Process(
        "procfile-web", ["bash", "-c", procfile()["web"]], platform_env(PORT=str(port), DEBUG="1", **DEV_SERVICES)
    )
    processes.append(web)

    wait_until(lambda: "Listening at" in web.log() or not web.alive(), timeout=30, message="gunicorn to listen")
    assert f"Listening at: http://0.0.0.0:{port}" in web.log()
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=60).json() == {"ok": True}


@pytest.mark.parametrize(
    ("environment", "bind"),
    [
        ({}, ["127.0.0.1:8000"]),
        ({"PORT": "5000"}, ["0.0.0.0:5000"]),
        ({"PORT": "5000", "BIND": "[::1]:9"}, ["[::1]:9"]),
    ],
)
def test_gunicorn_binds_to_loopback_unless_the_platform_sets_a_port(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], bind: list[str]
) -> None:
    for name in ("PORT", "BIND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert runpy.run_path(str(ROOT / "gunicorn.conf.py"))["bind"] == bind


def test_the_release_phase_only_migrates() -> None:
    assert procfile()["release"].strip() == "python manage.py migrate --noinput"


@pytest.mark.parametrize("process", ["release", "web", "worker", "beat"])
def test_every_process_refuses_to_start_without_redis_url_naming_it(process: str) -> None:
    env = platform_env(PORT=str(free_port()), DATABASE_URL="postgres://postgres@127.0.0.1:5432/never-used")
    done = subprocess.run(
        ["bash", "-c", procfile()[process]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "dovecote: REDIS_URL must be set when DEBUG is off" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("process", ["release", "web", "worker", "beat"])
def test_every_process_refuses_to_start_with_a_number_out_of_range_naming_each(process: str) -> None:
    # A batch of 0 messages broke every inline send (range() with a step of 0); a timeout of
    # -1 s would fail every request. Refused at start, before anything is served or sent.
    env = platform_env(
        PORT=str(free_port()),
        DATABASE_URL="postgres://postgres@127.0.0.1:5432/never-used",
        REDIS_URL="redis://127.0.0.1:6379/15",
        DOVECOTE_DRAIN_BATCH_SIZE="0",
        DOVECOTE_TELEGRAM_READ_TIMEOUT="-1",
        DOVECOTE_OUTBOX_RETENTION_DAYS="0",  # 0 keeps sent messages for ever: in range
    )
    done = subprocess.run(
        ["bash", "-c", procfile()[process]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert (
        "dovecote: out of range: DOVECOTE_DRAIN_BATCH_SIZE=0 (at least 1), DOVECOTE_TELEGRAM_READ_TIMEOUT=-1 (above 0)."
        in done.stderr
    )
    assert "Traceback" not in done.stderr


def test_a_number_that_cannot_be_read_is_named_in_one_line() -> None:
    env = platform_env(
        DATABASE_URL="postgres://postgres@127.0.0.1:5432/never-used",
        REDIS_URL="redis://127.0.0.1:6379/15",
        DOVECOTE_DRAIN_BATCH_SIZE="eight",
    )
    done = subprocess.run(
        [str(VENV_BIN / "python"), "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("dovecote: DOVECOTE_DRAIN_BATCH_SIZE='eight' is not an integer")


@pytest.mark.parametrize(
    ("environment", "words"),
    [
        ({"SECRET_KEY": ""}, "dovecote: SECRET_KEY, DATABASE_URL, REDIS_URL must be set when DEBUG is off"),
        # Development too: no SQLite or file broker to fall back on, and what starts a pair.
        (
            {"DEBUG": "1"},
            "dovecote: DATABASE_URL, REDIS_URL must be set (`make demo` starts a PostgreSQL and a Redis of its own).",
        ),
    ],
    ids=["production", "development"],
)
def test_every_missing_variable_is_named_in_one_line(environment: dict[str, str], words: str) -> None:
    done = subprocess.run(
        [str(VENV_BIN / "python"), "manage.py", "check"],
        cwd=ROOT,
        env=platform_env(**environment),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(words)


# The production settings the README's "Deploy" section recommends.
RECOMMENDED = {
    "SECRET_KEY": "x" * 50 + "recommended-production-secret-key",
    "ALLOWED_HOSTS": "bot.example.com",
    "CSRF_TRUSTED_ORIGINS": "https://bot.example.com",
    "SECURE_SSL_REDIRECT": "1",
    "SECURE_HSTS_SECONDS": "31536000",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": "1",
    "SECURE_HSTS_PRELOAD": "1",
    "DOVECOTE_METRICS_TOKEN": "scraper-token",
}


def test_check_deploy_with_the_recommended_production_settings_reports_nothing() -> None:
    env = platform_env(
        DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres", REDIS_URL="redis://127.0.0.1:6379/15", **RECOMMENDED
    )
    done = subprocess.run(
        [str(VENV_BIN / "python"), "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "System check identified no issues" in done.stdout


CELERY_CONF = (
    "from project.celery import app; c = app.conf; "
    "print(c.broker_url, sorted(c.broker_transport_options), bool(c.broker_use_ssl), sep='|')"
)


@pytest.mark.parametrize(
    ("broker_env", "expected"),
    [
        ({}, ["redis://127.0.0.1:6379/3", "['global_keyprefix', 'visibility_timeout']", "False"]),
        (
            {"CELERY_BROKER_URL": "amqp://guest:guest@127.0.0.1:5672//"},
            ["amqp://guest:guest@127.0.0.1:5672//", "[]", "False"],
        ),
        (
            {"DOVECOTE_BROKER_URL": "amqp://guest:guest@127.0.0.1:5672//"},
            ["amqp://guest:guest@127.0.0.1:5672//", "[]", "False"],
        ),
        (
            {"REDIS_URL": "rediss://127.0.0.1:6380/0"},
            ["rediss://127.0.0.1:6380/0", "['global_keyprefix', 'visibility_timeout']", "True"],
        ),
    ],
)
def test_the_broker_gets_redis_only_options_and_tls_only_when_it_is_redis(broker_env: dict, expected: list) -> None:
    env = platform_env(DATABASE_URL="postgres://postgres@127.0.0.1:5432/dovecote", DOVECOTE_REDIS_PREFIX="deploy:")
    env.pop("CELERY_BROKER_URL", None)
    env.update({"REDIS_URL": "redis://127.0.0.1:6379/3", **broker_env})
    out = subprocess.run(
        [str(VENV_BIN / "python"), "-c", f"import django; django.setup(); {CELERY_CONF}"],
        cwd=ROOT,
        env={**env, "DJANGO_SETTINGS_MODULE": "project.settings"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.stdout.strip().splitlines()[-1].split("|") == expected, out.stderr


_POOLED_DB = (
    "import json, django; django.setup(); from django.conf import settings;"
    " d = settings.DATABASES['default'];"
    " print(json.dumps([d.get('DISABLE_SERVER_SIDE_CURSORS', False), d['OPTIONS'].get('prepare_threshold', 'unset'),"
    " d['OPTIONS'].get('server_side_binding', 'unset')]))"
)


@pytest.mark.parametrize(
    ("pooler", "expected"),
    [("transaction", [True, None, "unset"]), ("", [False, 5, "true"])],
)
def test_behind_a_transaction_pooler_no_session_state_is_used_whatever_the_url_asks(
    pooler: str, expected: list[object]
) -> None:
    # A DATABASE_URL may carry psycopg options: under transaction pooling they must not turn
    # server-side prepared statements or binding back on.
    url = "postgres://postgres@127.0.0.1:6432/dovecote?prepare_threshold=5&server_side_binding=true"
    env = platform_env(DATABASE_URL=url, REDIS_URL="redis://127.0.0.1:6379/15", DATABASE_POOLER=pooler)
    done = subprocess.run(
        [str(VENV_BIN / "python"), "-c", _POOLED_DB], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == expected


def test_two_web_processes_on_one_host_both_serve_and_leave_each_others_control_socket(
    tmp_path, processes: list[Process]
) -> None:
    # gunicorn 25.1+ opens a control socket at $XDG_RUNTIME_DIR/gunicorn.ctl by default: each
    # instance unlinked what was there and bound its own, and the first to stop removed the
    # path another was still using. A socket of someone else's sits where that default points.
    runtime = tmp_path / "run"
    runtime.mkdir()
    path = runtime / "gunicorn.ctl"
    theirs = socket.socket(socket.AF_UNIX)
    theirs.bind(str(path))
    theirs.listen()
    inode = path.stat().st_ino
    env = platform_env(DEBUG="1", WEB_CONCURRENCY="1", XDG_RUNTIME_DIR=str(runtime), HOME=str(tmp_path), **DEV_SERVICES)
    urls = []
    for name in ("web-a", "web-b"):
        port = free_port()
        processes.append(Process(name, ["bash", "-c", procfile()["web"]], {**env, "PORT": str(port)}))
        urls.append(f"http://127.0.0.1:{port}")

    def serving(url: str) -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    for url in urls:
        wait_until(lambda url=url: serving(url), timeout=30, message=f"{url} to serve")
    for proc in processes:
        proc.stop()

    assert sorted(p.name for p in tmp_path.rglob("*.ctl")) == ["gunicorn.ctl"]
    assert path.stat().st_ino == inode
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(str(path))  # still the one its owner listens on
    theirs.close()


_API_HOSTS = (
    "import json, django; django.setup(); from outbox.botapi import api_host_allowed;"
    " urls = ['https://api.telegram.org', 'http://127.0.0.1:8081', 'http://localhost:8081', 'http://[::1]:8081',"
    " 'http://10.1.2.3:8081'];"
    " print(json.dumps([url for url in urls if api_host_allowed(url)]))"
)


@pytest.mark.parametrize(
    ("environment", "allowed"),
    [
        # Production: Telegram only; a loopback Bot API server must be named.
        ({"DEBUG": "0"}, ["https://api.telegram.org"]),
        (
            {"DEBUG": "0", "TELEGRAM_API_BASE_URL": "http://10.1.2.3:8081"},
            ["https://api.telegram.org", "http://10.1.2.3:8081"],
        ),
        (
            {"DEBUG": "0", "DOVECOTE_BOT_API_HOSTS": "api.telegram.org,localhost"},
            ["https://api.telegram.org", "http://localhost:8081"],
        ),
        # Development: the sandbox and a local Bot API server on loopback, by any of its names.
        (
            {"DEBUG": "1"},
            ["https://api.telegram.org", "http://127.0.0.1:8081", "http://localhost:8081", "http://[::1]:8081"],
        ),
    ],
)
def test_loopback_bot_api_hosts_are_allowed_by_default_only_with_debug_on(environment: dict, allowed: list) -> None:
    # Every Bot API request carries the bot's token: in production a bot's api_base_url on
    # loopback could hand it to whatever else listens on the host.
    env = platform_env(
        DATABASE_URL="postgres://postgres@127.0.0.1:5432/never-used", REDIS_URL="redis://127.0.0.1:6379/15"
    )
    for name in ("DOVECOTE_BOT_API_HOSTS", "TELEGRAM_API_BASE_URL"):
        env.pop(name, None)
    env.update(environment)
    done = subprocess.run(
        [str(VENV_BIN / "python"), "-c", _API_HOSTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == allowed


# A URL the settings cannot use, and the words of the one line that says what is wrong with it.
MALFORMED_URLS = [
    ("DATABASE_URL", "postgres//x", "DATABASE_URL='postgres//x': not a URL"),
    ("DATABASE_URL", "notaurl", "DATABASE_URL='notaurl': not a URL"),
    ("DATABASE_URL", "http://db.example.com/dovecote", "unknown database scheme 'http'"),
    ("DATABASE_URL", "sqlite:///var/dovecote.sqlite3", "unknown database scheme 'sqlite'"),
    (
        "DATABASE_URL",
        "postgres://dove:s3cret@db.example.com:99999/dovecote",
        "port '99999' is not a number from 1 to 65535",
    ),
    ("DATABASE_URL", "postgres://dove@db.example.com:five/dovecote", "port 'five' is not a number from 1 to 65535"),
    ("DATABASE_URL", "postgres://dove@db.example.com/", "names no database"),
    ("REDIS_URL", "redis:/x", "REDIS_URL='redis:/x': no host"),
    ("REDIS_URL", "notaurl", "REDIS_URL='notaurl': not a URL"),
    ("REDIS_URL", "http://redis.example.com:6379/0", "the scheme must be redis:// or rediss://"),
    ("REDIS_URL", "redis://:s3cret@redis.example.com:70000/0", "port '70000' is not a number from 1 to 65535"),
    ("REDIS_URL", "redis://redis.example.com:6379/zero", "database number 'zero' is not an integer"),
]


def _malformed_env(name: str, url: str) -> dict[str, str]:
    env = platform_env(
        PORT=str(free_port()),
        DATABASE_URL="postgres://postgres@127.0.0.1:5432/never-used",
        REDIS_URL="redis://127.0.0.1:6379/15",
    )
    env.pop("CELERY_BROKER_URL", None)
    env[name] = url
    return env


@pytest.mark.parametrize(("name", "url", "words"), MALFORMED_URLS)
def test_check_refuses_a_malformed_service_url_in_one_line_naming_it(name: str, url: str, words: str) -> None:
    # Before: a KeyError traceback from the database URL's parser, or (for REDIS_URL) a check
    # that passed and a worker that logged a traceback per connection attempt.
    done = subprocess.run(
        [str(VENV_BIN / "python"), "manage.py", "check"],
        cwd=ROOT,
        env=_malformed_env(name, url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"dovecote: {name}="), line
    assert words in line
    assert "s3cret" not in line  # a password in the URL is not printed


@pytest.mark.parametrize("process", ["release", "web", "worker", "beat"])
@pytest.mark.parametrize(
    ("name", "url"), [("DATABASE_URL", "postgres//x"), ("REDIS_URL", "redis:/x")], ids=["database", "redis"]
)
def test_every_process_refuses_to_start_with_a_malformed_service_url(process: str, name: str, url: str) -> None:
    done = subprocess.run(
        ["bash", "-c", procfile()[process]],
        cwd=ROOT,
        env=_malformed_env(name, url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    # One line, besides gunicorn's own "[time] [pid] [INFO] Starting gunicorn".
    [line] = [line for line in done.stderr.splitlines() if not line.startswith("[")]
    assert line.startswith(f"dovecote: {name}={url!r}: ")


def test_the_readmes_honcho_command_serves_the_web_where_the_readme_says(processes: list[Process]) -> None:
    # honcho gives each process PORT (5000 unless told otherwise): the README's command must
    # name the port the rest of the README uses, and honcho's port must reach gunicorn.
    readme = "\n".join((ROOT / path).read_text() for path in ("README.md", "docs/OPERATIONS.md", "docs/API.md"))
    commands = [line for line in readme.splitlines() if line.startswith("honcho start")]
    assert commands
    for command in commands:
        documented = re.match(r"honcho start -p (\d+) web worker beat\b", command)
        assert documented, command
        assert documented[1] == "8000", command
    assert f"http://127.0.0.1:{documented[1]}/api/v1/messages/" in readme

    port = free_port()
    honcho = Process(
        "honcho", [str(VENV_BIN / "honcho"), "start", "-p", str(port), "web"], platform_env(DEBUG="1", **DEV_SERVICES)
    )
    processes.append(honcho)
    wait_until(lambda: "Listening at" in honcho.log() or not honcho.alive(), timeout=30, message="gunicorn to listen")
    assert f"Listening at: http://0.0.0.0:{port}" in honcho.log()
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=60).json() == {"ok": True}
