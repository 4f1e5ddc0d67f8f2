"""python-telegram-bot's example bots (tests/ptb/examples), and the tests' own handlers
(tests/ptb/handlers.py), as Dovecote consumers, each for a bot of its own name (the tests
create the bots)."""

from bots.ptb import ptb_consumer

EXAMPLES = "tests.ptb.examples"
ptb_consumer("ptb_echo", bot="ptb-echo", main=f"{EXAMPLES}.echobot:main", serial="chat")
ptb_consumer("ptb_conversation", bot="ptb-conv", main=f"{EXAMPLES}.conversationbot:main", serial="chat")
ptb_consumer("ptb_conversation2", bot="ptb-conv2", main=f"{EXAMPLES}.conversationbot2:main", serial="chat")
ptb_consumer("ptb_keyboard", bot="ptb-keyboard", main=f"{EXAMPLES}.inlinekeyboard:main", serial="chat")
ptb_consumer("ptb_timer", bot="ptb-timer", main=f"{EXAMPLES}.timerbot:main", serial="chat")
ptb_consumer("ptb_branching", bot="ptb-branching", setup="tests.ptb.handlers:add_branching")
ptb_consumer("ptb_varying", bot="ptb-varying", setup="tests.ptb.handlers:add_varying")
ptb_consumer("ptb_five", bot="ptb-five", setup="tests.ptb.handlers:add_five")
