"""project.test_settings plus the chatorder app (its consumers.py is discovered at start-up)."""

from project.test_settings import *  # noqa: F403
from project.test_settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.bots.chatorder"]
