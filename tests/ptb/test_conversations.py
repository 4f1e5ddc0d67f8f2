"""Acceptance 2 and 3: python-telegram-bot's conversationbot.py and conversationbot2.py,
unmodified but for their import line, as Dovecote consumers with serial="chat". Their
ConversationHandler states and user_data live in PostgreSQL (bots/ptb/persistence.py),
loaded for the update's user and chat, written with the run's completion."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bots.models import ConsumerRun, RunState
from bots.ptb.models import HandlerData
from tests.ptb.support import ptb_worker, sweep_once, user_sends_location, user_writes
from tests.support import ROOT, Process, wait_until

pytestmark = [pytest.mark.e2e]

START = (
    "Hi! My name is Professor Bot. I will hold a conversation with you. Send /cancel to stop talking to me.\n\n"
    "Are you a boy or a girl?"
)
ASK_PHOTO = (
    "I see! Please send me a photo of yourself, so I know what you look like, or send /skip if you don't want to."
)
GORGEOUS = "Gorgeous! Now, send me your location please, or send /skip if you don't want to."
SKIPPED_PHOTO = "I bet you look great! Now, send me your location please, or send /skip."
GOT_LOCATION = "Maybe I can visit you sometime! At last, tell me something about yourself."
SKIPPED_LOCATION = "You seem a bit paranoid! At last, tell me something about yourself."
THANKS = "Thank you! I hope we can talk again some day."
BYE = "Bye! I hope we can talk again some day."

# What each user sends, and the prompts they must see, in order.
PATHS = {
    "skip": (
        ["/start", "Boy", "/skip", "/skip", "I like tea"],
        [START, ASK_PHOTO, SKIPPED_PHOTO, SKIPPED_LOCATION, THANKS],
    ),
    "cancel": (["/start", "Girl", "/cancel"], [START, ASK_PHOTO, BYE]),
    "photo": (
        ["/start", "Boy", "PHOTO", "/skip", "I take pictures"],
        [START, ASK_PHOTO, GORGEOUS, SKIPPED_LOCATION, THANKS],
    ),
    "location": (
        ["/start", "other", "/skip", "LOCATION", "I sail"],
        [START, ASK_PHOTO, SKIPPED_PHOTO, GOT_LOCATION, THANKS],
    ),
}
USERS = [9300 + n for n in range(20)]  # 5 of each path


def path_of(user: int) -> str:
    return list(PATHS)[user % len(PATHS)]


def all_runs_done(consumer: str) -> bool:
    sweep_once()
    runs = ConsumerRun.objects.filter(consumer=consumer)
    return runs.exists() and not runs.exclude(state=RunState.DONE).exists()


@pytest.fixture
def photo_file() -> Iterator[Path]:
    """conversationbot.py downloads each user's photo to ./user_photo.jpg (the worker's
    working directory is the repository's root)."""
    path = ROOT / "user_photo.jpg"
    yield path
    path.unlink(missing_ok=True)


def test_conversationbot_20_users_see_their_prompts_in_order_through_two_worker_kills(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory, photo_file: Path
) -> None:
    bot = bot_factory(name="ptb-conv", responder="none")
    steps = max(len(sends) for sends, _ in PATHS.values())
    for step in range(steps):
        for user in USERS:
            sends = PATHS[path_of(user)][0]
            if step >= len(sends):
                continue
            if sends[step] == "LOCATION":
                user_sends_location(bot, user, 52.37, 4.89)
            elif sends[step] == "PHOTO":
                user_writes(sandbox, bot, user, "", photo=True)
            else:
                user_writes(sandbox, bot, user, sends[step])

    # Killed mid-conversation twice: once with a handling's answer recorded but not its
    # completion (nor its new state), once with a prompt journaled and not yet sent.
    for point in ("ptb_before_commit", "ptb_after_journal"):
        doomed = ptb_worker(process_env, processes, failpoint=point, name=f"doomed-{point}")
        wait_until(lambda doomed=doomed: not doomed.alive(), timeout=60, message=f"the worker to die at {point}")
    ptb_worker(process_env, processes, name="fresh")
    wait_until(lambda: all_runs_done("ptb_conversation"), timeout=180, interval=1.0, message="every run done")

    for user in USERS:
        assert sandbox.sent_texts(token=bot.token, chat_id=user) == PATHS[path_of(user)][1], user
    assert photo_file.read_bytes().startswith(b"sandbox photo 800x600")  # the photos were downloaded
    # Every conversation ended: no state is left.
    assert not HandlerData.objects.filter(consumer="ptb_conversation", kind=HandlerData.Kind.CONVERSATION).exists()


def facts(**told: str) -> str:
    return "\n".join(f"{k} - {v}" for k, v in told.items()).join(["\n", "\n"])


MENU_START = (
    "Hi! My name is Doctor Botter. I will hold a more complex conversation with you. "
    "Why don't you tell me something about yourself?"
)


def neat(**told: str) -> str:
    return (
        f"Neat! Just so you know, this is what you already told me:{facts(**told)}"
        "You can tell me more, or change your opinion on something."
    )


def test_conversationbot2_user_data_survives_a_worker_restart(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory(name="ptb-conv2", responder="none")
    chat = 9400
    first = ptb_worker(process_env, processes, name="first")
    for text in ("/start", "Age", "21"):
        user_writes(sandbox, bot, chat, text)
    wait_until(lambda: all_runs_done("ptb_conversation2"), timeout=60, interval=0.5, message="the first runs done")
    first.kill()
    ptb_worker(process_env, processes, name="second")
    for text in ("Favourite colour", "blue", "Done"):
        user_writes(sandbox, bot, chat, text)
    wait_until(lambda: all_runs_done("ptb_conversation2"), timeout=60, interval=0.5, message="the last runs done")

    assert sandbox.sent_texts(token=bot.token, chat_id=chat) == [
        MENU_START,
        "Your age? Yes, I would love to hear about that!",
        neat(Age="21"),
        "Your favourite colour? Yes, I would love to hear about that!",
        neat(Age="21", **{"Favourite colour": "blue"}),
        f"I learned these facts about you: {facts(Age='21', **{'Favourite colour': 'blue'})}Until next time!",
    ]
    # "Done" cleared user_data and ended the conversation.
    user_data = HandlerData.objects.get(consumer="ptb_conversation2", kind=HandlerData.Kind.USER, key=str(chat))
    assert user_data.data == "{}"


def test_conversationbot2_ten_fast_messages_of_one_chat_run_in_update_order_at_concurrency_4(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory(name="ptb-conv2", responder="none")
    chat = 9401
    ptb_worker(process_env, processes, name="four", pool="prefork", concurrency=4)
    sends = ["/start", "Age", "30", "Favourite colour", "green", "Number of siblings", "3", "Age", "31", "Done"]
    for text in sends:
        user_writes(sandbox, bot, chat, text)
    wait_until(lambda: all_runs_done("ptb_conversation2"), timeout=90, interval=0.5, message="every run done")

    told = {"Age": "31", "Favourite colour": "green", "Number of siblings": "3"}
    assert sandbox.sent_texts(token=bot.token, chat_id=chat) == [
        MENU_START,
        "Your age? Yes, I would love to hear about that!",
        neat(Age="30"),
        "Your favourite colour? Yes, I would love to hear about that!",
        neat(Age="30", **{"Favourite colour": "green"}),
        "Your number of siblings? Yes, I would love to hear about that!",
        neat(Age="30", **{"Favourite colour": "green", "Number of siblings": "3"}),
        "Your age? Yes, I would love to hear about that!",
        neat(**told),
        f"I learned these facts about you: {facts(**told)}Until next time!",
    ]
