#!/usr/bin/env bash
# Make sure PostgreSQL, Redis and RabbitMQ run on 127.0.0.1 for `make test`: install them from
# Debian's packages when missing (as root), start them when installed but stopped; install the
# tools single tests run themselves (PgBouncer, Prometheus, Chromium, redis-server and openssl
# for the TLS test) when missing. Never stops anything. Without RabbitMQ or one of those tools
# its tests are skipped, saying why (tests.support.require_tool); under CI (CI=true) this
# script fails instead, naming them, and so would those tests.
set -euo pipefail

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else "$@"; fi; }

apt_updated=""
apt_install() {
  [ -n "$apt_updated" ] || { as_root apt-get update -qq; apt_updated=1; }
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

pg_up() { pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; }

if ! pg_up; then
  if ! command -v pg_ctlcluster >/dev/null; then
    echo "services: installing PostgreSQL"
    apt_install postgresql
    fresh_pg=1
  fi
  version=$(ls /etc/postgresql | sort -V | tail -n1)
  if [ "${fresh_pg:-}" = 1 ]; then
    # A fresh cluster asks for passwords over TCP; the test suite connects as postgres
    # without one, as on the CI machines (trust on loopback only).
    hba=/etc/postgresql/$version/main/pg_hba.conf
    as_root sed -i -E 's/^(host\s+all\s+all\s+(127\.0\.0\.1\/32|::1\/128)\s+)\S+/\1trust/' "$hba"
  fi
  echo "services: starting PostgreSQL $version"
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 1 30); do pg_up && break; sleep 1; done
  pg_up || { echo "services: PostgreSQL did not start" >&2; exit 1; }
fi

redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; }

if ! redis_up; then
  if ! command -v redis-server >/dev/null; then
    echo "services: installing Redis"
    apt_install redis-server
  fi
  echo "services: starting Redis"
  as_root mkdir -p /var/lib/redis /var/log/redis
  as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 1 30); do redis_up && break; sleep 0.5; done
  redis_up || { echo "services: Redis did not start" >&2; exit 1; }
fi

rabbit_up() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }

if ! rabbit_up; then
  if ! command -v rabbitmq-server >/dev/null; then
    echo "services: installing RabbitMQ"
    if apt_install rabbitmq-server; then
      # Loopback only, as PostgreSQL and Redis; guest/guest is refused from elsewhere anyway.
      echo "listeners.tcp.local = 127.0.0.1:5672" | as_root tee -a /etc/rabbitmq/rabbitmq.conf >/dev/null
    fi
  fi
  if command -v rabbitmq-server >/dev/null; then
    echo "services: starting RabbitMQ"
    # The init script where there is no systemd (containers, CI); the server itself otherwise.
    as_root /etc/init.d/rabbitmq-server start >/dev/null 2>&1 || as_root rabbitmq-server -detached || true
    for _ in $(seq 1 60); do rabbit_up && break; sleep 1; done
  fi
  rabbit_up || echo "services: RabbitMQ did not start" >&2
fi

# The TLS test (tests/test_redis_tls.py) runs a redis-server of its own, with a certificate
# openssl makes: both binaries are needed even where Redis itself runs on another host.
if ! command -v redis-server >/dev/null || ! command -v openssl >/dev/null; then
  echo "services: installing redis-server and openssl for the TLS Redis test"
  apt_install redis-server openssl || echo "services: redis-server or openssl could not be installed" >&2
fi

# The PgBouncer test (tests/e2e/test_pgbouncer.py) starts its own pgbouncer on a free port.
if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then
  echo "services: installing PgBouncer for the transaction-pooling test"
  apt_install pgbouncer || echo "services: PgBouncer could not be installed" >&2
fi

# The browser test drives Debian's Chromium (Playwright's own browser download is not reachable).
if [ ! -x /usr/bin/chromium ]; then
  echo "services: installing Chromium for the browser test"
  apt_install chromium || echo "services: Chromium could not be installed" >&2
fi

# The alert rules are checked by promtool, and the monitoring e2e test runs a real Prometheus:
# both come with Debian's `prometheus` package (without recommends: no node exporter). Its
# service may start on :9090; the tests run their own on a free port.
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  echo "services: installing Prometheus (promtool) for the alert rule tests"
  apt_install --no-install-recommends prometheus || echo "services: Prometheus could not be installed" >&2
fi

# What those tests find, after the installs above (README's "Tests" has the table).
pgbouncer_here() { command -v pgbouncer || [ -x /usr/sbin/pgbouncer ]; }
missing=()
have() { local tool=$1; shift; "$@" >/dev/null 2>&1 || missing+=("$tool"); }
have RabbitMQ rabbit_up
have redis-server command -v redis-server
have openssl command -v openssl
have pgbouncer pgbouncer_here
have chromium test -x /usr/bin/chromium
have promtool command -v promtool
have prometheus command -v prometheus
if [ "${#missing[@]}" -gt 0 ]; then
  if [[ "${CI:-}" =~ ^(1|[Tt][Rr][Uu][Ee]|[Yy][Ee][Ss])$ ]]; then
    echo "services: not available: ${missing[*]}; under CI=true a test is never skipped for want of a tool" >&2
    exit 1
  fi
  echo "services: not available: ${missing[*]}; the tests that need them will be skipped" >&2
fi
