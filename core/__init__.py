"""Plumbing every app uses: connections, ids, logging, metrics, publishing, wake-ups,
leases, failpoints, payload display and the one-statement row writes. It imports nothing
from the apps (import-linter checks it: `make lint`)."""
