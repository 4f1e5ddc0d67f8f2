# Dovecote's image: one image for every process type (web, worker, beat, release), as the
# Procfile runs them. Build: docker build -t dovecote .   Run them all: docker-compose.yml.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Every transitive dependency pinned with its hash (`make lock` writes the file).
COPY requirements.lock ./
RUN pip install --require-hashes -r requirements.lock

COPY . .

# Static files at build time, as a Procfile platform's build does. The settings refuse to load
# without these variables; collectstatic connects to neither service, so placeholders do.
RUN SECRET_KEY=build DATABASE_URL=postgres://build@localhost/build REDIS_URL=redis://localhost:6379/0 \
    python manage.py collectstatic --noinput -v 0

RUN useradd --create-home --uid 10001 dovecote && mkdir -p /app/var && chown dovecote /app/var
USER dovecote

# gunicorn.conf.py listens on 0.0.0.0:$PORT when PORT is set.
ENV PORT=8000
EXPOSE 8000
CMD ["gunicorn", "project.wsgi"]
