"""A test app with one consumer that holds its transaction open after writing a reply, for
real workers: start them with DJANGO_SETTINGS_MODULE=tests.bots.chatorder.settings."""
