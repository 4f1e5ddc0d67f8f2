"""A developer's consumers outside any installed app, found through DOVECOTE_CONSUMER_MODULES
(tests/bots/test_consumer_modules.py)."""

from bots.registry import ConsumerContext, consumer


@consumer("button_presses", update_types=["callback_query"])
def button_presses(ctx: ConsumerContext) -> str:
    return "pressed"
