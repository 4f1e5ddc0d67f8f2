"""python-telegram-bot's example bots as Dovecote consumers, each for a bot of its own name
(the tests create the bots)."""

from bots.ptb import ptb_consumer

ptb_consumer("ptb_echo", bot="ptb-echo", main="tests.ptb.examples.echobot:main", serial="chat")
