"""project.test_settings plus the awaiting test app (its consumers.py is discovered at start-up)."""

from project.test_settings import *  # noqa: F403
from project.test_settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.e2e.awaiting"]
