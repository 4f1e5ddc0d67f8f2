"""project.test_settings plus the tests.ptb app, whose consumers.py registers the vendored
python-telegram-bot examples (tests/ptb/examples) as Dovecote consumers."""

from project.test_settings import *  # noqa: F403
from project.test_settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.ptb"]
