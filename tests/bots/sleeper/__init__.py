"""A test app with one consumer that overruns its time limit, for real workers: start a worker
with DJANGO_SETTINGS_MODULE=tests.bots.sleeper.settings and it routes messages to `sleeper`."""
