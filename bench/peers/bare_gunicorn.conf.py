"""gunicorn's settings for the bare Django peer (bench/peers/bare_view.py): the same shape as
Dovecote's web process (2 processes x 4 threads, gthread), without its access log."""

import os

bind = [os.environ.get("BIND", "127.0.0.1:8100")]
workers = 2
threads = 4
accesslog = None
