"""A test app of slow consumers for real workers (start them with
DJANGO_SETTINGS_MODULE=tests.bots.chatorder.settings): one holds its transaction open after
writing a reply, one works longer than a short lease."""
