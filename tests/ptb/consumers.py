"""python-telegram-bot's example bots as Dovecote consumers, each for a bot of its own name
(the tests create the bots)."""

from bots.ptb import ptb_consumer

ptb_consumer("ptb_echo", bot="ptb-echo", main="tests.ptb.examples.echobot:main", serial="chat")
ptb_consumer("ptb_conversation", bot="ptb-conv", main="tests.ptb.examples.conversationbot:main", serial="chat")
ptb_consumer("ptb_conversation2", bot="ptb-conv2", main="tests.ptb.examples.conversationbot2:main", serial="chat")
